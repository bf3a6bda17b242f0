"""The model runner on tiny random Llama-family models equals transformers, step by step.

Each exactness test runs both CPU paths: ``torch`` (reference attention + torch layer kernels) and
``native`` (the compiled kernels ``make install`` builds; skipped only with ``KVLEDGER_NATIVE=0``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kvledger.core import Request
from kvledger.errors import ConfigError
from kvledger.runtime import DecoderConfig, LoopStats, ModelRunner, SeqStep, cache_root, generate_greedy, native
from kvledger.runtime.kernels import NativeKernels, TorchKernels

ATOL = 1e-4


@pytest.fixture(params=["torch", "native"])
def path_kind(request: pytest.FixtureRequest) -> str:
    if request.param == "native" and os.environ.get(native.NATIVE_ENV) == "0":
        pytest.skip("KVLEDGER_NATIVE=0: only the pure-torch paths")
    return request.param


def _runner(path: Path, kind: str, **kw: object) -> ModelRunner:
    """A runner on one CPU path: attention backend and layer kernels both torch, or both native."""
    kernels = NativeKernels() if kind == "native" else TorchKernels()
    runner = ModelRunner.from_pretrained(path, backend=kind, kernels=kernels, **kw)
    assert type(runner.backend).__name__ == ("NativePagedAttention" if kind == "native" else "TorchPagedAttention")
    return runner


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def _hf_last_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0, -1]


@torch.no_grad()
def _hf_generate(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_prefill_batch_logits_equal_transformers(tiny_llama, path_kind: str) -> None:
    path, hf = tiny_llama
    runner = _runner(path, path_kind, num_blocks=64, block_size=4)
    ledger = runner.new_ledger()
    prompts = _prompts([1, 6, 13, 30])
    for i, p in enumerate(prompts):
        ledger.admit(Request(f"r{i}", p, 4)).raise_for_outcome()
    logits = runner.forward([SeqStep.from_sequence(ledger.sequence(f"r{i}"), 0) for i in range(4)])
    assert logits.shape == (4, 256) and logits.dtype == torch.float32
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i], _hf_last_logits(hf, p), atol=ATOL, rtol=0)


def test_decode_driven_by_the_ledger_equals_generate(tiny_llama, path_kind: str) -> None:
    """admit -> slots from the table -> forward -> append_token, 4 sequences of different lengths."""
    path, hf = tiny_llama
    runner = _runner(path, path_kind, num_blocks=48, block_size=4)
    ledger = runner.new_ledger()
    prompts, new = _prompts([3, 8, 11, 21], seed=1), 10
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        ledger.admit(Request(rid, p, new)).raise_for_outcome()
    starts = [0] * len(rids)  # first step: the whole prompt
    for _ in range(new):
        seqs = [ledger.sequence(rid) for rid in rids]
        steps = [SeqStep.from_sequence(s, start) for s, start in zip(seqs, starts, strict=True)]
        logits = runner.forward(steps)
        for s, row in zip(seqs, logits, strict=True):
            torch.testing.assert_close(row, _hf_last_logits(hf, s.tokens), atol=ATOL, rtol=0)
        for rid, token in zip(rids, logits.argmax(-1).tolist(), strict=True):
            ledger.append_token(rid, token)
        ledger.check()
        starts = [s.num_tokens - 1 for s in seqs]  # next step: only the newest token
    for rid, p in zip(rids, prompts, strict=True):
        assert ledger.sequence(rid).tokens[len(p):] == _hf_generate(hf, p, new)
        ledger.release(rid)
    assert ledger.usage().active == 0


def test_staggered_admission_and_chunked_prefill(tiny_llama, path_kind: str) -> None:
    """A pool too small for all four: later requests prefill (in chunks) beside running decodes."""
    path, hf = tiny_llama
    runner = _runner(path, path_kind, num_blocks=12, block_size=4)
    prompts, new = _prompts([5, 9, 14, 20], seed=2), 6
    stats = LoopStats()
    out = generate_greedy(runner, runner.new_ledger(), prompts, new, chunk_size=5, stats=stats)
    assert stats.mixed_steps > 0 and stats.max_batch >= 2
    assert out == [_hf_generate(hf, p, new) for p in prompts]


def test_prefix_cache_hits_skip_compute_and_match(tiny_llama, path_kind: str) -> None:
    path, hf = tiny_llama
    runner = _runner(path, path_kind, num_blocks=32, block_size=4)
    ledger = runner.new_ledger()
    shared = _prompts([12], seed=3)[0]
    first, second = shared + [7, 8], shared + [9]
    assert generate_greedy(runner, ledger, [first], 5) == [_hf_generate(hf, first, 5)]
    stats = LoopStats()
    # `second` reuses the 3 written blocks `first` left in the prefix index: 12 tokens not recomputed.
    assert generate_greedy(runner, ledger, [second], 5, stats=stats) == [_hf_generate(hf, second, 5)]
    assert stats.cached_prompt_tokens == 12


def test_fork_with_copy_on_write_tail(tiny_llama, path_kind: str) -> None:
    """Parallel sampling: fork after prefill, branches take different first tokens. The shared
    partial tail is copied (the ledger's CopyOp, executed by the store) before either branch writes."""
    path, hf = tiny_llama
    runner = _runner(path, path_kind, num_blocks=32, block_size=4)
    ledger = runner.new_ledger()
    prompt, new = _prompts([10], seed=8)[0], 6  # 10 tokens: block 2 is a partial tail
    ledger.admit(Request("a", prompt, new)).raise_for_outcome()
    logits = runner.forward([SeqStep.from_sequence(ledger.sequence("a"), 0)])
    first, second = logits[0].topk(2).indices.tolist()
    ledger.fork("a", "b")
    ledger.append_token("a", first)
    ledger.append_token("b", second)
    copies = ledger.take_copies()
    assert len(copies) == 1 and copies[0].slots == 2  # positions 8 and 9 of the shared tail
    runner.store.copy_blocks(copies)
    assert ledger.sequence("a").table.blocks[2] != ledger.sequence("b").table.blocks[2]
    for _ in range(new - 1):
        seqs = [ledger.sequence(r) for r in ("a", "b")]
        logits = runner.forward([SeqStep.from_sequence(s, s.num_tokens - 1) for s in seqs])
        for rid, token in zip(("a", "b"), logits.argmax(-1).tolist(), strict=True):
            ledger.append_token(rid, token)
        runner.store.copy_blocks(ledger.take_copies())
        ledger.check()
    for rid, head in (("a", first), ("b", second)):
        tail = ledger.sequence(rid).tokens[len(prompt) + 1:]
        assert tail == _hf_generate(hf, prompt + [head], new - 1)


VARIANTS = {
    "qwen2-qkv-bias": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": 5}),
    "llama3-rope": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}),
    "biases-tied-mha": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
                                  "num_key_value_heads": 4, "head_dim": 8}),
    # Head dim 64 (SmolLM2's): the native prefill kernel instead of its SDPA fallback.
    "head-dim-64-gqa": ("llama", {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 64}),
    "head-dim-64-window": ("mistral", {"sliding_window": 5, "hidden_size": 128, "num_attention_heads": 2,
                                       "num_key_value_heads": 1, "head_dim": 64}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_family_variants(variant: str, make_tiny, path_kind: str) -> None:
    kind, overrides = VARIANTS[variant]
    path, hf = make_tiny(kind, seed=4, **overrides)
    runner = _runner(path, path_kind, num_blocks=32, block_size=4)
    if variant == "qwen2-qkv-bias":
        assert runner.config.qkv_bias and not runner.config.o_bias
    if variant == "mistral-window":
        assert runner.config.windows == (5, 5)
    prompts, new = _prompts([4, 11], seed=5), 8
    out = generate_greedy(runner, runner.new_ledger(), prompts, new)
    assert out == [_hf_generate(hf, p, new) for p in prompts]
    for p, o in zip(prompts, out, strict=True):  # logits after the last step, context past the window
        ledger = runner.new_ledger()
        ledger.admit(Request("x", p + o, 1)).raise_for_outcome()
        logits = runner.forward([SeqStep.from_sequence(ledger.sequence("x"), 0)])
        torch.testing.assert_close(logits[0], _hf_last_logits(hf, p + o), atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [None, 24])
def test_long_prompts_at_head_dim_64_equal_transformers(window: int | None, make_tiny, path_kind: str) -> None:
    """Prompts spanning several 32-query tiles and many blocks, one continued from a prefix hit."""
    kind, extra = ("mistral", {"sliding_window": window}) if window else ("llama", {})
    path, hf = make_tiny(kind, seed=9, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         **extra)
    runner = _runner(path, path_kind, num_blocks=128, block_size=4)
    ledger = runner.new_ledger()
    base = _prompts([70], seed=10)[0]
    prompts, new = [base, _prompts([45], seed=11)[0], base[:48] + [5, 6, 7]], 6
    out = generate_greedy(runner, ledger, prompts, new)
    assert out == [_hf_generate(hf, p, new) for p in prompts]


def test_bf16_runs_and_mostly_agrees(tiny_llama, path_kind: str) -> None:
    path, hf = tiny_llama
    runner = _runner(path, path_kind, num_blocks=16, block_size=4, dtype=torch.bfloat16)
    assert runner.store.dtype == torch.bfloat16 and runner.spec.kv_dtype == "bf16"
    prompt = _prompts([9], seed=6)[0]
    ledger = runner.new_ledger()
    ledger.admit(Request("x", prompt, 1)).raise_for_outcome()
    logits = runner.forward([SeqStep.from_sequence(ledger.sequence("x"), 0)])[0]
    torch.testing.assert_close(logits, _hf_last_logits(hf, prompt), atol=0.15, rtol=0.05)


# ---- errors ------------------------------------------------------------------------------------

def _write(folder: Path, cfg: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


BASE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "vocab_size": 256}


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({**BASE, "model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({**BASE, "model_type": "mixtral", "num_local_experts": 8}, "mixture-of-experts"),
        ({**BASE, "model_type": "qwen2_moe", "num_experts": 60}, "mixture-of-experts"),
        ({**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4}}, "'yarn'"),
        ({**BASE, "model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
        ({**BASE, "model_type": "llama", "num_key_value_heads": 3}, "multiple"),
    ],
)
def test_unsupported_configs(cfg: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        DecoderConfig.from_hf(cfg)
    with pytest.raises(ConfigError, match=message):
        ModelRunner.from_pretrained(_write(tmp_path / "m", cfg), num_blocks=4)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a model folder nor a .gguf"):
        ModelRunner.from_pretrained(tmp_path / "missing", num_blocks=4)
    with pytest.raises(ConfigError, match="neither config.json"):
        ModelRunner.from_pretrained(tmp_path, num_blocks=4)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**BASE, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        ModelRunner.from_pretrained(tmp_path / "m", num_blocks=4)


def test_missing_tensor_and_pool_arguments(tiny_llama, tmp_path: Path) -> None:
    path, _ = tiny_llama
    with pytest.raises(ConfigError, match="exactly one of num_blocks or pool_bytes"):
        ModelRunner.from_pretrained(path)
    runner = ModelRunner.from_pretrained(path, pool_bytes="64KiB", block_size=4)
    assert runner.store.nbytes == runner.spec.block_bytes * runner.store.num_blocks <= 64 * 1024
    cfg = json.loads((path / "config.json").read_text())
    broken = _write(tmp_path / "b", cfg)
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.zeros(256, 64)}, str(broken / "model.safetensors"))
    with pytest.raises(ConfigError, match="no tensor 'model.norm.weight'"):
        ModelRunner.from_pretrained(broken, num_blocks=4)


def test_slot_mapping_must_match_the_block_table(tiny_llama) -> None:
    runner = ModelRunner.from_pretrained(tiny_llama[0], num_blocks=8, block_size=4)
    with pytest.raises(ConfigError, match="disagrees with its block table"):
        runner.forward([SeqStep([1, 2], 0, [3], [12, 14])])
    with pytest.raises(ConfigError, match="2 tokens but 1 slots"):
        runner.forward([SeqStep([1, 2], 0, [3], [12])])
    with pytest.raises(ConfigError, match="disagrees"):  # the table does not reach position 4
        runner.forward([SeqStep([1, 2], 3, [3], [15, 16])])
    with pytest.raises(ConfigError, match="outside the 8-block store"):
        runner.forward([SeqStep([1], 0, [8], [32])])


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"
    monkeypatch.delenv("KVLEDGER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvledger"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "kvledger"


def test_fp8_kv_cache_with_fp32_compute(tiny_llama, path_kind: str) -> None:
    """K/V stored in one byte (the plain e4m3 cast), read back as fp32: the spec, the pool size and rough
    logits follow."""
    path, hf = tiny_llama
    runner = _runner(path, path_kind, num_blocks=16, block_size=4, kv_dtype="fp8_e4m3")
    assert runner.store.dtype == torch.float8_e4m3fn
    assert runner.store.nbytes == runner.spec.block_bytes * 16 == 2 * 2 * 2 * 16 * 4 * 16
    prompt = _prompts([9], seed=7)[0]
    ledger = runner.new_ledger()
    ledger.admit(Request("x", prompt, 1)).raise_for_outcome()
    logits = runner.forward([SeqStep.from_sequence(ledger.sequence("x"), 0)])[0]
    torch.testing.assert_close(logits, _hf_last_logits(hf, prompt), atol=0.3, rtol=0.1)
