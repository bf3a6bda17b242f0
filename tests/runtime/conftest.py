"""Shared fixtures of the runtime tests: offline Hugging Face, few threads, tiny random models."""

from __future__ import annotations

import os

# Before transformers is imported anywhere: never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Before torch starts OpenMP: on shared cores, spinning threads wait for each other's time slices
# (a 40 us attention call measured 6 ms with two active-waiting threads on a busy 2-core box).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The test machine has 2 shared cores; more threads only add contention for these small matmuls.
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "model: uses a real pretrained model shipped by a Python package")


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Wider-than-default random weights, so greedy argmax has clear margins (no near ties that a
    1e-6 difference in summation order could flip)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def save_tiny(kind: str, path: Path, seed: int = 0, **overrides: object) -> tuple[Path, torch.nn.Module]:
    """Build a tiny random HF model of ``kind`` (llama / qwen2 / mistral), save it as safetensors."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[kind]
    kw: dict[str, object] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        attn_implementation="sdpa",
        # No EOS: generate() would stop early on a random model's token 2 and the runs would differ.
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    kw.update(overrides)
    model = model_cls(config_cls(**kw)).float().eval()
    _randomise(model, seed)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory: pytest.TempPathFactory):
    """``make_tiny(kind, **config_overrides) -> (folder, hf_model)``, a fresh folder per call."""
    def make(kind: str, seed: int = 0, **overrides: object) -> tuple[Path, torch.nn.Module]:
        return save_tiny(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), seed, **overrides)
    return make


@pytest.fixture(scope="session")
def tiny_llama(make_tiny) -> tuple[Path, torch.nn.Module]:
    return make_tiny("llama")
