"""Tests written because mutants of a seeded sample of the planner (``tests/mutation.py sample``, seed 7)
survived the suite. Each pins down something a caller of the planner can see -- a term's label, an
error message, the dtype a plan keeps for embeddings -- that no other test checked."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from kvledger.core import gpus
from kvledger.core.geometry import KVSpec
from kvledger.core.inventory import build_inventory
from kvledger.core.models import load_model_config
from kvledger.core.params import weight_plan
from kvledger.errors import ConfigError

GiB = 2**30


def test_a_bad_nvidia_smi_total_in_the_gpu_catalogue_names_the_field() -> None:
    """A catalogue row whose nvidia-smi total is not positive is refused with a message naming
    ``nvidia_smi_total_mib``."""
    rows = json.loads(resources.files("kvledger").joinpath("data", "gpus.json").read_text(encoding="utf-8"))["gpus"]
    h100 = next(r for r in rows if r["name"] == "h100-80gb")
    with pytest.raises(ConfigError, match=r"^GPU catalogue: nvidia_smi_total_mib must be a positive number, got 0$"):
        gpus._gpu(dict(h100, nvidia_smi_total_mib=0))


def test_a_given_workspace_is_labelled_activation_workspace() -> None:
    """--workspace with a model config: the report's workspace line reads 'activation workspace', with
    the given bytes and where they came from."""
    cfg = load_model_config("llama-3.1-8b")
    inv = build_inventory(KVSpec.from_hf_config(cfg), cfg, device_bytes="80GiB", engine="vllm",
                          workspace_bytes=3 * GiB)
    term = next(t for t in inv.terms if t.key == "workspace")
    assert (term.label, term.bytes, term.formula) == ("activation workspace", 3 * GiB, "given (--workspace)")


def test_a_request_of_no_tokens_is_refused_with_its_message() -> None:
    """prompt 0 and max_new 0: the error says exactly that a request needs at least one token."""
    inv = build_inventory(KVSpec(layers=32, kv_heads=8, head_dim=128), pool_bytes="1GiB")
    with pytest.raises(ConfigError, match=r"^a request needs at least one token \(prompt \+ max_new > 0\)$"):
        inv.blocks_per_request(0, 0)


def test_weight_dtype_bf16_keeps_embeddings_in_bf16_on_an_fp16_checkpoint() -> None:
    """--weight-dtype bf16 on an fp16 checkpoint serves everything in bf16: the plan's base dtype is bf16
    (not the config's fp16), so the plan is named plain 'bf16'."""
    plan = weight_plan({"torch_dtype": "float16"}, "bf16")
    assert plan.base == "bf16"
    assert plan.name == "bf16"
    assert plan.source == "--weight-dtype bf16"
