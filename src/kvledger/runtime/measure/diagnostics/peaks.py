"""Transient peaks: the most memory a step allocates above what was held when it began.

Two meters, one definition -- ``peak = max(allocated during the step) - allocated at its start``:

* CUDA: ``torch.cuda.reset_peak_memory_stats`` at the start, ``max_memory_allocated - start`` at the end
  (after a synchronize). The functions are injectable for tests.
* CPU: torch keeps no allocator statistics on CPU, but its profiler records every allocation and free
  of the CPU allocator (``profile_memory=True``); the peak is the largest running sum of those events.
  It costs a fraction of a step (measured ~35% on SmolLM2 decode steps), so samplers measure peaks only
  on the steps they sample.

:func:`measure_forward_peaks` runs the model's forward pass alone on synthetic step shapes (prefill of
``tokens`` split over ``seqs`` sequences from position 0; decode of ``seqs`` sequences at a context
length) and compares each peak with ``workspace_peak_bytes``, the planner's formula; :func:`peak_rows`
turns the measurements into the planner's measured-peaks format.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ....core.sizing.inventory import workspace_peak_bytes
from ....errors import ConfigError


@dataclass(frozen=True, slots=True)
class PeakReading:
    peak_bytes: int  # highest allocation level during the window, above its start
    net_bytes: int  # allocated at the end minus at the start (what the window left allocated)
    events: int = 0  # allocation events seen (CPU meter)


class PeakMeter(Protocol):
    def start(self) -> None: ...

    def stop(self) -> PeakReading: ...


class CpuProfilerPeak:
    """The CPU allocator's peak through torch's profiler (allocation and free events, in order)."""

    def __init__(self) -> None:
        # Kineto prints a line per profiler start/stop unless its log level is above 5.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof: Any = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self._prof is not None:
            self.stop()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def stop(self) -> PeakReading:
        prof, self._prof = self._prof, None
        if prof is None:
            return PeakReading(0, 0)
        prof.__exit__(None, None, None)
        events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
        # Drop the recorded trace now: left to the garbage collector it holds tens of MiB per window,
        # which the allocator ledger would then report as the workload's.
        prof.profiler = None
        level = peak = 0
        for _, nbytes in events:
            level += nbytes
            if level > peak:
                peak = level
        return PeakReading(peak, level, len(events))


class CudaPeak:
    """``max_memory_allocated`` over a window on one CUDA device (functions injectable for tests)."""

    def __init__(self, device: Any = None, *, allocated: Callable[[], int] | None = None,
                 max_allocated: Callable[[], int] | None = None, reset_peak: Callable[[], None] | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        cuda = torch.cuda
        self.allocated = allocated or (lambda: cuda.memory_allocated(device))
        self.max_allocated = max_allocated or (lambda: cuda.max_memory_allocated(device))
        self.reset_peak = reset_peak or (lambda: cuda.reset_peak_memory_stats(device))
        self.synchronize = synchronize or (lambda: cuda.synchronize(device))
        self._base: int | None = None

    def start(self) -> None:
        self.synchronize()
        self.reset_peak()
        self._base = self.allocated()

    def stop(self) -> PeakReading:
        if self._base is None:
            return PeakReading(0, 0)
        self.synchronize()
        base, self._base = self._base, None
        return PeakReading(max(0, self.max_allocated() - base), self.allocated() - base)


def meter_for(device: Any) -> PeakMeter:
    dev = torch.device(device)
    return CudaPeak(dev) if dev.type == "cuda" else CpuProfilerPeak()


# ---- step shapes ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a forward step computes: new tokens, sequences, and the context it attends over."""

    tokens: int
    seqs: int
    prefill_tokens: int = 0
    prefill_seqs: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0  # sum over sequences of the context after the step
    max_context: int = 0

    @property
    def kind(self) -> str:
        if self.prefill_seqs and self.decode_seqs:
            return "mixed"
        return "prefill" if self.prefill_seqs else "decode" if self.decode_seqs else "idle"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "tokens": self.tokens, "seqs": self.seqs, "prefill_tokens": self.prefill_tokens,
                "prefill_seqs": self.prefill_seqs, "decode_seqs": self.decode_seqs,
                "context_tokens": self.context_tokens, "max_context": self.max_context}

    @classmethod
    def of_plan(cls, plan: Any) -> StepShape:
        """The shape of a scheduler ``StepPlan`` (its prefill chunks and decodes)."""
        prefill = [w for w in plan.prefills]
        decode = [w for w in plan.decodes]
        pt = sum(w.end - w.start for w in prefill)
        ctx = [w.end for w in (*prefill, *decode)]
        return cls(pt + sum(1 + w.lookahead for w in decode), len(prefill) + len(decode), pt, len(prefill),
                   len(decode), sum(ctx), max(ctx, default=0))


# ---- measuring the forward pass on synthetic shapes -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ForwardPeak:
    """One measurement: the forward step's peak for a model, dtype and step shape, beside the formula."""

    model: str
    dtype: str
    device: str
    kind: str  # prefill | decode
    tokens: int
    seqs: int
    context: int  # tokens each sequence attends over after the step
    peak_bytes: int
    formula_bytes: int  # workspace_peak_bytes(cfg, max_batched_tokens=tokens, max_seqs=seqs, act bytes)
    backend: str = ""  # the attention backend that ran the step (its class name)

    @property
    def ratio(self) -> float:
        return self.peak_bytes / self.formula_bytes if self.formula_bytes else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "device": self.device, "kind": self.kind,
                "tokens": self.tokens, "seqs": self.seqs, "context": self.context, "peak_bytes": self.peak_bytes,
                "formula_bytes": self.formula_bytes, "measured_over_formula": round(self.ratio, 3),
                "backend": self.backend}


