"""Known answers for the planner's arithmetic: every figure the planner derives from a model config.

The cases walk every bundled model and a corpus of config variants that reach the less travelled branches
(quantization configs of every method, MoE layouts, MLA without a q down-projection, biases, tied and
untied embeddings, sliding-window layouts, wrapped text configs, malformed keys), and record for each
what a user of ``kvledger plan`` / ``capacity`` reads: tensors per rank, parameter counts, weight bytes
in every format, the KV geometry in every KV format, the inventory on every catalogue GPU for both
engines, the capacity matrix, fit hints, and every error's type and message.

``tests/data/golden/planner.json`` holds the answers, one case per line; ``tests/test_golden.py`` compares.
The figures themselves are pinned elsewhere against published numbers (the seed's worked example,
vLLM's own arithmetic, model cards): this file makes any change to any of them visible. After a
deliberate change, regenerate and review the diff::

    .venv/bin/python tests/golden/planner.py --update
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from golden_common import Recorder, main  # noqa: E402

from kvledger.core.sizing import capacity, engines, geometry, gpus, inventory, kv_formats, models, params  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "planner.json"
TPS = (1, 2, 3, 8)
GPUS = ("a10", "l4", "a100-80gb", "h200-141gb")


def _variants() -> Iterator[tuple[str, dict[str, Any]]]:
    """Bundled configs, then edited copies that reach other branches."""
    bundled = {m: models.load_model_config(m) for m in models.list_models()}
    yield from bundled.items()
    llama = bundled["llama-3.1-8b"]
    qwen = bundled["qwen2.5-7b"]
    ds = bundled["deepseek-v3"]
    mix = bundled["mixtral-8x7b"]
    small = bundled["smollm2-135m"]

    def edit(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
        out = copy.deepcopy(base)
        for k, v in changes.items():
            if v is _DROP:
                out.pop(k, None)
            else:
                out[k] = v
        return out

    for name, quant in (
        ("fp8", {"quant_method": "fp8"}),
        ("fp8-block", {"quant_method": "fp8", "weight_block_size": [128, 128]}),
        ("awq", {"quant_method": "awq", "bits": 4, "group_size": 128}),
        ("awq-w_bit", {"quant_method": "awq", "w_bit": 4, "q_group_size": 64}),
        ("awq-8", {"quant_method": "awq", "bits": 8}),
        ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32}),
        ("gptq-channel", {"quant_method": "gptq", "bits": 4, "group_size": -1}),
        ("gptq-3bit", {"quant_method": "gptq", "bits": 3}),
        ("gptq-boolbits", {"quant_method": "gptq", "bits": True}),
        ("gptq-badgroup", {"quant_method": "gptq", "bits": 4, "group_size": 0}),
        ("gptq-boolgroup", {"quant_method": "gptq", "bits": 4, "group_size": True}),
        ("gptq-huge-group", {"quant_method": "gptq", "bits": 4, "group_size": 2**20 + 1}),
        ("ct-fp8", {"quant_method": "compressed-tensors",
                    "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}}),
        ("ct-int8", {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8}}}}),
        ("ct-fp4", {"quant_method": "compressed-tensors",
                    "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}}),
        ("ct-int4", {"quant_method": "compressed-tensors",
                     "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "group_size": 64}}}}),
        ("ct-int4-channel", {"quant_method": "compressed-tensors",
                             "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": None}}}}),
        ("ct-int2", {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 2}}}}),
        ("ct-empty", {"quant_method": "compressed-tensors", "config_groups": {}}),
        ("ct-list", {"quant_method": "compressed-tensors", "config_groups": ["x"]}),
        ("modelopt-fp4", {"quant_method": "modelopt", "quant_algo": "NVFP4"}),
        ("modelopt-nested", {"quant_method": "modelopt", "quantization": {"quant_algo": "fp8"}}),
        ("modelopt-int", {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}),
        ("modelopt-none", {"quant_method": "modelopt"}),
        ("mxfp4", {"quant_method": "MXFP4"}),
        ("bnb-4", {"quant_method": "bitsandbytes", "load_in_4bit": True}),
        ("bnb-8", {"quant_method": "bitsandbytes", "load_in_8bit": True}),
        ("unknown", {"quant_method": "hqq"}),
        ("missing", {"bits": 4}),
    ):
        yield f"llama+quant:{name}", edit(llama, quantization_config=quant)
    yield "llama+tied", edit(llama, tie_word_embeddings=True)
    yield "llama+no-kv-heads", edit(llama, num_key_value_heads=_DROP)
    yield "llama+head_dim", edit(llama, head_dim=96)
    yield "llama+bias", edit(llama, attention_bias=True, mlp_bias=True)
    yield "llama+fp32", edit(llama, torch_dtype="float32")
    yield "llama+fp16", edit(llama, torch_dtype="float16")
    yield "llama+dtype-key", edit(llama, torch_dtype=_DROP, dtype="float16")
    yield "llama+odd-dtype", edit(llama, torch_dtype="complex64")
    yield "llama+nondiv-hidden", edit(llama, hidden_size=4097)
    yield "llama+mamba", edit(llama, layer_types=["attention", "mamba"] * 16)
    yield "llama+hybrid-str", edit(llama, hybrid_override_pattern="M*M*")
    yield "llama+window", edit(llama, sliding_window=1024)
    yield "llama+window-size", edit(llama, sliding_window_size=512)
    yield "llama+layer-types", edit(llama, sliding_window=256,
                                    layer_types=["sliding_attention", "full_attention"] * 16)
    yield "llama+layer-types-short", edit(llama, sliding_window=256, layer_types=["sliding_attention"] * 3)
    yield "llama+pattern", edit(llama, sliding_window=512, sliding_window_pattern=6)
    yield "llama+wrapped", {"model_type": "llava", "text_config": edit(llama), "vision_config": {"x": 1}}
    yield "llama+zero-layers", edit(llama, num_hidden_layers=0)
    yield "llama+bool-heads", edit(llama, num_attention_heads=True)
    yield "llama+str-vocab", edit(llama, vocab_size="128256")
    yield "llama+no-hidden", edit(llama, hidden_size=_DROP)
    yield "qwen+window-on", edit(qwen, use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    yield "qwen+window-all", edit(qwen, use_sliding_window=True, sliding_window=4096, max_window_layers=None)
    yield "qwen3", edit(qwen, model_type="qwen3")
    yield "gemma3", edit(bundled["gemma-2-9b"], model_type="gemma3", sliding_window_pattern=6)
    yield "gemma-plain", edit(bundled["gemma-2-9b"], model_type="gemma", tie_word_embeddings=None)
    yield "qwen-moe", edit(qwen, model_type="qwen2_moe", num_experts=60, num_experts_per_tok=4,
                           moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                           decoder_sparse_step=2, mlp_only_layers=[1, 3])
    yield "qwen-moe-noshared", edit(qwen, model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                                    moe_intermediate_size=768)
    yield "qwen-moe-inter", edit(qwen, model_type="olmoe", num_experts=64, num_experts_per_tok=8)
    yield "qwen-moe-badlist", edit(qwen, num_experts=8, num_experts_per_tok=2, mlp_only_layers="1,2")
    yield "mixtral-topk", edit(mix, num_experts_per_tok=9)
    yield "deepseek-v2-lite", edit(ds, q_lora_rank=None, num_hidden_layers=27, first_k_dense_replace=1,
                                   n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                                   topk_method="greedy", moe_layer_freq=1)
    yield "deepseek-freq2", edit(ds, moe_layer_freq=2, first_k_dense_replace=0)
    yield "deepseek-no-rope", edit(ds, qk_rope_head_dim=0)
    yield "small+vocab-odd", edit(small, vocab_size=49153)


_DROP = object()


def _spec_figures(spec: geometry.KVSpec) -> dict[str, Any]:
    return {
        "spec": spec, "kv_heads_per_rank": spec.kv_heads_per_rank, "kv_replication": spec.kv_replication,
        "kv_format_id": spec.kv_format_id, "dtype_bytes": spec.dtype_bytes,
        "layer_block_bytes": spec.layer_block_bytes, "layer_bytes_per_token": spec.layer_bytes_per_token,
        "bytes_per_token": spec.bytes_per_token, "block_bytes": spec.block_bytes,
        "residual_page_bytes": spec.residual_page_bytes, "pool_bytes_for": spec.pool_bytes_for(100, 3),
        "blocks_for_tokens": [spec.blocks_for_tokens(n) for n in (0, 1, 15, 16, 17, 1000, 131072)],
        "pool_blocks": [spec.pool_blocks(b) for b in (10**6, 2**30, "80GiB", 75 * 10**9)],
        "kv_bytes_for_sequence": [spec.kv_bytes_for_sequence(n) for n in (0, 1, 100, 4095, 4096, 4097, 200000)],
        "pool_bytes_for_sequence": [spec.pool_bytes_for_sequence(n) for n in (0, 1, 100, 4097, 200000)],
        "kv_layout": inventory.kv_layout(spec),
    }


def _inventory_figures(inv: inventory.Inventory) -> dict[str, Any]:
    out: dict[str, Any] = {"inventory": inv.to_dict(), "capacity_tokens": inv.capacity_tokens,
                           "largest_context": inv.largest_context, "headroom_bytes": inv.headroom_bytes}
    for prompt, new in ((1, 1), (1000, 200), (30000, 2000), (120000, 8000)):
        out[f"request {prompt}+{new}"] = [inv.blocks_per_request(prompt, new),
                                          inv.max_concurrent_requests(prompt, new), inv.fits(prompt, new)]
    out["max_concurrency"] = [inv.max_concurrency(t) for t in (1, 1200, 10**6)]
    return out


def cases(rec: Recorder) -> None:
    for model, cfg in _variants():
        rec(f"{model} | moe_layout", lambda: params.moe_layout(cfg))
        rec(f"{model} | weight_plan", lambda: (lambda p: [p.name, p.source, p.base, p.linear.name,
                                                          p.group_override])(params.weight_plan(cfg)))
        rec(f"{model} | default dtypes", lambda: [params.default_weight_dtype(cfg),
                                                  geometry.default_dtype(geometry.text_config(cfg))])
        for tp in TPS:
            rec(f"{model} | tp {tp} | tensors", lambda: [
                [t.name, t.group, t.rows, t.cols, t.count, t.linear, t.active, t.params, t.active_params]
                for t in params.model_tensors(cfg, tp, vocab_pad=64 if tp == 8 else 1)])
            rec(f"{model} | tp {tp} | params", lambda: (lambda c: [c, c.total, c.active])(
                params.count_parameters_per_rank(cfg, tp)))
            for wd in (None, *params.WEIGHT_FORMATS):
                if tp in (2, 3) and wd not in (None, "fp8", "int4"):
                    continue
                rec(f"{model} | tp {tp} | weights {wd}", lambda: params.weights_bytes_per_rank(
                    cfg, tp, wd, vocab_pad=64 if tp == 8 else 1))
            for kv in (None, "fp8-scaled", "int4", "fp32") if tp in (1, 8) else (None,):
                for bs in (16, 32) if tp == 1 else (16,):
                    rec(f"{model} | tp {tp} | kv {kv} bs {bs}", lambda: _spec_figures(
                        geometry.KVSpec.from_hf_config(cfg, kv_dtype=kv, tp=tp, block_size=bs, name=model)))
        _plan_cases(rec, model, cfg)
    _format_cases(rec)
    _small_cases(rec)


def _plan_cases(rec: Recorder, model: str, cfg: dict[str, Any]) -> None:
    """Inventories, hints and the capacity matrix: every bundled model, and a few variants."""
    if "+" in model and not model.startswith(("llama+quant:awq", "llama+quant:fp8-block", "llama+tied",
                                               "llama+window", "llama+bias", "qwen+window-on")):
        return
    name = model if "+" not in model else None
    for tp in (1, 2, 8):
        try:
            spec = geometry.KVSpec.from_hf_config(cfg, tp=tp)
        except Exception as exc:  # noqa: BLE001 -- recorded as the answer
            rec(f"{model} | plan tp {tp}", lambda exc=exc: (_ for _ in ()).throw(exc))
            continue
        for gpu in GPUS:
            for engine in engines.ENGINES:
                kw = dict(gpu=gpu, engine=engine, model_name=name)
                rec(f"{model} | plan tp {tp} {gpu} {engine}",
                    lambda: _inventory_figures(inventory.build_inventory(spec, cfg, **kw)))
                if tp == 1 and gpu in ("l4", "h200-141gb"):
                    rec(f"{model} | hints tp {tp} {gpu} {engine}",
                        lambda: capacity.fit_hints(spec, cfg, kw, prompt=30000, max_new=2000))
        rec(f"{model} | plan tp {tp} fp8 weights util 0.8 reserve",
            lambda: _inventory_figures(inventory.build_inventory(
                spec, cfg, device_bytes="80GiB", utilization=0.8, weight_dtype="fp8", runtime_reserve_bytes="1GiB",
                max_batched_tokens=4096, max_seqs=64, model_name=name)))
        rec(f"{model} | plan tp {tp} pool bytes",
            lambda: _inventory_figures(inventory.build_inventory(spec, cfg, pool_bytes="10GiB")))
    if name is not None:
        for engine in engines.ENGINES:
            rec(f"{model} | capacity {engine}", lambda: [r.to_dict() for r in capacity.capacity_matrix(
                cfg, prompt=8000, max_new=1000, concurrency=48, model_name=name, engine=engine,
                prices={"h200-141gb": 3.5, "a100-80gb": 1.8})])
        rec(f"{model} | capacity fp8 kv", lambda: [r.to_dict() for r in capacity.capacity_matrix(
            cfg, prompt=100000, max_new=4000, concurrency=3, model_name=name, kv_dtype="fp8", tps=(1, 4))])


def _format_cases(rec: Recorder) -> None:
    for name in kv_formats.KV_FORMATS:
        fmt = kv_formats.get_kv_format(name)
        rec(f"kv format {name}", lambda: [fmt, fmt.plain, fmt.has_residual])
        for bs, heads, dim in ((16, 8, 128), (1, 1, 64), (32, 2, 576), (16, 3, 80)):
            rec(f"kv format {name} {bs}x{heads}x{dim}", lambda: [
                fmt.parts(bs, heads, dim), fmt.layer_block_bytes(bs, heads, dim),
                fmt.residual_page_bytes(bs, heads, dim, 32, "bf16") if fmt.has_residual else None,
                fmt.identity(bs, "bf16" if fmt.has_residual else None), fmt.check(bs, heads, dim),
                fmt.check(bs, heads, dim, mla=True)])
    for name in params.WEIGHT_FORMATS:
        fmt = params.get_weight_format(name)
        rec(f"weight format {name}", lambda: [fmt, [fmt.linear_bytes(r, c) for r, c in (
            (1, 1), (4096, 4096), (4096, 14336), (7168, 2048), (100, 130), (129, 257))]])


def _small_cases(rec: Recorder) -> None:
    for text in ("8.03B", "70e9", "135M", "1k", "2T", "1.5g", 7, 10**15, "", " ", "x" * 25, "abcB", "nanB", "infT",
                 "0", "-5M", 10**16, True, "1e16", "0.4"):
        rec(f"parse_param_count {text!r}", lambda: params.parse_param_count(text))
    for name in ("bf16", "BF16", "bfloat16", "float16", "half", "fp16", "float32", "fp32", "float", "fp8",
                 "float8_e4m3fn", "fp8_e5m2", "int8", "int4", "fp4", "mxfp4", "nf4", "awq", "gptq", "w8a8", " Fp8 ",
                 "torch.bfloat16", "complex64", "", 16, None):
        rec(f"dtype {name!r}", lambda: [geometry.canonical_dtype(name), geometry.dtype_bytes(name)])
        rec(f"weight format name {name!r}", lambda: params.get_weight_format(name).name)
        rec(f"kv format name {name!r}", lambda: kv_formats.get_kv_format(name).name)
    for tp in (0, 1, 1024, 1025, -1, 2.0, True, "2"):
        rec(f"tensors tp {tp!r}", lambda: len(params.model_tensors(models.load_model_config("smollm2-135m"), tp)))
    for gpu in (*gpus._catalogue(), "H100", " a100-80GB ", "tpu", "", 3):
        rec(f"gpu {gpu!r}", lambda: gpus.get_gpu(gpu).to_dict())
    for dev, name, offline in ((None, "", False), (80 * 2**30, "NVIDIA H100 80GB", False),
                               (24 * 2**30, "NVIDIA L4", False), (80 * 2**30, "NVIDIA A100", True),
                               (141 * 10**9, "NVIDIA H200", False), (16 * 2**30, "Tesla T4", True),
                               (40 * 2**30, "", False), (70 * 2**30, "NVIDIA GH200", False)):
        rec(f"vllm batch defaults {dev} {name!r} {offline}", lambda: engines.vllm_batch_defaults(
            dev, name, offline=offline))
    for tp in (1, 2, 8):
        rec(f"non_torch_bytes {tp}", lambda: engines.non_torch_bytes(tp))
    for dev, util in ((80 * 2**30, 0.9), (24 * 10**9, 0.5), (10, 1.0), (2**40, 0.95)):
        rec(f"budget {dev} {util}", lambda: engines.budget_bytes(dev, util))
    for name in (*engines.ENGINES, "VLLM", "sglang", "", None):
        rec(f"engine {name!r}", lambda: engines.check_engine(name))
    small = models.load_model_config("smollm2-135m")
    for model in models.list_models():
        cfg = models.load_model_config(model)
        for tp, tokens, seqs, act in ((1, 8192, 256, 2), (2, 2048, 64, 2), (8, 16384, 1024, 4), (1, 1, 1, 1)):
            rec(f"{model} | workspace {tp} {tokens} {seqs} {act}", lambda: engines.workspace_peak_bytes(
                cfg, tp, tokens, seqs, act))
        rec(f"{model} | source", lambda: models.model_source(model))
    for text in (None, "", "h100-80gb=2.5", "h100-80gb=2.5,a10=0.7", "h100-80gb", "h100-80gb=x", "tpu=1",
                 "h100-80gb=-1", "h100-80gb=inf", "a10=1,a10=2"):
        rec(f"prices {text!r}", lambda: capacity.parse_prices(text))
    for kw in ({"layers": 0, "kv_heads": 8, "head_dim": 128}, {"layers": 4, "kv_heads": 8, "head_dim": 128, "tp": 3},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "attention": "ring"},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "attention": "sliding"},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "attention": "sliding", "sliding_window": 64,
                "sliding_layers": 4},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "attention": "hybrid", "sliding_window": 64,
                "sliding_layers": 4},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "attention": "hybrid", "sliding_window": 64,
                "sliding_layers": 2},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "sliding_window": 64},
               {"layers": 4, "kv_heads": 1, "head_dim": 576, "attention": "mla", "kv_lora_rank": 512, "rope_dim": 64},
               {"layers": 4, "kv_heads": 1, "head_dim": 576, "attention": "mla", "kv_lora_rank": 500, "rope_dim": 64},
               {"layers": 4, "kv_heads": 2, "head_dim": 576, "attention": "mla", "kv_lora_rank": 512, "rope_dim": 64},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "kv_dtype": "int4", "residual_dtype": "fp32"},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "kv_dtype": "int4", "residual_dtype": "int8"},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "kv_dtype": "fp8-scaled", "residual_dtype": "fp32"},
               {"layers": 4, "kv_heads": 8, "head_dim": 100, "kv_dtype": "int4"},
               {"layers": 4, "kv_heads": 2, "head_dim": 128, "tp": 8},
               {"layers": 4, "kv_heads": 3, "head_dim": 128, "tp": 2},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "block_size": 0},
               {"layers": 4, "kv_heads": 8, "head_dim": 128, "block_size": 3, "kv_dtype": "int4"},
               {"layers": True, "kv_heads": 8, "head_dim": 128},
               {"layers": 2.0, "kv_heads": 8, "head_dim": 128}):
        rec(f"KVSpec {sorted(kw.items())}", lambda: _spec_figures(geometry.KVSpec(**kw)))
    for key, cfg_edit, kwargs in (("hidden_size", {}, {}), ("missing", {}, {}), ("missing", {}, {"default": 7}),
                                  ("num_hidden_layers", {"num_hidden_layers": 0}, {"minimum": 0}),
                                  ("num_hidden_layers", {"num_hidden_layers": -1}, {"minimum": 0}),
                                  ("num_hidden_layers", {"num_hidden_layers": 2**40}, {}),
                                  ("num_hidden_layers", {"num_hidden_layers": 3.0}, {}),
                                  ("num_hidden_layers", {"num_hidden_layers": "3"}, {}),
                                  ("num_hidden_layers", {"num_hidden_layers": None}, {"default": None})):
        rec(f"config_int {key} {cfg_edit} {kwargs}", lambda: geometry.config_int({**small, **cfg_edit}, key, **kwargs))
    for cfg in ({"text_config": {"a": 1}}, {"text_config": None, "b": 2}, {"llm_config": {"c": 3}}, [], "x",
                {"text_config": "bad"}):
        rec(f"text_config {cfg!r}", lambda: geometry.text_config(cfg))
    for mb in (None, 1, 10**9):
        rec(f"inventory hand terms {mb}", lambda: _inventory_figures(inventory.build_inventory(
            geometry.KVSpec(32, 8, 128), None, device_bytes="80GB", params=mb, weight_dtype="fp8",
            workspace_bytes=2**30, vocab=32000)))
    for kw in ({"device_bytes": "80GiB", "weights_bytes": 10**9}, {"gpu": "h100-80gb", "utilization": 1.5},
               {"gpu": "h100-80gb", "utilization": 0}, {"device_bytes": 0}, {"device_bytes": "80GiB", "gpu": "l4"},
               {}, {"pool_bytes": 0}, {"pool_bytes": "1KiB"}, {"device_bytes": "1GiB"},
               {"gpu": "h100-80gb", "engine": "sglang"}, {"gpu": "h100-80gb", "max_batched_tokens": 0},
               {"gpu": "h100-80gb", "max_seqs": True}, {"gpu": "h100-80gb", "residual_slots": 4},
               {"gpu": "h100-80gb", "runtime_reserve_bytes": "100GiB"}):
        rec(f"inventory {kw}", lambda: _inventory_figures(inventory.build_inventory(
            geometry.KVSpec(32, 8, 128, kv_dtype="int4" if "residual_slots" in kw else "bf16"),
            models.load_model_config("llama-3.1-8b"), model_name="llama-3.1-8b", **kw)))


if __name__ == "__main__":
    raise SystemExit(main(cases, GOLDEN))
