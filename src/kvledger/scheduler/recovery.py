"""Choosing how to recover a preempted request: recompute or swap, by an explicit cost model.

recompute_s = replay_tokens x flops_per_token / flops_per_s     (replay_tokens excludes prefix hits)
swap_s      = 2 x (blocks x block_bytes / link_Bps + rounds x overhead_s)   (out now, back later)
Both in seconds. ``auto`` picks the smaller; a swap that the host pool cannot hold falls back to
recompute with that reason. The modes are registered in :data:`RECOVERY_MODES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..core.registry import Registry
from .host import TransferModel


@dataclass(frozen=True, slots=True)
class RecoveryCosts:
    flops_per_token: float = 2 * 8e9  # ~2 x parameters for a forward pass of one token (8B model)
    flops_per_s: float = 400e12  # sustained prefill FLOP/s
    block_bytes: int = 2 * 2**20
    transfer: TransferModel = TransferModel()

    def recompute_s(self, replay_tokens: int) -> float:
        return max(replay_tokens, 0) * self.flops_per_token / self.flops_per_s

    def swap_s(self, blocks: int) -> float:
        return 2 * self.transfer.time_s(blocks, self.block_bytes)

    def choose(self, replay_tokens: int, blocks: int) -> tuple[str, float, float]:
        """("recompute" | "swap", recompute_s, swap_s)."""
        r, s = self.recompute_s(replay_tokens), self.swap_s(blocks)
        return ("swap" if s < r else "recompute"), r, s


# (costs, tokens a recompute replays, distinct blocks a swap moves) -> (mode, note for the reason)
Resolve = Callable[[RecoveryCosts, int, int], tuple[str, str]]


def _auto(costs: RecoveryCosts, replay_tokens: int, blocks: int) -> tuple[str, str]:
    mode, r_s, s_s = costs.choose(replay_tokens, blocks)
    return mode, f"; auto chose {mode} (recompute {r_s * 1e3:.3f} ms vs swap {s_s * 1e3:.3f} ms)"


RECOVERY_MODES: Registry[Resolve] = Registry("recovery mode")
RECOVERY_MODES.register("recompute", lambda costs, replay, blocks: ("recompute", ""),
                        "drop the victim's blocks; it is replayed from its tokens (prefix hits soften it)")
RECOVERY_MODES.register("swap", lambda costs, replay, blocks: ("swap", ""),
                        "copy the victim's blocks to the host tier and back (recompute if the host is full)")
RECOVERY_MODES.register("auto", _auto, "whichever of recompute and swap the cost model says is cheaper")
