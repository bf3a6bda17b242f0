"""The torch executor: carries out the scheduler's step plans on real tensors.

One :meth:`TorchExecutor.execute` hands the plan's transfers to and from the tiers below the device pool
(demotions, write-backs, moves, promotions, swap-ins, swap-outs) to the background worker of
:class:`~kvledger.runtime.transfer.TransferEngine`, then runs the copy-on-write copies, one batched forward
pass over every prefill chunk and decode, and token selection beside them -- waiting for the demotions
before anything writes a device block, for the incoming blocks before a forward pass that reads one, and
for everything before the step ends (the rule of :mod:`kvledger.scheduler.transfers`); each step reports
the transfer time it waited for (exposed) and the time that ran beside its compute (hidden). A transfer of
the prefix cache that fails loses only its block (:mod:`kvledger.runtime.transfer`): the executor hands the
lost transfers to ``on_transfer_error`` (the scheduler drops those tier entries and sends a request whose
promoted prefix did not arrive back to recompute it), skips the works that would read a block that did not
arrive, and the step goes on. The single
forward pass is what the executor contract asks for: in each layer the attention backend writes the new
K/V of the whole batch before any sequence attends, so a work may read prefix blocks another work of the
same plan writes (``StepPlan.shared_reads``). It reads nothing but the plan: each ``Work`` names its
request (whose ``payload`` is the request's :class:`Sampling`), its branch index, its block table and its
tokens.

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
from ..scheduler.transfers import reads_inbound
from .model import ModelRunner, SeqStep
from .sampling import (
    RowContext,
    SamplingParams,
    TokenLogprobs,
    beam_logprobs,
    process_logits,
    sample_rows,
    token_logprobs,
    top_candidates,
)
from .transfer import StepTransfers, TransferEngine, TransferErrorHook

if TYPE_CHECKING:
    from .engine import EngineStats


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a request's ``GenRequest.payload`` carries for this executor."""

    params: SamplingParams
    seed: int


