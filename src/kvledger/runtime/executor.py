"""The torch executor: carries out the scheduler's step plans on real tensors.

One :meth:`TorchExecutor.execute` is, in order: the copy-on-write copies, the swap-outs (device -> host),
the swap-ins (host -> device), one batched forward pass over every prefill chunk and decode, and token
selection. The single forward pass is what the executor contract asks for: in each layer the attention
backend writes the new K/V of the whole batch before any sequence attends, so a work may read prefix
blocks another work of the same plan writes (``StepPlan.shared_reads``). It reads nothing but the plan:
each ``Work`` names its request (whose ``payload`` is the request's :class:`Sampling`), its branch index,
its block table and its tokens.

Token selection is keyed by ``(seed, branch, position)`` (:mod:`kvledger.runtime.sampling`), so a
request's tokens do not depend on what else is in the batch: running a failing step again one request
at a time (the driver's isolation of a fault) gives every other request exactly the tokens of an
undisturbed run. Beam requests get candidates (their best ``2 * width`` next tokens), not tokens: the
scheduler's beam search chooses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..core.table import BlockTable
from ..errors import InvariantError
from ..scheduler import StepOutput, StepPlan, Work
from .host_store import HostKVStore
from .model import ModelRunner, SeqStep
from .sampling import SamplingParams, beam_logprobs, sample_rows, top_candidates

if TYPE_CHECKING:
    from .engine import EngineStats


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a request's ``GenRequest.payload`` carries for this executor."""

    params: SamplingParams
    seed: int


class TorchExecutor:
    """Executes plans against ``runner``'s KV store (and ``host`` for swaps); counts into ``stats``."""

    def __init__(self, runner: ModelRunner, host: HostKVStore | None, stats: EngineStats) -> None:
        self.runner = runner
        self.host = host
        self.stats = stats
        self.block_size = runner.spec.block_size

    def execute(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        stats = self.stats
        if plan.copies:
            self.runner.store.copy_blocks(plan.copies)
            stats.copies += len(plan.copies)
        if plan.swap_out or plan.swap_in:
            if self.host is None:
                raise InvariantError("the scheduler planned a swap but the engine has no host tier")
            self.host.swap_out(plan.swap_out)
            self.host.swap_in(plan.swap_in)
            stats.swapped_out_blocks += len(plan.swap_out)
            stats.swapped_in_blocks += len(plan.swap_in)
        out = StepOutput()
        works = [*plan.prefills, *plan.decodes]
        if works:
            logits, rows = self._forward(works)
            self._select(works, logits, rows, out)
        out.elapsed_s = time.perf_counter() - t0
        return out

    def _forward(self, works: list[Work]) -> tuple[torch.Tensor, list[int]]:
        """Run every work in one batch; sibling branches with identical work (same positions through
        the very same blocks, e.g. the n branches of a fresh request) are computed once."""
        bs = self.block_size
        steps: list[SeqStep] = []
        rows: list[int] = []
        seen: dict[tuple[Any, ...], int] = {}
        stats = self.stats
        for w in works:
            blocks = w.blocks
            key = (w.start, w.end, tuple(blocks[: -(-w.end // bs)]), tuple(w.tokens[w.start:w.end]))
            row = seen.get(key)
            if row is None:
                row = seen[key] = len(steps)
                table = list(blocks)
                steps.append(SeqStep(list(w.tokens[w.start:w.end]), w.start, table,
                                     BlockTable(bs, table).slot_mapping(w.start, w.end)))
                if w.end - w.start == 1:
                    stats.decode_tokens += 1
                else:
                    stats.prefill_tokens += w.end - w.start
            else:
                stats.deduplicated_rows += 1
            rows.append(row)
        t = time.perf_counter()
        logits = self.runner.forward(steps)
        stats.forward_s += time.perf_counter() - t
        stats.forward_steps += 1
        return logits, rows

    def _select(self, works: list[Work], logits: torch.Tensor, rows: list[int], out: StepOutput) -> None:
        picks: list[tuple[str, int]] = []  # (seq_id, logits row) of ordinary samples
        params: list[SamplingParams] = []
        keys: list[tuple[int, int, int]] = []
        beams: list[tuple[str, int, int]] = []  # (seq_id, row, width)
        for w, row in zip(works, rows, strict=True):
            if not w.sample:
                continue
            req = w.request
            if req is None or not isinstance(req.payload, Sampling):
                raise InvariantError(f"work {w.seq_id!r} carries no sampling parameters")
            if req.beam:
                beams.append((w.seq_id, row, req.n))
                continue
            picks.append((w.seq_id, row))
            params.append(req.payload.params)
            keys.append((req.payload.seed, w.branch, w.end))
        if picks:
            index = [r for _, r in picks]
            chosen = logits if index == list(range(logits.shape[0])) else \
                logits[torch.tensor(index, dtype=torch.long, device=logits.device)]
            for (seq_id, _), token in zip(picks, sample_rows(chosen, params, keys), strict=True):
                out.sampled[seq_id] = [token]
        if beams:
            lp = beam_logprobs(logits[torch.tensor([r for _, r, _ in beams], device=logits.device)])
            for i, (seq_id, _, width) in enumerate(beams):
                out.candidates[seq_id] = top_candidates(lp[i], 2 * width)


__all__ = ["Sampling", "TorchExecutor"]
