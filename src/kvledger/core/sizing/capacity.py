"""Capacity answers built on the inventory: what to change when a model does not fit, and which GPU x TP
combinations serve a request shape at a concurrency target (the cheapest marked).

Pure standard library; every figure comes from `build_inventory`, so the hints and the matrix say
exactly what `kvledger plan` would say for the suggested options.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...errors import ConfigError
from .. import checks
from .engines import check_engine_kv_format
from .geometry import KVSpec, canonical_dtype
from .gpus import GPUS, resolve_gpu_name
from .inventory import Inventory, build_inventory
from .kv_formats import get_kv_format

TP_DEGREES = (1, 2, 4, 8)
MIN_USEFUL_TOKENS = 8192  # a suggested option must leave at least this much KV cache
MAX_CONCURRENCY = 10**7


def _try(spec: KVSpec, cfg: dict[str, Any] | None, **kwargs: Any) -> Inventory | None:
    try:
        return build_inventory(spec, cfg, **kwargs)
    except ConfigError:
        return None


def _spec(cfg: dict[str, Any] | None, spec: KVSpec, **changes: Any) -> KVSpec | None:
    try:
        if cfg is not None:
            return KVSpec.from_hf_config(cfg, kv_dtype=changes.get("kv_dtype", spec.kv_dtype),
                                         tp=changes.get("tp", spec.tp), block_size=spec.block_size, name=spec.name)
        return replace(spec, **changes)
    except ConfigError:
        return None


@dataclass(frozen=True, slots=True)
class FitHint:
    """One change that makes a plan fit, checked by building the inventory it implies. ``option`` is the
    `kvledger plan` parameter it sets (the engine knobs under their vLLM names: ``tensor_parallel_size``,
    ``gpu_memory_utilization``), None for a change to the request itself. The core names no flag: the command
    line prints the option under its own first flag name (vLLM's, where vLLM has the knob), so a hint always
    names a flag the command takes."""

    option: str | None
    value: str  # as typed after the flag (no thousands separators: the user pastes it)
    note: str

    def text(self, flag: Callable[[str], str]) -> str:
        """The hint as a user reads it, ``flag(option)`` naming the option: ``--tensor-parallel-size 8 (...)``."""
        head = self.value if self.option is None else f"{flag(self.option)} {self.value}"
        return f"{head} ({self.note})"


def fit_hints(spec: KVSpec, cfg: dict[str, Any] | None, inventory_kwargs: dict[str, Any], *,
              prompt: int | None = None, max_new: int | None = None, limit: int = 4) -> list[FitHint]:
    """Options that make the model (and the request, if given) fit, each checked by building the
    inventory it implies: more TP, a bigger GPU, fp8 KV, fp8 weights, a higher utilization, a smaller
    output allowance."""
    kw = dict(inventory_kwargs)
    need = (prompt or 0) + (max_new or 0)

    def ok(inv: Inventory | None) -> bool:
        # Without a request shape a hint must leave a usable pool, not a handful of blocks.
        if inv is None:
            return False
        return inv.fits(prompt or 0, max_new or 0) if need else inv.capacity_tokens >= MIN_USEFUL_TOKENS

    hints: list[FitHint] = []
    for tp in (2, 4, 8, 16):
        if tp <= spec.tp:
            continue
        s = _spec(cfg, spec, tp=tp)
        inv = _try(s, cfg, **kw) if s else None
        if ok(inv):
            hints.append(FitHint("tensor_parallel_size", str(tp),
                                 f"{inv.pool_blocks:,} blocks = {inv.capacity_tokens:,} tokens"))
            break
    current = kw.get("gpu")
    mem = GPUS[current].memory_bytes if current in GPUS else kw.get("device_bytes")
    for gpu in sorted(GPUS.values(), key=lambda g: g.memory_bytes):
        if gpu.name == current or (isinstance(mem, int) and gpu.memory_bytes <= mem):
            continue
        if gpu.memory_from_datasheet:  # a hint is a promise; a datasheet capacity overstates the driver's
            continue
        inv = _try(spec, cfg, **{**{k: v for k, v in kw.items() if k != "device_bytes"}, "gpu": gpu.name})
        if ok(inv):
            hints.append(FitHint("gpu", gpu.name, f"{inv.capacity_tokens:,} tokens"))
            break
    if spec.dtype_bytes > 1:
        s = _spec(cfg, spec, kv_dtype="fp8")  # vLLM's fp8: the unscaled e4m3 cast, which vLLM serves
        inv = _try(s, cfg, **kw) if s else None
        if ok(inv):
            hints.append(FitHint("kv_dtype", "fp8", f"{inv.capacity_tokens:,} tokens"))
    if cfg is not None and kw.get("weight_dtype") not in ("fp8", "int4", "fp4"):
        inv = _try(spec, cfg, **{**kw, "weight_dtype": "fp8"})
        if ok(inv):
            hints.append(FitHint("weight_dtype", "fp8", f"{inv.capacity_tokens:,} tokens"))
    if kw.get("utilization", 0.9) < 0.95:
        inv = _try(spec, cfg, **{**kw, "utilization": 0.95})
        if ok(inv):
            hints.append(FitHint("gpu_memory_utilization", "0.95", f"{inv.capacity_tokens:,} tokens"))
    if need:
        inv = _try(spec, cfg, **kw)
        if inv is not None and not inv.fits(prompt or 0, max_new or 0):
            room = inv.largest_context - (prompt or 0)
            if room > 0 and max_new:
                hints.append(FitHint("max_new", str(min(room, max_new - 1)),
                                     f"the pool holds {inv.largest_context:,} tokens"))
            else:
                hints.append(FitHint(None, f"a prompt under {inv.largest_context:,} tokens", "the whole pool"))
    return hints[:limit]


@dataclass(frozen=True, slots=True)
class MatrixRow:
    """One GPU x TP combination for a request shape at a concurrency target."""

    gpu: str
    tp: int
    fits: bool
    pool_blocks: int
    blocks_per_request: int
    per_instance: int  # requests of the shape one instance (tp GPUs) holds at once, unshared
    instances: int  # instances needed for the target (0 when it does not fit)
    gpus_total: int
    cost: float | None
    note: str
    cheapest: bool = False  # lowest cost; several rows at that same cost are each marked (a tie)
    tie: bool = False  # cheapest, and another row costs the same: "cheapest" names one of equals, not a winner

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__slots__}


def capacity_matrix(cfg: dict[str, Any], *, prompt: int, max_new: int, concurrency: int, model_name: str | None,
                    engine: str = "vllm", utilization: float = 0.9, kv_dtype: str | None = None,
                    weight_dtype: str | None = None, block_size: int = 16, gpus: Sequence[str] | None = None,
                    tps: Sequence[int] = TP_DEGREES, prices: Mapping[str, float] | None = None,
                    max_batched_tokens: int | None = None, max_seqs: int | None = None) -> list[MatrixRow]:
    """Every GPU x TP combination: does one instance hold a request of `prompt + max_new` tokens, how many
    such requests does it hold at once, and how many instances (data-parallel replicas) reach
    `concurrency`? Cost is GPUs x price per GPU-hour when `prices` names the GPU, else GPUs x the GPU's
    memory in GiB (a proxy); the cheapest fitting row is marked, and every row at that same cost too, each
    with `tie` set: a tie is shown as one (it used to be broken by GPU count and TP, naming one of equals the
    cheapest)."""
    concurrency = checks.count(concurrency, "concurrency", 1, MAX_CONCURRENCY)
    names = list(gpus) if gpus else list(GPUS)
    for name in names:
        if name not in GPUS:
            raise ConfigError(f"unknown GPU {name!r}; known GPUs are: {', '.join(GPUS)}")
    if kv_dtype is not None:  # one line for the whole matrix, not one note per row
        check_engine_kv_format(engine, get_kv_format(canonical_dtype(kv_dtype)))
    rows: list[MatrixRow] = []
    for name in names:
        gpu = GPUS[name]
        for tp in tps:
            try:
                spec = KVSpec.from_hf_config(cfg, kv_dtype=kv_dtype, tp=tp, block_size=block_size, name=model_name)
                inv = build_inventory(spec, cfg, gpu=name, utilization=utilization, weight_dtype=weight_dtype,
                                      engine=engine, model_name=model_name, max_batched_tokens=max_batched_tokens,
                                      max_seqs=max_seqs)
            except ConfigError as exc:
                text = str(exc)
                note = "does not fit" if "does not fit" in text else text.split(";")[0][:60]
                rows.append(MatrixRow(name, tp, False, 0, 0, 0, 0, 0, None, note))
                continue
            per_req = inv.blocks_per_request(prompt, max_new)
            per = inv.pool_blocks // per_req
            if per == 0:
                rows.append(MatrixRow(name, tp, False, inv.pool_blocks, per_req, 0, 0, 0, None,
                                      f"one request needs {per_req:,} of {inv.pool_blocks:,} blocks"))
                continue
            instances = -(-concurrency // per)
            total = instances * tp
            cost: float | None = total * gpu.memory_bytes / 2**30
            if prices:  # a GPU the prices do not name has no cost (prices and GiB do not compare)
                price = prices.get(name)
                cost = None if price is None else total * price
            rows.append(MatrixRow(name, tp, True, inv.pool_blocks, per_req, per, instances, total, cost,
                                  f"{instances} x tp{tp}" if instances > 1 else "one instance"))
    costed = [r for r in rows if r.fits and r.cost is not None]
    if costed:
        low = min(r.cost for r in costed if r.cost is not None)
        best = [r for r in costed if r.cost is not None and math.isclose(r.cost, low, rel_tol=1e-9)]
        tie = len(best) > 1
        rows = [replace(r, cheapest=True, tie=tie) if any(r is b for b in best) else r for r in rows]
    return rows


def parse_prices(text: str | None) -> dict[str, float] | None:
    """`h100-80gb=2.5,l4=0.8` -> {name: price per GPU-hour}."""
    if not text:
        return None
    out: dict[str, float] = {}
    if len(text) > 2000:
        raise ConfigError("--prices is too long")
    for item in text.split(","):
        name, sep, value = item.partition("=")
        try:
            name = resolve_gpu_name(name) if sep else ""  # a usual short form (h100) names its entry
        except ConfigError:
            name = ""
        if not name:
            raise ConfigError(f"--prices takes gpu=price pairs of catalogue GPUs ({', '.join(GPUS)}); got {item!r}")
        try:
            price = float(value)
        except ValueError:
            raise ConfigError(f"--prices: {value!r} is not a number") from None
        if not 0 < price < 1e6:
            raise ConfigError(f"--prices: the price of {name} must be in (0, 1e6), got {value!r}")
        out[name] = price
    return out


__all__ = ["TP_DEGREES", "FitHint", "MatrixRow", "capacity_matrix", "fit_hints", "parse_prices"]
