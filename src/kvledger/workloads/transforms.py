"""Workload transforms: replay faster or at a rate, scale lengths, slice a window, split into tenants."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

from ..errors import ConfigError
from .distributions import _rng
from .generator import _group_names
from .readers import MOONCAKE_BLOCK_TOKENS
from .requests import Prompt, SimRequest, _by_arrival, _check_int

# ---- transforms ------------------------------------------------------------------------------


def scale_time(requests: Iterable[SimRequest], speedup: float) -> list[SimRequest]:
    """Arrival times divided by `speedup`: 2 replays twice as fast (double the load), 0.5 half as fast."""
    if isinstance(speedup, bool) or not isinstance(speedup, int | float) or not (speedup > 0
                                                                                 and math.isfinite(speedup)):
        raise ConfigError(f"speedup must be a positive number, got {speedup!r}")
    return _by_arrival(replace(r, arrival_s=r.arrival_s / speedup) for r in requests)


def offered_rate(requests: Sequence[SimRequest]) -> float:
    """Arrivals per second of a workload: (N - 1) / (last arrival - first arrival)."""
    if len(requests) < 2:
        raise ConfigError("an arrival rate needs at least two requests")
    times = [r.arrival_s for r in requests]
    span = max(times) - min(times)
    if span <= 0:
        raise ConfigError("every request arrives at the same instant: the workload has no arrival rate")
    return (len(requests) - 1) / span


def at_rate(requests: Sequence[SimRequest], rate: float) -> list[SimRequest]:
    """The same requests replayed at `rate` arrivals per second: arrival times scaled so the offered rate is
    `rate`, keeping the workload's burstiness (for Poisson arrivals this equals drawing them at `rate`)."""
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not (0 < rate <= 1e6 and math.isfinite(rate)):
        raise ConfigError(f"rate must be a number of requests per second in (0, 1e6], got {rate!r}")
    reqs = list(requests)
    return scale_time(reqs, rate / offered_rate(reqs))


def scale_lengths(requests: Sequence[SimRequest], scale: float, *, block_size: int = 16,
                  trace_block: int = MOONCAKE_BLOCK_TOKENS) -> list[SimRequest]:
    """Prompts and outputs `scale` times as long, for replaying a trace on a small model or a CPU.

    Every `trace_block` tokens of a prompt (Mooncake's 512-token hash blocks) become `chunk` tokens, a whole
    number of `block_size`-token KV blocks (at least one): a prefix two requests share in the trace is a
    shared run of whole KV blocks after scaling too, never a partial block. Block identities are kept
    (equal trace blocks stay equal), so prefix sharing is exactly the trace's. Outputs of at least one
    token stay at least one token. `kvledger serve-trace --scale` and `kvledger simulate --scale` both use
    this, so a simulated and a real replay see the same lengths.
    """
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale <= 1:
        raise ConfigError(f"scale must be in (0, 1], got {scale!r}")
    _check_int(block_size, "block_size", 1)
    _check_int(trace_block, "trace_block", 1)
    chunk = max(1, round(trace_block * scale / block_size)) * block_size
    ids: dict[int, int] = {}
    out = []
    for r in requests:
        n = r.prompt_len
        length = max(1, round(n * chunk / trace_block))
        keys = [r.prompt_tokens[i] for i in range(0, n, trace_block)][: -(-length // chunk)]
        keys += [keys[-1]] * (-(-length // chunk) - len(keys))  # a prompt that grew past its trace blocks
        dense = [ids.setdefault(k, len(ids)) for k in keys]
        prompt = Prompt.from_blocks(dense, chunk, length)
        output = max(1, round(r.output_len * scale)) if r.output_len else 0
        out.append(replace(r, prompt_tokens=prompt, output_len=output))
    return out


WORKLOAD_TRANSFORMS = ("rate", "speedup")  # sweep keys that change the workload rather than the deployment


def transform_workload(requests: Sequence[SimRequest], key: str, value: float) -> list[SimRequest]:
    """Apply a workload-level sweep value: `rate` (arrivals per second) or `speedup` (times faster)."""
    if key == "rate":
        return at_rate(requests, value)
    if key == "speedup":
        return scale_time(requests, value)
    raise ConfigError(f"unknown workload transform {key!r}; known: {', '.join(WORKLOAD_TRANSFORMS)}")


def slice_requests(requests: Iterable[SimRequest], *, start_s: float | None = None,
                   end_s: float | None = None, first_n: int | None = None,
                   rebase: bool = True) -> list[SimRequest]:
    """Requests arriving in [start_s, end_s), then the first `first_n` of those by arrival.

    With `rebase` (the default) arrival times are shifted by -start_s so the window starts at 0.
    """
    if start_s is not None and end_s is not None and end_s < start_s:
        raise ConfigError(f"end_s ({end_s}) is before start_s ({start_s})")
    if first_n is not None:
        _check_int(first_n, "first_n", 0)
    lo = -math.inf if start_s is None else start_s
    hi = math.inf if end_s is None else end_s
    kept = _by_arrival(r for r in requests if lo <= r.arrival_s < hi)
    if first_n is not None:
        kept = kept[:first_n]
    if rebase and start_s:
        kept = [replace(r, arrival_s=max(0.0, r.arrival_s - start_s)) for r in kept]
    return kept


def assign_trust_groups(requests: Iterable[SimRequest], trust_groups: int | Sequence[str], *,
                        seed: int = 0) -> list[SimRequest]:
    """Put each request in a trust group chosen uniformly at random (seeded). Loaded traces have a
    single group; this splits them into tenants (which also splits their prefix sharing)."""
    groups = _group_names(trust_groups)
    rng = _rng(seed, "groups")
    return [replace(r, trust_group=groups[rng.randrange(len(groups))]) for r in requests]


__all__ = [
    "WORKLOAD_TRANSFORMS", "assign_trust_groups", "at_rate", "offered_rate", "scale_lengths", "scale_time",
    "slice_requests", "transform_workload",
]
