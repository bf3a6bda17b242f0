"""How a step's transfers meet its compute: the one rule both the runtime and the simulator follow.

A step's transfers run on one background worker, in this order (``StepPlan`` names them):

    A  demote                  evicted device blocks to a tier (urgent: the step reuses them)
    B  promote, swap_in        tier -> device: promoted prefix blocks, restored swapped requests
    C  tier_moves, writeback,  cached entries one tier down, then retained device blocks copied down ahead
       swap_out                of their eviction; requests preempted by swap (their blocks stay leased)

and the step's compute (copies, the forward pass, sampling) runs beside them on the main thread. Data
dependencies decide what must finish first:

* **A** whenever the plan demotes: a demoted device block has a new owner that this step may write, so
  its bytes must be read out before anything runs;
* **B** when a work of the step reads a promoted or restored block (:func:`reads_inbound`): the forward
  pass waits for it;
* everything else overlaps the compute, and the step ends only when every transfer is done (the slots
  become readable at ``confirm``), so what outlasts the compute is exposed too.

So, with ``needed`` the transfer time the compute must wait for and ``overlapped`` the rest::

    exposed = needed + max(0, overlapped - compute)      hidden = overlapped - max(0, overlapped - compute)
    step    = compute + exposed

Overlap is possible, never guaranteed: only transfers the step does not depend on can hide, and only behind
as much compute as the step has. :func:`step_transfer_timing` computes it from link models (the
simulator); the runtime measures the same split on real copies (``kvledger.runtime.transfer``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .host import TransferModel
from .plan import StepPlan


@dataclass(frozen=True, slots=True)
class TransferTiming:
    """One step's transfer time split by dependency (seconds) and the blocks moved."""

    needed_s: float = 0.0  # transfers the compute had to wait for
    overlapped_s: float = 0.0  # transfers that could run beside the compute
    hidden_s: float = 0.0  # the part of ``overlapped_s`` the compute covered
    exposed_s: float = 0.0  # what the step waited for: needed + the overlapped part left after compute
    blocks: int = 0

    @property
    def total_s(self) -> float:
        return self.needed_s + self.overlapped_s


def inbound_blocks(plan: StepPlan) -> set[int]:
    """Device blocks this step writes from a lower tier (promotions and restores)."""
    out = {d for _, d in plan.promote}
    out.update(d for _, d in plan.swap_in)
    return out


def reads_inbound(plan: StepPlan, block_size: int) -> bool:
    """Whether a prefill or decode of the plan reads (or writes) a block that arrives from a lower tier
    this step: its block table up to the work's last position names one."""
    inbound = inbound_blocks(plan)
    if not inbound:
        return False
    for w in (*plan.prefills, *plan.decodes):
        upto = -(-(w.end + w.lookahead) // block_size)
        if any(b in inbound for b in w.blocks[:upto]):
            return True
    return False


def split(needed_s: float, overlapped_s: float, compute_s: float, blocks: int = 0) -> TransferTiming:
    """The overlap rule: ``overlapped_s`` hides behind at most ``compute_s``."""
    left = max(0.0, overlapped_s - max(0.0, compute_s))
    return TransferTiming(needed_s, overlapped_s, overlapped_s - left, needed_s + left, blocks)


# (tier slot) -> the link model of the tier that holds it
LinkOf = Callable[[int], TransferModel]


def _group_time(pairs: list[int], link_of: LinkOf, block_bytes: int, direction: str) -> float:
    """Seconds for a batch of slots, grouped by tier (each tier's batch pays its own rounds)."""
    by_link: dict[int, tuple[TransferModel, int]] = {}
    for slot in pairs:
        link = link_of(slot)
        key = id(link)
        held = by_link.get(key)
        by_link[key] = (link, (held[1] if held else 0) + 1)
    return sum(link.time_s(n, block_bytes, direction) for link, n in by_link.values())


def step_transfer_timing(plan: StepPlan, compute_s: float, link_of: LinkOf, block_bytes: int,
                         block_size: int, *, overlap: bool = True) -> TransferTiming:
    """The modelled transfer time of ``plan`` beside ``compute_s`` of compute (see the module docstring).
    A move costs the destination tier's outgoing link (its source is a faster tier). ``overlap=False``:
    an executor that runs every transfer before its compute (all of it is exposed)."""
    a = _group_time([d for _, d in plan.demote], link_of, block_bytes, "out")
    b = _group_time([s for s, _ in plan.promote], link_of, block_bytes, "in") + \
        _group_time([s for s, _ in plan.swap_in], link_of, block_bytes, "in")
    c = _group_time([d for _, d in plan.tier_moves], link_of, block_bytes, "out") + \
        _group_time([d for _, d in plan.writeback], link_of, block_bytes, "out") + \
        _group_time([s for _, s in plan.swap_out], link_of, block_bytes, "out")
    blocks = (len(plan.tier_moves) + len(plan.demote) + len(plan.writeback) + len(plan.promote) + len(plan.swap_in)
              + len(plan.swap_out))
    if not blocks:
        return TransferTiming()
    needed = a
    overlapped = 0.0
    if reads_inbound(plan, block_size):
        needed += b
    else:
        overlapped += b
    overlapped += c
    if not overlap:
        return TransferTiming(needed + overlapped, 0.0, 0.0, needed + overlapped, blocks)
    return split(needed, overlapped, compute_s, blocks)


__all__ = ["LinkOf", "TransferTiming", "inbound_blocks", "reads_inbound", "split", "step_transfer_timing"]
