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

:class:`BeamSearch` runs these steps for every beam request of one scheduler; the driver calls it
around the executor (hold back, choose before ``confirm``, fork after). No tensors here: candidates
arrive as ``(logprob, token)`` pairs, the best ``2 * width`` of each beam's next-token distribution.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field

from ..errors import AdmissionError, InvariantError, LedgerError
from .plan import Branch, GenRequest, Status, StepPlan, Work
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
                       in_ledger=p.in_ledger, admitted_order=p.admitted_order, preemptions=p.preemptions,
                       index=next_index + i)
        sched.adopt_branch(child)
        sched.accept(child, [token], done)  # stop / length rules, exactly as confirm applies them
        out.append(child)
    return out


def end_beams(sched: Scheduler, request_id: str, reason: str) -> None:
    """Finish every live beam of ``request_id`` with ``reason`` (the request then finishes)."""
    for br in _live(sched, request_id):
        sched.end_branch(br, reason)


Hypothesis = tuple[float, list[int], str]  # (summed logprob, output tokens, finish reason)


@dataclass(slots=True)
class BeamState:
    """One beam request: its live beams best first, their scores, the finished hypotheses."""

    request: GenRequest
    order: list[str]
    scores: dict[str, float] = field(default_factory=dict)
    hyps: list[Hypothesis] = field(default_factory=list)
    final: list[Hypothesis] | None = None  # set when the search is over
    pending: list[BeamChoice] = field(default_factory=list)  # this step's running choices
    forks: list[BeamChoice] = field(default_factory=list)  # the ones that need a fork after confirm

    @property
    def width(self) -> int:
        return self.request.n


