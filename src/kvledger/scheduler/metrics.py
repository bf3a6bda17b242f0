"""One definition of request metrics, shared by the engine, the simulator, the lab, the server and the
fleet: whatever drives the scheduler, a TTFT or a p90 means the same thing.

Per request (times on the driver's clock, seconds):

    TTFT        first_token_s - arrival_s      the first token of any branch, at the end of its step
    TPOT        (finish_s - first_token_s) / (longest branch's output tokens - 1)
                                               None with fewer than two tokens in every branch
    end-to-end  finish_s - arrival_s
    hit_tokens  prompt tokens the first admission skipped because the prefix cache held them written
                (blocks another request was still filling are computed again and do not count);
                re-admissions after a preemption are counted apart (readmit_hit_tokens)
    preemptions times the request was preempted (all branches together count once)

Percentiles interpolate linearly between order statistics (numpy's default, what vLLM's serving
benchmark reports): ``percentile(xs, q)`` at position ``(len(xs) - 1) * q / 100`` of the sorted values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

COMPLETED = ("length", "stop")


@dataclass(slots=True)
class RequestMetrics:
    """One request's fate. ``None`` where it never happened."""

    request_id: str
    trust_group: str
    arrival_s: float
    prompt_len: int
    output_len: int  # max_new_tokens the scheduler was given
    n: int = 1
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    generated: int = 0  # output tokens over all branches (beam search: over the final hypotheses)
    longest: int = 0  # output tokens of the longest branch
    preemptions: int = 0
    hit_tokens: int = 0
    readmit_hit_tokens: int = 0
    finish_reason: str = ""  # the branches' reason, or their distinct reasons joined by ","

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.finish_s is None or self.longest < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.longest - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def completed(self) -> bool:
        return self.finish_reason in COMPLETED

    def to_row(self) -> dict[str, Any]:
        row = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        row.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return row


def join_reasons(reasons: Sequence[str]) -> str:
    """One reason for a request: its branches' reason, or their distinct reasons sorted and joined."""
    distinct = set(reasons)
    return reasons[0] if len(distinct) == 1 else ",".join(sorted(distinct))


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linearly interpolated percentile (``q`` in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max of ``values`` (all None when empty)."""
    return {"mean": (sum(values) / len(values)) if values else None, "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "max": max(values) if values else None}


def summarize_requests(records: Iterable[RequestMetrics]) -> dict[str, Any]:
    """Throughput and latency of a run: the span runs from the first arrival to the last finish;
    throughput counts every generated token (finished or not) and completed requests."""
    reqs = list(records)
    done = [r for r in reqs if r.completed]
    first = min((r.arrival_s for r in reqs), default=0.0)
    last = max((r.finish_s for r in reqs if r.finish_s is not None), default=first)
    span = max(last - first, 1e-12)
    out_tokens = sum(r.generated for r in reqs)
    prompt_done = sum(r.prompt_len for r in done)
    prompt_tokens = sum(r.prompt_len for r in reqs)
    hit = sum(r.hit_tokens for r in reqs)
    reasons: dict[str, int] = {}
    for r in reqs:
        key = r.finish_reason.split(":", 1)[0] or "unfinished"
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "requests": len(reqs), "completed": len(done), "finish_reasons": reasons,
        "duration_s": span,
        "throughput_tok_s": out_tokens / span,
        "throughput_req_s": len(done) / span,
        "total_tok_s": (out_tokens + prompt_done) / span,
        "output_tokens": out_tokens,
        "ttft_s": distribution([r.ttft_s for r in reqs if r.ttft_s is not None]),
        "tpot_s": distribution([r.tpot_s for r in reqs if r.tpot_s is not None]),
        "e2e_s": distribution([r.e2e_s for r in done if r.e2e_s is not None]),
        "preempted_requests": sum(1 for r in reqs if r.preemptions),
        "prefix_hit_tokens": hit, "readmit_hit_tokens": sum(r.readmit_hit_tokens for r in reqs),
        "prompt_tokens": prompt_tokens,
        "prefix_hit_rate": hit / prompt_tokens if prompt_tokens else 0.0,
    }


__all__ = ["COMPLETED", "RequestMetrics", "distribution", "join_reasons", "percentile", "summarize_requests"]
