"""Beam search on the scheduler's branches: choose the next beams, prune, fork, finish.

A beam request is an ordinary :class:`GenRequest` with ``n = width``: admission reserves ``width``
branches (the prompt stored once, each branch charged its own output allowance) and every branch runs
the same prompt. The executor computes one step for *all* live beams of the request (it holds back a
beam that runs ahead of a sibling), turns each beam's logits into its best continuations, and then:

1. :func:`select_beams` (pure) ranks ``score + logprob`` over every beam's candidates and keeps the
   best ``width`` continuations that do not end the sequence; candidates ending with a stop token
   among the best ``width`` become finished hypotheses instead (the rule of Hugging Face's beam
   scorer, with no length penalty: a hypothesis scores its summed log-probability).
2. :func:`prune_beams` (before ``confirm``) drops the beams no continuation extends. The drop goes
   through :meth:`KVLedger.beam_step`; blocks the in-flight step still reads stay leased.
3. ``confirm`` appends each surviving beam's *first* continuation to that beam, as for any sample.
4. :func:`fork_beams` (after ``confirm``) forks a new branch for every further continuation of a
   beam: the child shares all of the parent's blocks (the partial tail copy-on-write) and starts with
   its own token. Forking after ``confirm`` means the dropped beams' blocks are free again.
5. :func:`end_beams` finishes the request when the search is over.

No tensors here: candidates arrive as ``(logprob, token)`` pairs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ..errors import AdmissionError, LedgerError
from .plan import Branch, Status
from .scheduler import Scheduler

PRUNED = "pruned"


@dataclass(frozen=True, slots=True)
class BeamChoice:
    """Extend beam ``parent`` (a sequence id) with ``token``; ``score`` is the new summed logprob."""

    parent: str
    token: int
    score: float


def select_beams(
    beams: Sequence[tuple[str, float]],
    candidates: Mapping[str, Sequence[tuple[float, int]]],
    width: int,
    stop_token_ids: Collection[int] = (),
    *,
    first_step: bool = False,
) -> tuple[list[BeamChoice], list[BeamChoice]]:
    """``(running, finished)`` continuations, best first.

    ``beams``: the live beams in rank order as ``(seq_id, score)``; ``candidates[seq_id]``: that beam's
    best ``(logprob, token)`` pairs, best first (``2 * width`` of them are enough: at most ``width``
    can end with a stop token among the kept ones). ``first_step``: every beam still equals the
    prompt, so only the first is expanded (otherwise the beams would all pick the same tokens).
    Ties rank by beam rank, then by the candidate's own rank.
    """
    if width < 1:
        raise LedgerError("beam width must be >= 1")
    pool: list[tuple[float, int, int, str, int]] = []
    for rank, (seq_id, score) in enumerate(beams):
        if first_step and rank:
            break
        for token_rank, (logprob, token) in enumerate(candidates[seq_id][: 2 * width]):
            pool.append((score + logprob, rank, token_rank, seq_id, token))
    pool.sort(key=lambda c: (-c[0], c[1], c[2]))
    running: list[BeamChoice] = []
    finished: list[BeamChoice] = []
    for i, (score, _, _, seq_id, token) in enumerate(pool):
        if token in stop_token_ids:
            if i < width:
                finished.append(BeamChoice(seq_id, token, score))
            continue
        running.append(BeamChoice(seq_id, token, score))
        if len(running) == width:
            break
    return running, finished


def _live(sched: Scheduler, request_id: str) -> list[Branch]:
    return list(sched.running.get(request_id, ()))


def prune_beams(sched: Scheduler, request_id: str, keep: Collection[str]) -> list[str]:
    """Drop every live beam of ``request_id`` not in ``keep`` (call before ``confirm``). Returns the
    dropped sequence ids; their branches finish with reason ``"pruned"``."""
    live = _live(sched, request_id)
    drops = [br for br in live if br.seq_id not in keep]
    if not drops:
        return []
    if len(drops) == len(live):
        raise LedgerError(f"pruning every beam of {request_id!r}: use end_beams to finish the request")
    sched.ledger.beam_step([], [br.seq_id for br in drops])
    running = sched.running[request_id]
    for br in drops:
        running.remove(br)
        br.status = Status.FINISHED
        br.finish_reason = PRUNED
    return [br.seq_id for br in drops]


def fork_beams(sched: Scheduler, request_id: str, forks: Sequence[tuple[str, int]]) -> list[Branch | None]:
    """After ``confirm``: fork one new beam per ``(parent seq_id, token)``. The child shares the
    parent's blocks as they were before this step's token (the parent's own continuation is already
    appended to its branch) and takes ``token`` as its newest token.

    When the pool cannot promise every fork, the last ones are left out (the search goes on with
    fewer beams); their entries in the result are ``None``. Returns the new branches in ``forks``
    order."""
    if not forks:
        return []
    branches = sched.branches(request_id)
    by_id = {br.seq_id: br for br in _live(sched, request_id)}
    for parent, _ in forks:
        br = by_id.get(parent)
        if br is None or br.status is not Status.RUNNING:
            raise LedgerError(f"beam {parent!r} of {request_id!r} is not running")
        if len(br.tokens) != br.in_ledger + 1:
            raise LedgerError(f"beam {parent!r} must have exactly this step's token pending to fork")
    next_index = len(branches)
    ids = [f"{request_id}/{next_index + i}" for i in range(len(forks))]
    kept = len(forks)
    while kept:
        try:
            sched.ledger.beam_step([(p, c) for (p, _), c in zip(forks[:kept], ids[:kept], strict=True)], [])
            break
        except AdmissionError:
            kept -= 1
    out: list[Branch | None] = []
    done: list[Branch] = []
    for i, ((parent, token), child_id) in enumerate(zip(forks, ids, strict=True)):
        if i >= kept:
            out.append(None)
            continue
        p = by_id[parent]
        child = Branch(child_id, p.request, p.tokens[: p.in_ledger], Status.RUNNING, computed=p.computed,
                       in_ledger=p.in_ledger, admitted_order=p.admitted_order, preemptions=p.preemptions)
        sched.adopt_branch(child)
        sched.accept(child, [token], done)  # stop / length rules, exactly as confirm applies them
        out.append(child)
    return out


def end_beams(sched: Scheduler, request_id: str, reason: str) -> None:
    """Finish every live beam of ``request_id`` with ``reason`` (the request then finishes)."""
    for br in _live(sched, request_id):
        sched.end_branch(br, reason)


__all__ = ["PRUNED", "BeamChoice", "end_beams", "fork_beams", "prune_beams", "select_beams"]
