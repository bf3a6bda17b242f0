"""KV geometry: bytes per token, per block, per pool and per sequence, as a user would check them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.core.sizing.geometry import KV_DTYPE_BYTES, KVSpec, default_dtype, dtype_bytes, text_config
from kvledger.core.sizing.inventory import kv_layout
from kvledger.core.sizing.models import list_models, load_model_config, model_source
from kvledger.errors import ConfigError

MiB = 2**20

BUNDLED = ["deepseek-v3", "gemma-2-27b", "gemma-2-9b", "llama-3.1-70b", "llama-3.1-8b", "mistral-7b",
           "mixtral-8x7b", "qwen2.5-32b", "qwen2.5-7b", "smollm2-135m"]


def seed(**overrides) -> KVSpec:
    return KVSpec(**{"layers": 32, "kv_heads": 8, "head_dim": 128, "kv_dtype": "bf16", **overrides})


# ---- the seed fixed point -----------------------------------------------------------------------


def test_seed_bytes_per_token_block_and_pool():
    spec = seed()
    assert spec.bytes_per_token == 131072  # 128 KiB
    assert spec.block_bytes == 2 * MiB
    assert spec.pool_blocks(512 * MiB) == 256
    assert spec.pool_blocks("512MiB") == 256
    assert spec.blocks_for_tokens(2048 + 257) == 145


def test_pool_rounds_down_to_whole_blocks_and_rejects_a_pool_below_one_block():
    spec = seed()
    assert spec.pool_blocks(512 * MiB + 2 * MiB - 1) == 256
    with pytest.raises(ConfigError, match="smaller than one KV block"):
        spec.pool_blocks(MiB)


def test_tail_block_is_charged_whole():
    spec = seed()
    assert [spec.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_gqa_costs_a_quarter_of_mha():
    assert seed(kv_heads=32).bytes_per_token == 4 * seed(kv_heads=8).bytes_per_token


def test_dtype_sizes_and_hf_spellings():
    assert KV_DTYPE_BYTES["fp8-scaled"] == 1 and KV_DTYPE_BYTES["fp32"] == 4
    assert dtype_bytes("bfloat16") == 2
    assert dtype_bytes("float8_e4m3fn") == 1
    assert dtype_bytes("float32") == 4
    assert seed(kv_dtype="fp8_e4m3").bytes_per_token == 65536  # the plain cast: one byte, no scale
    # fp8-scaled and int8-token carry an fp16 scale per token and KV head: 32 x 2 x 8 x (128 + 2) bytes.
    assert seed(kv_dtype="fp8-scaled").bytes_per_token == seed(kv_dtype="int8-token").bytes_per_token == 66560
    assert seed(kv_dtype="bfloat16") == seed(kv_dtype="bf16")  # stored under the short name
    with pytest.raises(ConfigError, match="unknown dtype"):
        dtype_bytes("fp4_unicorn")


@pytest.mark.parametrize(
    "overrides",
    [
        {"layers": 0},
        {"head_dim": -1},
        {"kv_heads": True},
        {"block_size": 0},
        {"kv_dtype": "int3"},
        {"attention": "linear"},
        {"attention": "sliding"},  # no window
        {"attention": "full", "sliding_window": 4096},
        {"attention": "mla"},  # no kv_lora_rank
        {"kv_lora_rank": 512},  # only for MLA
        {"attention": "hybrid", "sliding_window": 4096, "sliding_layers": 33},
    ],
)
def test_bad_specs_are_config_errors(overrides):
    with pytest.raises(ConfigError):
        seed(**overrides)


# ---- tensor parallelism -------------------------------------------------------------------------


def test_tp_splits_kv_heads_and_bytes():
    spec = seed(tp=2)
    assert spec.kv_heads_per_rank == 4
    assert spec.kv_replication == 1
    assert spec.bytes_per_token == 131072 // 2


def test_llama_70b_tp8_one_head_per_rank_and_tp16_replicates():
    cfg = load_model_config("llama-3.1-70b")
    tp8 = KVSpec.from_hf_config(cfg, tp=8)
    assert (tp8.kv_heads_per_rank, tp8.kv_replication) == (1, 1)
    tp16 = KVSpec.from_hf_config(cfg, tp=16)
    assert (tp16.kv_heads_per_rank, tp16.kv_replication) == (1, 2)
    # A replicated head costs each rank as much as an unreplicated one: no saving past tp=kv_heads.
    assert tp16.bytes_per_token == tp8.bytes_per_token == 80 * 1 * 128 * 2 * 2


def test_tp_that_neither_divides_nor_multiplies_kv_heads_is_rejected():
    with pytest.raises(ConfigError, match="tp=3 must divide"):
        seed(tp=3)


def test_mla_bytes_for_deepseek_v3_are_replicated_on_every_rank():
    cfg = load_model_config("deepseek-v3")
    spec = KVSpec.from_hf_config(cfg)
    assert spec.attention == "mla"
    assert spec.bytes_per_token == 61 * (512 + 64) * 2
    tp8 = KVSpec.from_hf_config(cfg, tp=8)
    assert tp8.bytes_per_token == spec.bytes_per_token  # the latent is not split by tp
    assert (tp8.kv_heads_per_rank, tp8.kv_replication) == (1, 8)


# ---- sliding windows ----------------------------------------------------------------------------


def test_gemma2_hybrid_window_saves_half_the_layers_beyond_the_window():
    spec = KVSpec.from_hf_config(load_model_config("gemma-2-9b"))
    assert spec.attention == "hybrid"
    assert (spec.sliding_window, spec.sliding_layers, spec.layers) == (4096, 21, 42)
    assert spec.kv_dtype == "bf16"  # fp32 checkpoint, served in 16-bit
    per_layer_token = 8 * 256 * 2 * 2
    # Inside the window every layer holds every token: exact == the pool's worst case.
    assert spec.kv_bytes_for_sequence(4096) == spec.pool_bytes_for_sequence(4096)
    n = 8192
    exact = spec.kv_bytes_for_sequence(n)
    assert exact == (21 * n + 21 * 4096) * per_layer_token
    assert spec.pool_bytes_for_sequence(n) == 42 * n * per_layer_token
    assert spec.pool_bytes_for_sequence(n) - exact == 21 * 4096 * per_layer_token


def test_mistral_slides_on_every_layer_and_qwen_window_is_off():
    mistral = KVSpec.from_hf_config(load_model_config("mistral-7b"))
    assert (mistral.attention, mistral.sliding_layers) == ("sliding", 32)
    assert mistral.kv_bytes_for_sequence(100_000) == mistral.pool_bytes_for_sequence(4096)
    qwen = KVSpec.from_hf_config(load_model_config("qwen2.5-7b"))
    assert qwen.attention == "full" and qwen.sliding_window is None
    assert qwen.bytes_per_token == 28 * 4 * 128 * 2 * 2


def test_full_attention_sequence_bytes_equal_the_pool_charge():
    spec = seed()
    assert spec.kv_bytes_for_sequence(2305) == 145 * spec.block_bytes


# ---- from_hf_config edge cases ------------------------------------------------------------------


def test_hf_defaults_head_dim_and_kv_heads():
    spec = KVSpec.from_hf_config({"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4})
    assert (spec.kv_heads, spec.head_dim, spec.kv_dtype) == (4, 64, "bf16")
    assert KVSpec.from_hf_config({"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4},
                                 kv_dtype="fp8").kv_dtype == "fp8_e4m3"


def test_gemma3_style_pattern_and_layer_types():
    base = {"num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "sliding_window": 1024}
    spec = KVSpec.from_hf_config({**base, "sliding_window_pattern": 6})
    assert (spec.attention, spec.sliding_layers) == ("hybrid", 10)
    types = ["sliding_attention"] * 11 + ["full_attention"]
    assert KVSpec.from_hf_config({**base, "layer_types": types}).sliding_layers == 11


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        ({"hidden_size": 64, "num_attention_heads": 4}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "num_attention_heads": 4}, "hidden_size"),
        ({"num_hidden_layers": "32", "hidden_size": 64, "num_attention_heads": 4}, "num_hidden_layers"),
        ({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4.0}, "num_attention_heads"),
    ],
)
def test_missing_or_mistyped_keys_name_the_key(cfg, key):
    with pytest.raises(ConfigError, match=key):
        KVSpec.from_hf_config(cfg)


def test_non_dict_config_is_a_config_error():
    with pytest.raises(ConfigError):
        KVSpec.from_hf_config([1, 2, 3])  # type: ignore[arg-type]


# ---- bundled models -----------------------------------------------------------------------------


def test_every_bundled_model_loads_names_its_source_and_builds_a_spec():
    assert list_models() == BUNDLED
    for name in BUNDLED:
        cfg = load_model_config(name)
        assert "config.json" in model_source(name)
        spec = KVSpec.from_hf_config(cfg, name=name)
        assert spec.bytes_per_token > 0 and spec.name == name


def test_smollm2_geometry():
    spec = KVSpec.from_hf_config(load_model_config("smollm2-135m"))
    assert spec.bytes_per_token == 30 * 3 * 64 * 2 * 2
    with pytest.raises(ConfigError, match="tp=2"):
        KVSpec.from_hf_config(load_model_config("smollm2-135m"), tp=2)  # 3 KV heads


def test_unknown_model_lists_known_names():
    with pytest.raises(ConfigError, match="llama-3.1-8b"):
        load_model_config("llama-9")


def test_config_from_a_path_or_a_directory(tmp_path):
    cfg = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(tmp_path) == cfg
    assert load_model_config(str(tmp_path / "config.json")) == cfg
    assert model_source(str(tmp_path)).endswith("config.json")


def test_malformed_or_non_object_config_is_a_config_error(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"num_hidden_layers": 32,')
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        load_model_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_model_config(bad)
    with pytest.raises(ConfigError, match="no model config"):
        load_model_config(tmp_path / "missing.json")


# ---- exact per-token figures, KV layouts, config edge cases, the default dtype ------------------

def layout(dtype: str) -> list[tuple[str, str, list[int]]]:
    spec = KVSpec(layers=1, kv_heads=2, head_dim=8, kv_dtype=dtype, block_size=4)
    return [(p["kv"], p["part"], p["shape"]) for p in kv_layout(spec)]


def test_bytes_per_token_is_an_int_when_the_block_divides_evenly() -> None:
    """bf16, 1 layer, 1 KV head of 64: K and V are 2 * 64 * 2 = 256 bytes per token, an int (a report
    prints 256, not 256.0)."""
    spec = KVSpec(layers=1, kv_heads=1, head_dim=64)
    assert spec.bytes_per_token == 256 and type(spec.bytes_per_token) is int
    assert spec.layer_bytes_per_token == 256 and type(spec.layer_bytes_per_token) is int


def test_bytes_per_token_keeps_the_fraction_when_the_block_does_not_divide() -> None:
    """int4 (KIVI), block of 3 tokens, 1 head of 4: codes 2 * 3 * 2 = 12 bytes, K scale+min per channel
    2 * 4 * 2 = 16, V scale+min per token 2 * 3 * 2 = 12: 40 bytes per block, 40 / 3 per token (a
    remainder of 1 must not be floored to 13)."""
    spec = KVSpec(layers=1, kv_heads=1, head_dim=4, kv_dtype="int4", block_size=3)
    assert spec.block_bytes == 40
    assert spec.bytes_per_token == 40 / 3
    assert spec.layer_bytes_per_token == 40 / 3


def test_fp8_and_int8_token_layouts_name_their_codes_and_scales() -> None:
    """`kv_layout` (the report of one block's parts) names fp8-scaled/int8-token values `codes`, each with a
    `scale`."""
    for dtype in ("fp8-scaled", "int8-token"):
        layout = kv_layout(KVSpec(layers=1, kv_heads=2, head_dim=8, kv_dtype=dtype, block_size=4))
        assert [(p["kv"], p["part"], p["shape"]) for p in layout] == [
            ("k", "codes", [4, 2, 8]), ("k", "scale", [4, 2]), ("v", "codes", [4, 2, 8]), ("v", "scale", [4, 2])]


def test_text_config_unwraps_a_multimodal_config(tiny_dense: dict) -> None:
    """A Gemma-3-style config nests the decoder under `text_config`: its keys are what plans read."""
    inner = text_config({"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": dict(tiny_dense)})
    assert inner["num_hidden_layers"] == 2 and inner["model_type"] == "gemma3"


def test_a_bad_residual_dtype_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"residual_dtype must be one of fp32, bf16, fp16, got "):
        KVSpec(layers=1, kv_heads=1, head_dim=4, kv_dtype="int4", residual_dtype="fp8")


def test_mla_layout_stores_one_latent_head() -> None:
    """MLA caches one latent (kv_lora_rank 4 + rope 2 = 6 wide) per token, not one per attention head."""
    cfg = {"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10, "num_attention_heads": 2,
           "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2,
           "intermediate_size": 12}
    spec = KVSpec.from_hf_config(cfg, block_size=4)
    assert [p["shape"] for p in kv_layout(spec)] == [[4, 1, 6]]


@pytest.mark.parametrize("rope_dim", [2.0, True])
def test_mla_rope_dim_must_be_an_integer(rope_dim: object) -> None:
    """An MLA spec with a float or boolean rope_dim is refused with a message naming rope_dim."""
    with pytest.raises(ConfigError, match="rope_dim must be a non-negative integer"):
        KVSpec(2, 1, 6, attention="mla", kv_lora_rank=4, rope_dim=rope_dim)  # type: ignore[arg-type]


def test_hybrid_attention_defaults_to_every_other_layer_sliding() -> None:
    """attention='hybrid' without sliding_layers slides layers 0, 2, 4 of 5: (5 + 1) // 2 = 3."""
    spec = KVSpec(5, 2, 4, attention="hybrid", sliding_window=8)
    assert spec.sliding_layers == 3


def test_a_deeply_nested_model_config_says_so(tmp_path: Path) -> None:
    """A config.json nested 100,000 deep is refused with a message naming the file and the nesting."""
    path = tmp_path / "config.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="config.json is nested too deeply to be a model config"):
        load_model_config(path)


def test_default_dtype_reads_either_key() -> None:
    """A config with only `torch_dtype` or only the newer `dtype` key is served in that dtype."""
    assert default_dtype({"torch_dtype": "float16"}) == "fp16"
    assert default_dtype({"dtype": "float16"}) == "fp16"
    assert default_dtype({}) == "bf16"


def test_plain_layout_names_k_and_v_values_in_lower_case() -> None:
    """`kv_layout` of a plain fp16 cache lists K's values then V's, tagged 'k' and 'v' (block 4, 2 heads
    of 8: each [4, 2, 8])."""
    assert layout("fp16") == [("k", "values", [4, 2, 8]), ("v", "values", [4, 2, 8])]


def test_int4_layout_names_every_part_of_k_and_v() -> None:
    """int4 (KIVI), block 4, 2 heads of 8: packed codes [4, 2, 8 // 2] for K and V; K's scale and min per
    channel [2, 8]; V's scale and min per token [4, 2] -- tagged 'v' and named 'min'."""
    assert layout("int4") == [
        ("k", "codes", [4, 2, 4]), ("k", "scale", [2, 8]), ("k", "min", [2, 8]),
        ("v", "codes", [4, 2, 4]), ("v", "scale", [4, 2]), ("v", "min", [4, 2])]


def test_kvtc_pools_pay_for_the_cache_of_first_rows_beside_blocks_and_residual_pages() -> None:
    """A kvtc store caches the K and V rows of 32 first tokens (every layer, fp32) whatever its blocks: the pool it
    is sized in pays for them once (SmolLM2: 1.41 MiB), so a pool of exactly that, the residual pages and one block
    holds one block, and a byte less holds none and says what is beside it. No other format keeps such bytes."""
    spec = KVSpec(layers=30, kv_heads=3, head_dim=64, kv_dtype="kvtc")
    cache = 32 * 30 * 2 * 3 * 64 * 4
    assert spec.store_constant_bytes == cache == 1_474_560
    assert spec.pool_bytes_for(10, 2) == 10 * spec.block_bytes + 2 * spec.residual_page_bytes + cache
    exact = spec.pool_bytes_for(1, 2)
    assert spec.pool_blocks(exact, 2) == 1
    with pytest.raises(ConfigError, match=r"beside 2 kvtc residual page\(s\) .* and the 1.41 MiB cache of first rows"):
        spec.pool_blocks(exact - 1, 2)
    assert spec.pool_blocks(f"{512 * MiB}", 8) == (512 * MiB - 8 * spec.residual_page_bytes - cache) // spec.block_bytes
    for name in ("bf16", "int8", "int4", "int4-smooth"):
        other = KVSpec(layers=30, kv_heads=3, head_dim=64, kv_dtype=name)
        assert other.store_constant_bytes == 0
        assert other.pool_bytes_for(10, 2) == 10 * other.block_bytes + (2 * other.residual_page_bytes)
