"""Tests written because mutants of a seeded sample (``tests/mutation.py sample``, seed 4) of the ledger
core and the scheduler survived the suite. Each pins down something a caller can see -- a decision's
figures, a statistics key, an error and its message -- that no other test checked."""

from __future__ import annotations

import pytest

from kvledger.core.identity import CacheContext
from kvledger.core.ledger import KVLedger, Request
from kvledger.core.types import Outcome
from kvledger.errors import ConfigError
from kvledger.scheduler.host import TransferModel
from kvledger.scheduler.plan import GenRequest
from kvledger.scheduler.queue import WaitingQueue

BS = 4


def toks(base: int, n: int) -> list[int]:
    return [base + i for i in range(n)]


def test_family_with_more_branches_than_blocks_is_never_with_its_branch_count_and_no_new_blocks() -> None:
    """Three branches cannot fit a 2-block pool: NEVER, ``blocks_total`` is the branch count (3) and the
    refusal charges nothing (``blocks_new`` 0, so ``blocks_charged`` 0)."""
    led = KVLedger(2, BS)
    reqs = [Request(f"f{i}", toks(10, 3), 1, family="f0") for i in range(3)]
    d = led.admit_family(reqs)
    assert d.outcome is Outcome.NEVER and "3 branches" in d.reason
    assert (d.blocks_total, d.blocks_new, d.blocks_charged) == (3, 0, 0)


def test_single_branch_family_over_its_quota_is_never_and_over_quota() -> None:
    """A one-branch family needing 2 blocks (4 prompt + 4 new tokens, BS 4) against a quota of 1 is
    refused as NEVER by the quota."""
    led = KVLedger(16, BS)
    led.set_quota("t", 1)
    d = led.admit_family([Request("a", toks(10, 4), 4, CacheContext(trust_group="t"))])
    assert d.outcome is Outcome.NEVER and d.over_quota and "quota is 1" in d.reason


def test_stats_lifetimes_report_preemptions() -> None:
    """``stats()['lifetimes']`` has a ``preemptions`` count (0 on a fresh ledger)."""
    assert KVLedger(4, BS).stats()["lifetimes"]["preemptions"] == 0


@pytest.mark.parametrize("prompt", ["abcd", b"abcd"])
def test_pin_rejects_a_text_prompt(prompt: object) -> None:
    """A str or bytes prompt is not a sequence of token ids: ConfigError naming the prompt."""
    led = KVLedger(8, BS, prefix_caching=True)
    with pytest.raises(ConfigError, match="the prompt must be a sequence of token ids"):
        led.pin("p", prompt, CacheContext())  # type: ignore[arg-type]


@pytest.mark.parametrize("frac", [2, 1.5, -0.5])
def test_max_pinned_fraction_outside_zero_one_is_rejected(frac: float) -> None:
    """``max_pinned_fraction`` must lie in [0, 1]: a finite value outside is a ConfigError."""
    with pytest.raises(ConfigError, match=r"max_pinned_fraction must be in \[0, 1\]"):
        KVLedger(8, BS, max_pinned_fraction=frac)


def test_transfer_model_names_link_bps_in_its_error() -> None:
    """A non-positive ``link_Bps`` is reported under its own name."""
    with pytest.raises(ConfigError, match="link_Bps must be a positive number"):
        TransferModel(link_Bps=0)


def test_waiting_queue_empty_popleft_message_and_index_one_is_the_second_unit() -> None:
    """``q[1]`` is the second unit, not the head; popping an empty queue says it is empty."""
    q = WaitingQueue()
    with pytest.raises(IndexError, match=r"^the waiting queue is empty$"):
        q.popleft()

    def unit(rid: str) -> list:
        return [type("B", (), {"request": GenRequest(rid, [1], 1)})()]

    a, b, c = unit("a"), unit("b"), unit("c")
    for u in (a, b, c):
        q.append(u)
    assert q[0] is a and q[1] is b and q[2] is c


def test_sequence_state_without_a_family_belongs_to_its_own_request() -> None:
    """A ``SequenceState`` built without ``family`` is its own family (the request id), as documented."""
    from kvledger.core.table import BlockTable  # noqa: PLC0415
    from kvledger.core.types import SequenceState  # noqa: PLC0415
    seq = SequenceState(request_id="r", context=CacheContext(), root=b"", tokens=[1, 2], num_prompt=2,
                        max_new_tokens=3, table=BlockTable(BS, []), promised=0)
    assert seq.family == "r" and seq.limit == 5  # 2 prompt + 3 new


def test_check_reports_tiers_without_demotion_in_exact_words() -> None:
    """With tiers attached but the pool's eviction hook gone, ``check`` names exactly that fault."""
    from kvledger.core.tiers import TierLedger  # noqa: PLC0415
    from kvledger.errors import InvariantError  # noqa: PLC0415
    led = KVLedger(8, BS, prefix_caching=True)
    led.attach_tiers(TierLedger([("host", 8)]))
    led.check()
    led.pool.on_evict = None
    with pytest.raises(InvariantError, match=r"^tiers are attached but the pool's evictions are not demoted$"):
        led.check()


def test_write_back_copies_only_what_the_free_list_is_short_of() -> None:
    """``writeback_blocks=7`` with 5 free blocks and 3 retained prefix blocks: only 7 - 5 = 2 retained
    blocks (the two coldest) are written back, not all 3."""
    from kvledger.core.tiers import TierLedger  # noqa: PLC0415
    from kvledger.scheduler import Scheduler, SchedulerConfig  # noqa: PLC0415
    led = KVLedger(8, BS, prefix_caching=True)
    for k, rid in enumerate("abc"):  # each leaves one full, indexed block retained; 8 - 3 = 5 free
        led.admit(Request(rid, toks(100 * (k + 1), 4), 1)).raise_for_outcome()
        led.mark_computed(rid, 4)
        led.release(rid)
    assert (led.pool.num_free, led.pool.num_retained) == (5, 3)
    s = Scheduler(led, SchedulerConfig(offload_prefixes=True, writeback_blocks=7), host=TierLedger([("host", 8)]))
    plan = s.schedule()
    assert len(plan.writeback) == 2


def test_marking_two_full_blocks_at_once_makes_all_their_tokens_ready() -> None:
    """``mark_computed`` of a whole 8-token prompt (two full blocks, BS 4) in one call: 8 tokens ready."""
    led = KVLedger(8, BS, prefix_caching=True)
    led.admit(Request("a", toks(0, 8), 1)).raise_for_outcome()
    led.mark_computed("a", 8)
    assert led.ready_tokens("a") == 8