class BeamSearch:
    """Every beam request (``GenRequest.beam``) of one scheduler, stepped by the driver:

    * :meth:`hold_back` before the executor: a beam step needs every live beam's logits at the same
      length, so a request whose beams would not all sample at one position (a deferred beam, a
      prefill cut by the token budget) samples none this step (decodes skipped, prefills one short).
      The scheduler plans by the same rule (``Scheduler._schedule_running``): it schedules a beam
      request's decodes only when all its beams decode together, so what is held back here is at most
      a lagging beam's completing prefill (trimmed) or a prefill of a request admitted this step;
    * :meth:`choose` before ``confirm``: from the executor's candidates, finished hypotheses, pruning,
      each surviving beam's first continuation as its sampled token, or the end of the search;
    * :meth:`fork` after ``confirm``: one new beam per further continuation.
    """

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.states: dict[str, BeamState] = {}
        self.held_back = 0  # works held back so far

    def add(self, request: GenRequest) -> None:
        rid = request.request_id
        self.states[rid] = BeamState(request, [rid] + [f"{rid}/{i}" for i in range(1, request.n)])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.states

    def __bool__(self) -> bool:
        return bool(self.states)

    def hold_back(self, plan: StepPlan) -> int:
        groups: dict[str, list[Work]] = {}
        states = self.states
        for w in (*plan.prefills, *plan.decodes):
            if w.sample:
                rid = w.request_id
                if rid in states:
                    groups.setdefault(rid, []).append(w)
        held: set[int] = set()
        for rid, works in groups.items():
            live_ids = {br.seq_id for br in self.sched.running.get(rid, ())}
            if {w.seq_id for w in works} == live_ids and len({w.end for w in works}) == 1:
                continue
            held.update(id(w) for w in works)
        if not held:
            return 0
        plan.decodes[:] = [w for w in plan.decodes if id(w) not in held]
        prefills: list[Work] = []
        for w in plan.prefills:
            if id(w) not in held:
                prefills.append(w)
            elif w.end - 1 > w.start:
                prefills.append(w._replace(end=w.end - 1, sample=False))
        plan.prefills[:] = prefills
        self.held_back += len(held)
        return len(held)

    def choose(self, plan: StepPlan, candidates: Mapping[str, Sequence[tuple[float, int]]],
               sampled: MutableMapping[str, list[int]]) -> None:
        """Turn this step's candidates into sampled tokens for the surviving beams (before ``confirm``)."""
        members: dict[str, list[str]] = {}
        for w in (*plan.prefills, *plan.decodes):
            if w.sample and w.request_id in self.states:
                members.setdefault(w.request_id, []).append(w.seq_id)
        for rid, seq_ids in members.items():
            if rid not in self.sched.running:
                continue  # cancelled or failed while the step was in flight
            self._step(rid, seq_ids, candidates, sampled)

    def _step(self, rid: str, seq_ids: list[str], candidates: Mapping[str, Sequence[tuple[float, int]]],
              sampled: MutableMapping[str, list[int]]) -> None:
        state = self.states[rid]
        sched = self.sched
        width = state.width
        order = [sid for sid in state.order if sid in seq_ids]
        if set(order) != set(seq_ids):
            raise InvariantError(f"beam bookkeeping of {rid!r} disagrees with its scheduled beams")
        missing = [sid for sid in order if sid not in candidates]
        if missing:
            raise LedgerError(f"beam {missing[0]!r} was scheduled to sample but no candidates came back")
        brs = {br.seq_id: br for br in sched.branches(rid)}
        first = all(brs[sid].num_generated == 0 for sid in order)
        beams = [(sid, state.scores.get(sid, 0.0)) for sid in order]
        running, finished = select_beams(beams, candidates, width, state.request.stop_token_ids, first_step=first)
        if first:
            # Every beam still equals the prompt: continuation i goes to beam i, no fork needed.
            running = [BeamChoice(order[i], c.token, c.score) for i, c in enumerate(running)]
        for c in finished:
            state.hyps.append((c.score, brs[c.parent].output + [c.token], "stop"))
        state.hyps.sort(key=lambda h: -h[0])
        del state.hyps[width:]
        generated = brs[order[0]].num_generated + 1
        if (not running or generated >= state.request.max_new_tokens
                or (len(state.hyps) >= width and running[0].score <= state.hyps[-1][0])):
            final = state.hyps + [(c.score, brs[c.parent].output + [c.token], "length") for c in running]
            final.sort(key=lambda h: -h[0])
            state.final = final[:width]
            end_beams(sched, rid, state.final[0][2] if state.final else "stop")
            return
        prune_beams(sched, rid, {c.parent for c in running})
        later: list[BeamChoice] = []
        continued: set[str] = set()
        for c in running:
            if c.parent in continued:
                later.append(c)  # a further continuation of the same beam: a fork, after confirm
            else:
                continued.add(c.parent)
                sampled[c.parent] = [c.token]
        state.order = [c.parent for c in running if c.parent in continued and all(c is not x for x in later)]
        state.scores = {sid: next(c.score for c in running if c.parent == sid) for sid in state.order}
        state.pending = running
        state.forks = later

    def fork(self) -> None:
        """After ``confirm``: fork the continuations chosen this step."""
        for rid, state in self.states.items():
            if not state.pending:
                continue
            choices, state.forks = state.forks, []
            children = fork_beams(self.sched, rid, [(c.parent, c.token) for c in choices]) \
                if choices and rid in self.sched.running else [None] * len(choices)
            child_of = {id(c): ch for c, ch in zip(choices, children, strict=True)}
            order: list[str] = []
            scores: dict[str, float] = {}
            for c in state.pending:
                if id(c) in child_of:
                    child = child_of[id(c)]
                    if child is None:
                        continue
                    sid = child.seq_id
                else:
                    sid = c.parent
                order.append(sid)
                scores[sid] = c.score
            state.order, state.scores, state.pending = order, scores, []

    def outcome(self, request_id: str) -> tuple[list[list[int]], list[str], list[float] | None]:
        """``(outputs, finish reasons, scores)`` of a finished beam request, best hypothesis first, and
        forgets it. A search that never finished (cancelled, rejected, never admitted) has one empty
        output with the reason its beams ended with."""
        state = self.states.pop(request_id)
        if state.final:
            return [list(h[1]) for h in state.final], [h[2] for h in state.final], [h[0] for h in state.final]
        try:
            brs = self.sched.branches(request_id)
        except LedgerError:
            brs = []
        reason = next((br.finish_reason for br in brs if br.finish_reason != PRUNED), None)
        return [[]], [reason or "cancelled"], None


__all__ = ["PRUNED", "BeamChoice", "BeamSearch", "BeamState", "end_beams", "fork_beams", "prune_beams",
           "select_beams"]