def synthetic_steps(kind: str, tokens: int, seqs: int, context: int, block_size: int,
                    vocab: int = 1000) -> tuple[list[Any], int]:
    """Step inputs for one shape and the blocks they need: ``prefill`` -- ``seqs`` sequences sharing
    ``tokens`` new tokens from position 0 (``context`` ignored); ``decode`` -- ``seqs`` sequences of one
    new token each at position ``context - 1``. Every sequence uses the same block table: what a step
    allocates (activations, gathered contexts, logits) does not depend on which blocks it reads, and a
    long-context decode shape then fits a small store. Token ids are arbitrary."""
    from ...model import SeqStep

    if kind not in ("prefill", "decode"):
        raise ConfigError(f"step kind must be prefill or decode, got {kind!r}")
    if seqs < 1 or tokens < seqs:
        raise ConfigError(f"a step needs 1 <= seqs <= tokens, got {seqs} sequences and {tokens} tokens")
    if kind == "decode" and (context < 1 or tokens != seqs):
        raise ConfigError("a decode step has one new token per sequence and a context of at least one token")
    longest = -(-tokens // seqs) if kind == "prefill" else context
    need = -(-longest // block_size)
    table = list(range(need))
    steps: list[Any] = []
    for i in range(seqs):
        if kind == "prefill":
            start, end = 0, tokens // seqs + (1 if i < tokens % seqs else 0)
        else:
            start, end = context - 1, context
        slots = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        steps.append(SeqStep([(7 + p + i) % vocab for p in range(start, end)], start, table, slots))
    return steps, need


def measure_forward_peaks(
    model: str, shapes: Sequence[tuple[str, int, int, int]], *, dtypes: Sequence[torch.dtype] = (torch.float32,),
    device: str = "cpu", block_size: int = 16, repeats: int = 2, progress: Callable[[str], None] | None = None,
    backend: str | None = None,
) -> list[ForwardPeak]:
    """Run the forward pass of ``model`` (a bundled name, folder or GGUF) on each shape
    ``(kind, tokens, seqs, context)`` in each dtype, measure its peak (the least of ``repeats`` runs after
    one warm-up, so one-off allocations do not count) and compute the formula for the same shape.
    ``backend`` names the attention backend (default ``auto``: the native kernels where they are built);
    each row records the one that ran."""
    from ...engine import load_runner, resolve_model

    ckpt = resolve_model(model)
    out: list[ForwardPeak] = []
    blocks = max(synthetic_steps(k, t, s, c, block_size)[1] for k, t, s, c in shapes)
    for dtype in dtypes:
        runner = load_runner(ckpt, num_blocks=blocks, block_size=block_size, dtype=dtype, device=device,
                             backend=backend)
        backend_name = type(runner.backend).__name__
        dname = str(dtype).replace("torch.", "").replace("float32", "fp32").replace("bfloat16", "bf16") \
            .replace("float16", "fp16")
        act = torch.empty((), dtype=dtype).element_size()
        meter = meter_for(device)
        for kind, tokens, seqs, context in shapes:
            steps, _ = synthetic_steps(kind, tokens, seqs, context, block_size, runner.config.vocab_size)
            runner.forward(steps)  # warm-up: lazily built kernels and caches are not the step's workspace
            peaks = []
            for _ in range(max(1, repeats)):
                meter.start()
                logits = runner.forward(steps)
                del logits
                peaks.append(meter.stop().peak_bytes)
            ctx = context if kind == "decode" else tokens // seqs
            formula = workspace_peak_bytes(ckpt.config, 1, tokens, seqs, act)
            row = ForwardPeak(model, dname, _device_name(device), kind, tokens, seqs, ctx, min(peaks), formula,
                              backend_name)
            out.append(row)
            if progress is not None:
                progress(f"{dname} {backend_name} {kind} tokens={tokens} seqs={seqs} ctx={ctx}: "
                         f"{row.peak_bytes / 2**20:.1f} MiB (formula {formula / 2**20:.1f} MiB)")
        del runner
    return out


def _device_name(device: Any) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev).lower().replace(" ", "-")
    return f"cpu-{platform.machine()}"


def peak_rows(peaks: Sequence[ForwardPeak], source: str, max_context: int | None = None) -> list[dict[str, Any]]:
    """The planner's measured-peaks rows (``kvledger/data/measured_peaks.json``: model, dtype, tp,
    max_batched_tokens, max_seqs, peak_bytes, device, source): for every measured (tokens, seqs) the worst
    step of that shape or smaller -- a plan with this budget may run any such step. ``max_context`` keeps
    decode shapes up to that context (the rows' context assumption, named in each row's source)."""
    if max_context is not None:
        peaks = [p for p in peaks if p.kind != "decode" or p.context <= max_context]
    rows: list[dict[str, Any]] = []
    keys = sorted({(p.model, p.dtype, p.device, p.tokens, p.seqs) for p in peaks})
    for model, dtype, device, tokens, seqs in keys:
        covered = [p for p in peaks if p.model == model and p.dtype == dtype and p.device == device
                   and p.tokens <= tokens and p.seqs <= seqs]
        worst = max(covered, key=lambda p: p.peak_bytes)
        rows.append({"model": model, "dtype": dtype, "tp": 1, "max_batched_tokens": tokens, "max_seqs": seqs,
                     "peak_bytes": worst.peak_bytes, "device": device,
                     "source": f"{source}; worst step: {worst.kind} of {worst.tokens} tokens over {worst.seqs} "
                               f"sequences at context {worst.context}"})
    return rows


__all__ = ["CpuProfilerPeak", "CudaPeak", "ForwardPeak", "PeakMeter", "PeakReading", "StepShape",
           "measure_forward_peaks", "meter_for", "peak_rows", "synthetic_steps"]
