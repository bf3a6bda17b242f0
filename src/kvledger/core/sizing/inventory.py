"""Per-rank memory inventory: what an engine spends before the KV cache, and the block pool that is left.

On one rank of a tensor-parallel group: how many bytes do the weights take, how much does the
engine's profile step or workspace peak at, what else does it hold, and how many whole KV blocks fit
in what remains? `build_inventory` answers for a named engine (`core.sizing.engines`): `vllm` reproduces
vLLM's start-up accounting, `kvledger` our own runtime's (a measured workspace peak where we have one).

Parameter counting and weight formats live in `core.sizing.params`, the GPU catalogue in `core.sizing.gpus`; both are
re-exported here for callers of the old names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from ...units import format_gib, parse_bytes
from .. import checks
from .engines import (
    ENGINES,
    MeasuredPeak,
    Term,
    budget_bytes,
    check_engine,
    check_engine_kv_format,
    kvledger_terms,
    vllm_batch_defaults,
    vllm_terms,
    workspace_peak_bytes,
)
from .geometry import KVSpec, dtype_bytes
from .gpus import GPU, GPUS, get_gpu
from .kv_formats import FIRST_ROW_CACHE_TOKENS
from .params import (
    ParamCount,
    count_parameters,
    count_parameters_per_rank,
    default_weight_dtype,
    get_weight_format,
    weight_plan,
    weights_bytes_per_rank,
)

GiB = 2**30
DEFAULT_VOCAB = 128256  # Llama 3's vocabulary: the sampler estimate for hand-given geometry without --vocab
MAX_STEP = 2**24  # bound on max_batched_tokens / max_seqs


class DoesNotFit(ConfigError):
    """The engine's own memory leaves no room for a single KV block; `terms` say where it went."""

    def __init__(self, message: str, terms: Sequence[Term] = ()) -> None:
        super().__init__(message)
        self.terms = tuple(terms)


@dataclass(frozen=True, slots=True)
class Inventory:
    """Where one rank's memory goes. All sizes are bytes on one rank.

    budget_bytes is what the engine plans with: device_bytes x utilization, or the pool given directly.
    `terms` lists every use of memory the engine subtracts (and the ones that come out of the headroom);
    slack_bytes is the part of the budget left for KV that block rounding wastes.
    """

    spec: KVSpec
    device_bytes: int | None
    budget_bytes: int
    weights_bytes_per_rank: int
    parameters: int
    workspace_bytes: int
    reserve_bytes: int
    pool_bytes: int
    pool_blocks: int
    block_bytes: int
    kv_bytes_per_token: int
    kv_heads_per_rank: int
    kv_replication: int
    slack_bytes: int
    engine: str = "kvledger"
    utilization: float | None = None
    non_torch_bytes: int = 0
    kv_budget_bytes: int = 0  # budget minus every in-budget term: what the engine gives the KV cache
    workspace_source: str = ""
    weight_format: str = ""
    max_batched_tokens: int | None = None
    max_seqs: int | None = None
    terms: tuple[Term, ...] = field(default=())
    # Formats with an unquantised residual (int4) keep one page per running sequence beside the blocks.
    residual_slots: int = 0
    residual_bytes: int = 0

    # -- capacity answers ----------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds when every block is full (vLLM's 'GPU KV cache size: N tokens')."""
        return self.pool_blocks * self.spec.block_size

    @property
    def largest_context(self) -> int:
        """The longest single sequence (prompt + output) the pool can ever hold."""
        return self.capacity_tokens

    @property
    def headroom_bytes(self) -> int | None:
        """Device memory outside the utilization budget (CUDA graphs and the context come from it)."""
        return None if self.device_bytes is None else self.device_bytes - self.budget_bytes

    def blocks_per_request(self, prompt: int, max_new: int) -> int:
        """Blocks one request needs at its longest (prompt plus every new token), unshared."""
        for value, what in ((prompt, "prompt"), (max_new, "max_new")):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**40:
                raise ConfigError(f"{what} must be an integer in [0, 2**40], got {value!r}")
        if prompt + max_new == 0:
            raise ConfigError("a request needs at least one token (prompt + max_new > 0)")
        return self.spec.blocks_for_tokens(prompt + max_new)

    def max_concurrent_requests(self, prompt: int, max_new: int) -> int:
        """How many such requests fit at once when none shares blocks with another."""
        return self.pool_blocks // self.blocks_per_request(prompt, max_new)

    def max_concurrency(self, tokens_per_request: int) -> float:
        """vLLM's 'Maximum concurrency for N tokens per request': pool blocks / ceil(N / block size)."""
        return self.pool_blocks / self.blocks_per_request(tokens_per_request, 0)

    def fits(self, prompt: int, max_new: int) -> bool:
        return self.blocks_per_request(prompt, max_new) <= self.pool_blocks

    def to_dict(self) -> dict[str, Any]:
        keys = ("kv_bytes_per_token", "kv_heads_per_rank", "kv_replication", "block_bytes", "pool_blocks",
                "pool_bytes", "parameters", "weights_bytes_per_rank", "workspace_bytes", "reserve_bytes",
                "device_bytes", "engine", "utilization", "budget_bytes", "non_torch_bytes", "kv_budget_bytes",
                "workspace_source", "weight_format", "max_batched_tokens", "max_seqs", "capacity_tokens",
                "largest_context", "headroom_bytes", "residual_slots", "residual_bytes")
        out: dict[str, Any] = {key: getattr(self, key) for key in keys}
        out["kv_format"] = self.spec.kv_format_id
        out["kv_format_parts"] = kv_layout(self.spec)
        out["terms"] = [t.to_dict() for t in self.terms]
        return out


