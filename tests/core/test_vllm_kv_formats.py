"""vLLM's --kv-cache-dtype values mean what they mean in vLLM: ``fp8`` and ``fp8_e4m3`` are the unscaled e4m3
cast and ``fp8_e5m2`` the unscaled e5m2 cast (1 byte per value, no scale beside it); kvledger's scaled e4m3 is
``fp8-scaled``. Known answers from the published Llama-3.1-8B geometry (32 layers, 8 KV heads of 128)."""

from __future__ import annotations

import pytest

from kvledger.core.sizing.geometry import KVSpec, canonical_dtype
from kvledger.core.sizing.kv_formats import KV_FORMATS, vllm_serves
from kvledger.core.sizing.models import load_model_config

LLAMA_BF16_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # 131,072 B: K and V of every layer, 2 bytes a value


def _llama(kv_dtype: str | None) -> KVSpec:
    return KVSpec.from_hf_config(load_model_config("llama-3.1-8b"), kv_dtype=kv_dtype)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2", "FP8", "float8_e4m3fn"])
def test_vllms_fp8_values_cost_half_of_bf16_with_no_metadata(name: str) -> None:
    spec = _llama(name)
    assert _llama(None).bytes_per_token == LLAMA_BF16_PER_TOKEN  # auto: the model's dtype (bf16)
    assert spec.bytes_per_token == LLAMA_BF16_PER_TOKEN // 2 == 65536
    assert spec.block_bytes == 16 * 65536
    assert spec.format.plain and [p.name for p in spec.format.parts(16, 8, 128)] == ["values", "values"]


def test_vllms_fp8_is_e4m3_and_e5m2_is_its_own_format() -> None:
    assert canonical_dtype("fp8") == canonical_dtype("fp8_e4m3") == "fp8_e4m3"
    assert _llama("fp8").format.element == "fp8_e4m3"
    assert _llama("fp8_e5m2").format.element == "fp8_e5m2"


def test_kvledgers_scaled_fp8_keeps_its_scales_under_its_own_name() -> None:
    spec = _llama("fp8-scaled")
    assert spec.kv_dtype == "fp8-scaled" and "fp8" not in KV_FORMATS
    assert spec.bytes_per_token == 32 * 2 * 8 * (128 + 2) == 66560  # an fp16 scale per token and head
    assert spec.kv_format_id == "fp8-scaled:e4m3,scale=fp16/token-head"


def test_vllm_serves_the_plain_formats_only() -> None:
    served = {name for name, fmt in KV_FORMATS.items() if vllm_serves(fmt)}
    assert served == {"fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"}