class TorchExecutor:
    """Executes plans against ``runner``'s KV store (and ``transfers`` for the tiers); counts into ``stats``.

    ``on_transfer_error(plan)`` (the engine wires it to ``Scheduler.transfers_failed``) is told the transfers
    whose bytes must not be trusted, as a plan of the step holding only them: the prefix cache's transfers
    that raised, as soon as they are known, and -- when the step fails (a swap, the forward pass or sampling
    raised) -- every cache entry the step wrote, because a rerun of the step's transfers could copy blocks the
    failed attempt has overwritten. It must drop those tier entries and take the promoted blocks' identity,
    and send every request holding such a block back to recompute (this executor does not run their works).
    Without it a lost cache transfer fails the step, as a swap does."""

    def __init__(self, runner: ModelRunner, transfers: TransferEngine | None, stats: EngineStats,
                 on_transfer_error: TransferErrorHook | None = None) -> None:
        self.runner = runner
        self.transfers = transfers
        self.stats = stats
        self.block_size = runner.spec.block_size
        self.on_transfer_error = on_transfer_error
        # Log-probabilities of this step, for the engine to stream and then clear (it reads them after
        # confirm): (request id, branch) -> the sampled token's, request id -> {prompt index: ...}.
        self.token_logprobs: dict[tuple[str, int], TokenLogprobs] = {}
        self.prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = {}

    def execute(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        stats = self.stats
        batch: StepTransfers | None = None
        if TransferEngine.has_work(plan):
            if self.transfers is None:
                raise InvariantError("the scheduler planned a transfer to a tier but the engine has none")
            # Demotions (and incoming blocks a work reads) now; the rest beside the compute.
            batch = self.transfers.start(plan, inbound_needed=reads_inbound(plan, self.block_size))
        try:
            works = [*plan.prefills, *plan.decodes]
            if batch is not None:
                self._check(batch)
                missing = self._settle(batch)  # promoted blocks that did not arrive: nobody reads them
                if missing:
                    works = [w for w in works if missing.isdisjoint(w.blocks)]
            if plan.copies:
                self.runner.store.copy_blocks(plan.copies)
                stats.copies += len(plan.copies)
            out = StepOutput()
            if works:
                logits, rows, full = self._forward(works)
                if full:
                    self._prompt_logprobs(works, rows, full)
                self._select(works, logits, rows, out)
        except BaseException:
            if batch is not None:
                batch.done.wait()  # nothing outlives the step, even a failing one
                self._write_off(batch)
            raise
        if batch is not None:
            batch.wait()
            try:
                self._check(batch)  # a swap that failed on the worker fails the step here ...
                self._settle(batch)  # lost on the worker: no work of this step read those blocks
            except BaseException:
                self._write_off(batch)  # ... after this attempt's forward pass: no entry it wrote is trusted
                raise
            out.transfer_s = batch.busy_s
            out.transfer_exposed_s = batch.exposed_s
            out.transfer_hidden_s = batch.hidden_s
            stats.transfer_s += batch.busy_s
            stats.transfer_exposed_s += batch.exposed_s
            stats.transfer_hidden_s += batch.hidden_s
            stats.swapped_out_blocks += len(plan.swap_out)
            stats.swapped_in_blocks += len(plan.swap_in)
            # The blocks that arrived (failures are counted by the transfer engine).
            stats.demoted_blocks += len(plan.demote) - batch.lost_count("demote")
            stats.promoted_blocks += len(plan.promote) - batch.lost_count("promote")
            stats.moved_blocks += len(plan.tier_moves) - batch.lost_count("tier_moves")
            stats.written_back_blocks += len(plan.writeback) - batch.lost_count("writeback")
        out.elapsed_s = time.perf_counter() - t0
        return out

    def _check(self, batch: StepTransfers) -> None:
        """A swap failed: the step fails (the driver finds its request)."""
        if batch.error is None:
            return
        batch.done.wait()
        raise batch.error

    def _settle(self, batch: StepTransfers) -> set[int]:
        """Hand the cache transfers lost so far to ``on_transfer_error``; returns the device blocks of the
        lost promotions (their requests recompute them). Without a hook the loss fails the step."""
        lost = batch.take_lost()
        if lost is None:
            return set()
        if self.on_transfer_error is None:
            raise batch.lost_error  # type: ignore[misc]
        self.on_transfer_error(lost)
        return {d for _, d in lost.promote}

    def _write_off(self, batch: StepTransfers) -> None:
        """The step failed after its transfers ran: the driver may run them again, one part at a time,
        after this attempt's forward pass wrote blocks a demotion or move reads -- so no entry this step
        wrote is trusted. Promotions are read again from slots that drain only at ``confirm``: the
        promoted blocks keep their identity unless their own read failed."""
        if self.on_transfer_error is None:
            return
        plan = batch.plan
        lost = batch.take_lost()
        written = StepPlan(plan.step, demote=list(plan.demote), tier_moves=list(plan.tier_moves),
                           writeback=list(plan.writeback), promote=lost.promote if lost is not None else [])
        if written.tier_transfers:
            self.on_transfer_error(written)

    def _forward(self, works: list[Work]) -> tuple[torch.Tensor, list[int], list[int]]:
        """Run every work in one batch; sibling branches with identical work (same positions through
        the very same blocks, e.g. the n branches of a fresh request) are computed once. Returns the
        logits, each work's row, and the rows whose every position was kept (prompt logprobs)."""
        bs = self.block_size
        steps: list[SeqStep] = []
        rows: list[int] = []
        full: list[int] = []
        seen: dict[tuple[Any, ...], int] = {}
        stats = self.stats
        for w in works:
            blocks = w.blocks
            key = (w.start, w.end, tuple(blocks[: -(-w.end // bs)]), tuple(w.tokens[w.start:w.end]))
            if w.groups:  # KV cache groups: the same only through every group's same blocks
                key += tuple(tuple(t[: -(-w.end // bs)]) for t in w.groups[1:])
            row = seen.get(key)
            if row is None:
                row = seen[key] = len(steps)
                table = list(blocks)
                if self._wants_prompt(w):
                    full.append(row)
                steps.append(SeqStep(list(w.tokens[w.start:w.end]), w.start, table,
                                     BlockTable(bs, table).slot_mapping(w.start, w.end), w.groups))
                if w.end - w.start == 1:
                    stats.decode_tokens += 1
                else:
                    stats.prefill_tokens += w.end - w.start
            else:
                stats.deduplicated_rows += 1
            rows.append(row)
        t = time.perf_counter()
        logits = self.runner.forward(steps, full) if full else self.runner.forward(steps)
        stats.forward_s += time.perf_counter() - t
        stats.forward_steps += 1
        return logits, rows, full

    @staticmethod
    def _wants_prompt(w: Work) -> bool:
        """A work computing prompt positions of a request that asked for prompt logprobs (the prompt's
        position p gives the logprob of prompt token p + 1)."""
        req = w.request
        return (req is not None and isinstance(req.payload, Sampling) and req.payload.params.prompt_logprobs is not None
                and w.start < len(req.prompt) - 1)

    PROMPT_ROWS = 128  # logits rows computed at a time for prompt logprobs (128 x vocab floats)

    def _prompt_logprobs(self, works: list[Work], rows: list[int], full: list[int]) -> None:
        """Each prompt token's logprob (and top alternatives) from the kept hidden states of this very
        pass: position p's logits score token p + 1. Positions past the prompt (a recomputed output) are
        not prompt tokens; the scheduler's own sample of the last position is handled by _select."""
        wanted = set(full)
        owner: dict[int, Work] = {}
        for w, row in zip(works, rows, strict=True):
            if row in wanted and row not in owner:
                owner[row] = w
        offset: dict[int, int] = {}
        at = 0
        for row in full:  # the kept positions are concatenated in the order of ``full``
            offset[row] = at
            at += owner[row].end - owner[row].start
        for row in full:
            w = owner[row]
            req = w.request
            assert req is not None
            k = req.payload.params.prompt_logprobs
            plen = len(req.prompt)
            hi = min(w.end, plen - 1)  # positions [w.start, hi) score prompt tokens w.start+1 .. hi
            got = self.prompt_logprobs.setdefault(req.request_id, {})
            for lo in range(w.start, hi, self.PROMPT_ROWS):
                top = min(hi, lo + self.PROMPT_ROWS)
                base = offset[row] + lo - w.start
                logits = self.runner.position_logits(base, base + top - lo)
                targets = list(req.prompt[lo + 1:top + 1])
                for p, entry in enumerate(token_logprobs(logits, targets, [k] * len(targets)), start=lo + 1):
                    got[p] = entry
        self.runner.model.kept = None  # the kept hidden states are read: let them go before the next step

    def _select(self, works: list[Work], logits: torch.Tensor, rows: list[int], out: StepOutput) -> None:
        picks: list[tuple[str, int]] = []  # (seq_id, logits row) of ordinary samples
        params: list[SamplingParams] = []
        keys: list[tuple[int, int, int]] = []
        contexts: list[RowContext] = []
        owners: list[tuple[str, int]] = []  # (request id, branch)
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
            contexts.append(RowContext(w.tokens, len(req.prompt), w.end, req.stop_token_ids, w.branch))
            owners.append((req.request_id, w.branch))
        if picks:
            index = [r for _, r in picks]
            chosen = logits if index == list(range(logits.shape[0])) else \
                logits[torch.tensor(index, dtype=torch.long, device=logits.device)]
            tokens = sample_rows(process_logits(chosen, params, contexts), params, keys)
            for (seq_id, _), token in zip(picks, tokens, strict=True):
                out.sampled[seq_id] = [token]
            wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
            if wanted:  # vLLM's raw logprobs: the model's own logits, before any processing
                raw = chosen[torch.tensor(wanted, device=chosen.device)]
                entries = token_logprobs(raw, [tokens[i] for i in wanted], [params[i].logprobs or 0 for i in wanted])
                for i, entry in zip(wanted, entries, strict=True):
                    self.token_logprobs[owners[i]] = entry
        if beams:
            lp = beam_logprobs(logits[torch.tensor([r for _, r, _ in beams], device=logits.device)])
            for i, (seq_id, _, width) in enumerate(beams):
                out.candidates[seq_id] = top_candidates(lp[i], 2 * width)


__all__ = ["Sampling", "TorchExecutor"]