def _size(value: int | str, what: str, *, allow_zero: bool = False) -> int:
    try:
        return parse_bytes(value, allow_zero=allow_zero)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def _hand_terms(spec: KVSpec, engine: str, *, params: int | None, weights: int | None, weight_dtype: str | None,
                workspace: int | None, vocab: int | None, tokens: int, seqs: int, reserve: int) -> list[Term]:
    """Terms for geometry given by hand (no model config): weights from --params/--weights."""
    if weights is None:
        if params is None:
            raise ConfigError("geometry given by hand needs --params or --weights to plan a GPU's memory "
                              "(or give --model, or --pool for a pool you already have)")
        fmt = get_weight_format(weight_dtype or "bf16")
        weights = -(-params * fmt.bits // 8)
        how = f"{params:,} parameters x {fmt.bits} bits ({fmt.name})"
    else:
        how = "given (--weights)"
    out = [Term("weights", "weights", weights, how, "given by hand")]
    if workspace is not None:
        out.append(Term("workspace", "activation workspace", workspace, "given (--workspace)", "given by hand"))
    else:
        v = vocab or DEFAULT_VOCAB
        n = min(seqs, tokens)
        per = 38 if engine == "vllm" else 4
        out.append(Term("workspace", "activation workspace (sampler estimate)", n * v * per,
                        f"{n:,} sequences x vocab {v:,} x {per} B" + ("" if vocab else " (no --vocab: Llama 3's)"),
                        "estimate without a model config: the sampler's logits, the largest term for every "
                        "model measured; give --workspace for the real figure"))
    if engine == "vllm":
        from .engines import non_torch_bytes

        out.append(Term("non_torch", "non-torch memory", non_torch_bytes(spec.tp), "by TP degree",
                        "vLLM measured (see core.engines)"))
    if reserve:
        out.append(Term("reserve", "runtime reserve", reserve, "CUDA context, libraries", "--reserve"))
    return out


def build_inventory(
    spec: KVSpec,
    cfg: dict[str, Any] | None = None,
    *,
    device_bytes: int | str | None = None,
    gpu: str | None = None,
    utilization: float = 0.9,
    pool_bytes: int | str | None = None,
    weight_dtype: str | None = None,
    runtime_reserve_bytes: int | str | None = None,
    max_batched_tokens: int | None = None,
    max_seqs: int | None = None,
    engine: str = "kvledger",
    model_name: str | None = None,
    params: int | None = None,
    weights_bytes: int | None = None,
    workspace_bytes: int | None = None,
    vocab: int | None = None,
    peaks: Sequence[MeasuredPeak] | None = None,
    residual_slots: int | None = None,
) -> Inventory:
    """Account for one rank's memory and size the KV block pool.

    With `pool_bytes` the pool is that size rounded down to whole blocks (weights are still reported
    when `cfg` is given). Otherwise the pool is `device x utilization - (every in-budget term of the
    engine)`, rounded down to whole blocks, with the device given as `device_bytes` or a catalogue `gpu`
    (its driver-reported total). `engine` is `vllm` or `kvledger` (see `core.sizing.engines`); the step shape
    defaults to the engine's (vLLM's per GPU class; 8192 tokens / 256 sequences for kvledger) and the
    reserve to 1 GiB for kvledger, 0 for vLLM (whose non-torch term stands in for it).

    A KV format with an unquantised residual (int4) keeps one residual page per running sequence:
    `residual_slots` pages (default: the step's sequence limit, `max_seqs`) are charged before the
    blocks, as the runtime's store allocates them.
    """
    check_engine(engine)
    if pool_bytes is None:  # a pool given directly involves no engine's accounting
        check_engine_kv_format(engine, spec.format)
    if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
        raise ConfigError(f"utilization must be in (0, 1], got {utilization!r}")
    if device_bytes is not None and gpu is not None:
        raise ConfigError("give either device_bytes or gpu, not both")
    gpu_obj: GPU | None = get_gpu(gpu) if gpu is not None else None
    device = gpu_obj.memory_bytes if gpu_obj else (
        _size(device_bytes, "device_bytes") if device_bytes is not None else None)
    if runtime_reserve_bytes is None:
        reserve = GiB if engine == "kvledger" else 0
    else:
        reserve = _size(runtime_reserve_bytes, "runtime_reserve_bytes", allow_zero=True)
    if engine == "vllm":
        defaults = vllm_batch_defaults(device, gpu_obj.name if gpu_obj else "")
        reason = defaults.reason if (max_batched_tokens is None and max_seqs is None) else "given"
        tokens = checks.count(defaults.max_num_batched_tokens if max_batched_tokens is None else max_batched_tokens,
                              "max_batched_tokens", 1, MAX_STEP)
        seqs = checks.count(defaults.max_num_seqs if max_seqs is None else max_seqs, "max_seqs", 1, MAX_STEP)
    else:
        reason = ""
        tokens = checks.count(8192 if max_batched_tokens is None else max_batched_tokens, "max_batched_tokens", 1,
                              MAX_STEP)
        seqs = checks.count(256 if max_seqs is None else max_seqs, "max_seqs", 1, MAX_STEP)

    n_params = 0
    fmt_name = ""
    if cfg is not None:
        n_params = count_parameters(cfg).total
        fmt_name = weight_plan(cfg, weight_dtype).name
        if engine == "vllm":
            terms = vllm_terms(cfg, spec, tp=spec.tp, weight_dtype=weight_dtype, max_num_batched_tokens=tokens,
                               max_num_seqs=seqs, batch_reason=reason)
            if reserve:
                terms.append(Term("reserve", "extra reserve", reserve, "given (--reserve)", "--reserve"))
        else:
            terms = kvledger_terms(cfg, tp=spec.tp, model=model_name, weight_dtype=weight_dtype,
                                   max_batched_tokens=tokens, max_seqs=seqs, reserve_bytes=reserve, peaks=peaks)
        if workspace_bytes is not None:
            terms = [t for t in terms if t.key not in ("workspace", "activation")]
            terms.insert(1, Term("workspace", "activation workspace", workspace_bytes, "given (--workspace)",
                                 "given by hand"))
    elif device is not None and pool_bytes is None:
        terms = _hand_terms(spec, engine, params=params, weights=weights_bytes, weight_dtype=weight_dtype,
                            workspace=workspace_bytes, vocab=vocab, tokens=tokens, seqs=seqs, reserve=reserve)
        n_params = params or 0
        fmt_name = (weight_dtype or "bf16") if weights_bytes is None else "given"
    else:
        terms = []
        if weights_bytes is not None or params is not None:
            w = weights_bytes if weights_bytes is not None else params * dtype_bytes(weight_dtype or "bf16")
            terms = [Term("weights", "weights", w, "given by hand", "given by hand")]
            n_params = params or 0
    slots = 0
    if spec.format.has_residual:
        slots = seqs if residual_slots is None else checks.count(residual_slots, "residual_slots", 1, MAX_STEP)
        page = spec.residual_page_bytes
        terms = [*terms, Term("residual", f"{spec.kv_dtype} residual pages", slots * page,
                              f"{slots:,} running sequences x one unquantised page of {spec.block_size} tokens "
                              f"({page:,} B, {spec.residual_dtype})",
                              "the partly written block of each running sequence stays unquantised until it is "
                              "full (core.kv_formats)")]
    residual = slots * spec.residual_page_bytes
    constant = spec.store_constant_bytes  # kvtc's cache of first rows: the store holds it whatever its blocks
    if constant:
        terms = [*terms, Term("first_rows", f"{spec.kv_dtype} cache of first rows", constant,
                              f"{FIRST_ROW_CACHE_TOKENS} first tokens x K and V of {spec.layers} layers, fp32",
                              "a sequence's first row is kept exact outside its page (core.kv_formats)")]
    by_key = {t.key: t.bytes for t in terms}
    weights = by_key.get("weights", 0)
    workspace = by_key.get("activation", by_key.get("workspace", 0))
    non_torch = by_key.get("non_torch", 0)
    source = next((t.source for t in terms if t.key in ("activation", "workspace")), "")

    if pool_bytes is not None:
        budget = _size(pool_bytes, "pool_bytes")
        available = budget - residual - constant
        reserve = 0  # the pool was given directly: nothing is subtracted from it
        kv_budget = budget
        if available < spec.block_bytes:
            spec.pool_blocks(budget, slots)  # raises the one clear message
    elif device is None:
        raise ConfigError("give device_bytes, gpu or pool_bytes to size the KV pool")
    else:
        budget = budget_bytes(device, utilization)
        spent = sum(t.bytes for t in terms if t.in_budget)
        available = kv_budget = budget - spent
        if available < spec.block_bytes:
            parts = " - ".join(f"{t.label} {format_gib(t.bytes)}" for t in terms if t.in_budget)
            raise DoesNotFit(
                f"model does not fit: {utilization:g} x {format_gib(device)} = {format_gib(budget)} - {parts} "
                f"= {format_gib(available)} for the KV cache" + ("" if available <= 0 else
                                                               f", less than one {format_gib(spec.block_bytes)} "
                                                               "block"), terms)
    blocks = available // spec.block_bytes  # the residual pages and the constant bytes are already out
    pool = blocks * spec.block_bytes
    return Inventory(
        spec=spec, device_bytes=device, budget_bytes=budget, weights_bytes_per_rank=weights,
        parameters=n_params, workspace_bytes=workspace, reserve_bytes=by_key.get("reserve", 0) if pool_bytes is None
        else 0, pool_bytes=pool, pool_blocks=blocks, block_bytes=spec.block_bytes,
        kv_bytes_per_token=spec.bytes_per_token, kv_heads_per_rank=spec.kv_heads_per_rank,
        kv_replication=spec.kv_replication, slack_bytes=available - pool, engine=engine,
        utilization=None if pool_bytes is not None else float(utilization), non_torch_bytes=non_torch,
        kv_budget_bytes=kv_budget, workspace_source=source, weight_format=fmt_name,
        max_batched_tokens=tokens if device is not None or cfg is not None else None,
        max_seqs=seqs if device is not None or cfg is not None else None, terms=tuple(terms),
        residual_slots=slots, residual_bytes=residual,
    )


def kv_layout(spec: KVSpec) -> list[dict[str, Any]]:
    """The byte layout of one layer of one block (per rank) of ``spec``'s format, part by part."""
    heads = 1 if spec.attention == "mla" else spec.kv_heads_per_rank
    width = spec.kv_lora_rank + spec.rope_dim if spec.attention == "mla" else spec.head_dim
    parts = spec.format.parts(spec.block_size, heads, width)
    if spec.attention == "mla":
        parts = tuple(p for p in parts if p.kv == "k")  # one latent, no separate V
    return [{"kv": p.kv, "part": p.name, "shape": list(p.shape), "element": p.element, "bytes": p.nbytes}
            for p in parts]


__all__ = [
    "DEFAULT_VOCAB", "ENGINES", "GPU", "GPUS", "DoesNotFit", "Inventory", "ParamCount", "build_inventory",
    "kv_layout",
    "count_parameters", "count_parameters_per_rank", "default_weight_dtype", "get_gpu", "weights_bytes_per_rank",
    "workspace_peak_bytes",
]
