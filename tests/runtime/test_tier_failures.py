"""A failing tier below the device pool costs cache entries, never requests: with the disk tier's writes
raising (a full disk), every request whose admission evicts a retained block still completes with the
tokens of an undisturbed run, and with its reads raising, a prefix that cannot come back is recomputed.
The engine counts both kinds of failure; the ledger, the tiers and the leases end clean."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import kvledger.runtime.executor as executor_module
from kvledger.runtime.engine import Engine
from kvledger.runtime.sampling import SamplingParams
from kvledger.scheduler import SchedulerConfig

BS = 4
NEW = 8


def _prompts(count: int, heads: tuple[int, int], seed: int = 1) -> list[list[int]]:
    """Prompts around two shared heads of ``heads`` tokens, each with a tail of its own of 1-5 tokens."""
    gen = torch.Generator().manual_seed(seed)
    shared = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in heads]
    return [shared[i % 2] + torch.randint(0, 256, (1 + (3 * i) % 5,), generator=gen).tolist() for i in range(count)]


# With NEW tokens each needs 5-7 blocks of a pool of 8: every admission evicts a retained block.
WARM, *PROMPTS = _prompts(9, (9, 13))
# Heads of 4 and 5 blocks in a pool of 10: most of a head comes back from the disk when it is needed again.
LONG = _prompts(9, (17, 21))


def _engine(path, tmp_path, tiers: dict, num_blocks: int = 8, **cfg: object) -> Engine:
    config = SchedulerConfig(offload_prefixes=True, max_running=1, **cfg)  # type: ignore[arg-type]
    return Engine.from_model(path, num_blocks=num_blocks, block_size=BS, scheduler_config=config, disk_dir=tmp_path,
                             **tiers)


def _one_by_one(engine: Engine, prompts: list[list[int]]) -> list:
    return [engine.generate([p], NEW)[0] for p in prompts]


class FailingDisk:
    """Makes the disk tier's file calls ``names`` (``os.pwrite`` for writes, ``os.preadv`` and ``os.pread``
    for reads) raise ``OSError(code)`` on every ``every``-th call; the others do what they always do."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...], code: int, every: int = 1) -> None:
        self.calls = self.raised = 0
        self.code, self.every = code, every
        for name in names:
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name)))

    def _wrap(self, real):
        def call(*args: object) -> object:
            self.calls += 1
            if self.calls % self.every == 0:
                self.raised += 1
                raise OSError(self.code, os.strerror(self.code))
            return real(*args)
        return call


def assert_clean(engine: Engine) -> None:
    engine.check()
    u = engine.ledger.usage()
    assert (u.active, u.promised, u.sequences, u.deferred) == (0, 0, 0, 0), u
    assert engine.ledger.outstanding_leases() == 0
    host = engine.scheduler.host
    assert host.counts["held"] == 0 and host.counts["draining"] == 0 and not any(host.in_flight)
    assert not engine.has_work() and engine.stats.failed == 0


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return tiny_llama[0]


TIERS = {"disk": dict(disk_blocks=32), "host+disk": dict(host_blocks=2, disk_blocks=32)}


@pytest.mark.parametrize("tiers", list(TIERS))
def test_a_full_disk_fails_no_request_whose_admission_evicts(tiny, tmp_path, monkeypatch, tiers: str) -> None:
    """Regression (defect 3): a demotion that raised failed the request whose admission evicted someone
    else's idle block, and while the disk kept failing every request that needed an eviction failed."""
    reference = _engine(tiny, tmp_path, TIERS[tiers])
    want = [r.output for r in _one_by_one(reference, [WARM, *PROMPTS])]
    reference.close()

    engine = _engine(tiny, tmp_path, TIERS[tiers])
    assert engine.generate([WARM], NEW)[0].output == want[0]  # the pool now holds WARM's retained blocks
    full = FailingDisk(monkeypatch, ("pwrite",), errno.ENOSPC)
    results = []
    for prompt in PROMPTS:
        evictions = engine.snapshot().evictions
        results.append(engine.generate([prompt], NEW)[0])
        assert results[-1].finish_reasons == ["length"]
        assert engine.snapshot().evictions > evictions  # each admission evicted a retained block
    assert [r.output for r in results] == want[1:]

    failures = engine.transfers.stats()["demotion_failures"]
    tier = engine.scheduler.tier_stats()
    assert failures == full.raised > 0 and engine.transfers.stats()["promotion_failures"] == 0
    # Each lost write dropped exactly its own entry, and nothing on the disk is readable.
    assert tier["demotion_failures"] == tier["flow"]["discarded"] == failures
    assert all(engine.scheduler.host.tier_name(slot) != "disk" for slot in engine.scheduler.host.index.values())
    assert_clean(engine)

    # The disk works again: the tiers fill and serve prefixes as usual, with the same tokens.
    monkeypatch.undo()
    again = _one_by_one(engine, PROMPTS[:4])
    assert [r.output for r in again] == want[1:5]
    assert engine.scheduler.tier_stats()["flow"]["promoted"] > 0
    assert_clean(engine)
    engine.close()


@pytest.mark.parametrize("every", [1, 2], ids=["every-read", "every-other-read"])
@pytest.mark.parametrize("overlap,restore_ahead", [(True, False), (True, True), (False, False)],
                         ids=["inline", "on-the-worker", "no-overlap"])
def test_a_failed_promotion_read_falls_back_to_recompute(tiny, tmp_path, monkeypatch, overlap: bool,
                                                         restore_ahead: bool, every: int) -> None:
    """A prefix block that cannot be read back from the disk is computed again: its request completes with
    the tokens of a run whose promotions succeeded -- whether the blocks are read before the forward pass
    that needs them, or on the worker beside a step that does not (restore_ahead), and whether all of a
    head's reads fail or only some."""
    cfg = dict(restore_ahead=restore_ahead)
    tiers = dict(disk_blocks=32, overlap_transfers=overlap)
    reference = _engine(tiny, tmp_path, tiers, num_blocks=10, **cfg)
    want = [r.output for r in _one_by_one(reference, LONG)]
    assert reference.stats.promoted_blocks >= 10  # the undisturbed run promotes the shared heads
    reference.close()

    engine = _engine(tiny, tmp_path, tiers, num_blocks=10, **cfg)
    assert [r.output for r in _one_by_one(engine, LONG[:2])] == want[:2]  # both heads are on the disk now
    broken = FailingDisk(monkeypatch, ("preadv", "pread"), errno.EIO, every)
    results = _one_by_one(engine, LONG[2:])
    assert [r.finish_reasons for r in results] == [["length"]] * (len(LONG) - 2)
    assert [r.output for r in results] == want[2:]

    stats = engine.transfers.stats()
    tier = engine.scheduler.tier_stats()
    assert stats["promotion_failures"] == tier["promotion_failures"] == broken.raised > 1
    assert stats["demotion_failures"] == 0
    # Taken from the tier: promoted, or lost on the way up (those tokens were computed instead).
    assert tier["flow"]["promoted"] == engine.stats.promoted_blocks + stats["promotion_failures"]
    assert tier["promoted_tokens"] == BS * engine.stats.promoted_blocks
    if every > 1:
        assert engine.stats.promoted_blocks > 0  # the reads that worked were used
    assert_clean(engine)

    monkeypatch.undo()
    again = _one_by_one(engine, LONG)  # nothing a failed read left behind is ever served
    assert [r.output for r in again] == want
    assert_clean(engine)
    engine.close()


def test_requests_running_together_keep_their_tokens_while_the_disk_fails(tiny, tmp_path, monkeypatch) -> None:
    """All eight submitted at once (two run at a time): every admission after the first few evicts, every
    demotion and write-back fails, and nobody notices but the counters."""
    def engine_() -> Engine:
        return Engine.from_model(tiny, num_blocks=12, block_size=BS, disk_dir=tmp_path, host_blocks=2,
                                 disk_blocks=32, scheduler_config=SchedulerConfig(offload_prefixes=True, max_running=2))

    reference = engine_()
    want = [r.output for r in reference.generate(PROMPTS, NEW)]
    reference.close()

    engine = engine_()
    full = FailingDisk(monkeypatch, ("pwrite",), errno.ENOSPC)
    results = engine.generate(PROMPTS, NEW)
    assert [r.finish_reasons for r in results] == [["length"]] * len(PROMPTS)
    assert [r.output for r in results] == want
    assert engine.transfers.stats()["demotion_failures"] == full.raised > 0 and engine.snapshot().evictions > 0
    assert_clean(engine)
    engine.close()


def test_metrics_show_a_failing_disk(tiny, tmp_path, monkeypatch) -> None:
    """``/metrics`` exposes both counters as Prometheus counters, read at scrape time."""
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from kvledger.server.backend import EngineBackend
    from kvledger.server.metrics import ServerMetrics

    engine = _engine(tiny, tmp_path, dict(disk_blocks=32), num_blocks=10)
    _one_by_one(engine, LONG[:2])
    FailingDisk(monkeypatch, ("pwrite", "preadv", "pread"), errno.EIO)
    _one_by_one(engine, LONG[2:])
    failures = engine.transfers.stats()
    assert failures["demotion_failures"] > 0 and failures["promotion_failures"] > 0

    gate = SimpleNamespace(waiting=lambda: 0, tenants=lambda: [], tenant_in_flight=lambda name: 0)
    text = ServerMetrics("tiny", EngineBackend(engine), gate, lambda: []).exposition().decode()  # type: ignore[arg-type]
    samples = {(s.name, s.labels.get("model_name")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("kvledger:tier_demotion_failures_total", "tiny")] == failures["demotion_failures"]
    assert samples[("kvledger:tier_promotion_failures_total", "tiny")] == failures["promotion_failures"]
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["kvledger:tier_demotion_failures"] == types["kvledger:tier_promotion_failures"] == "counter"
    engine.close()


def test_a_request_failing_in_a_step_that_demotes_leaves_no_wrong_entry_below(tiny, monkeypatch) -> None:
    """The driver runs a failing step again one request at a time, the prefix cache's transfers first. A
    demotion run again after the failed attempt's forward pass wrote the evicted block (its new owner's
    KV) would cache that KV under the old block's identity, and a later promotion would serve it: the
    executor writes the step's cache entries off instead, so the prefix is recomputed."""
    gen = torch.Generator().manual_seed(3)
    head = torch.randint(0, 256, (16,), generator=gen).tolist()  # 4 full blocks, retained after its request
    evicting = torch.randint(0, 256, (22,), generator=gen).tolist()  # admitted with the culprit: evicts 2 of them
    culprit = torch.randint(0, 256, (5,), generator=gen).tolist()
    seed = 4242
    sample_rows = executor_module.sample_rows

    def run() -> tuple[list[int], list[int], list[str]]:
        config = SchedulerConfig(offload_prefixes=True, max_running=2, writeback_blocks=0)  # urgent demotions
        engine = Engine.from_model(tiny, num_blocks=10, block_size=BS, scheduler_config=config, host_blocks=16)
        engine.generate([head], 1)
        other = engine.submit(evicting, 6)
        x = engine.submit(culprit, 6, SamplingParams(temperature=0.7, seed=seed))
        engine.run_until_idle()
        again = engine.generate([head + [7, 8, 9]], 6)[0]  # the head's evicted blocks come back from the host
        assert again.finish_reasons == ["length"] and engine.stats.demoted_blocks > 0
        engine.check()
        engine.close()
        return other.result().output, again.output, x.result().finish_reasons

    want = run()

    def failing_for_the_culprit(logits, params, keys):  # noqa: ANN001, ANN202
        if any(s == seed for s, _, _ in keys):
            raise ValueError("probabilities contain NaN")
        return sample_rows(logits, params, keys)

    monkeypatch.setattr(executor_module, "sample_rows", failing_for_the_culprit)
    other, again, reasons = run()
    assert reasons == ["error: ValueError: probabilities contain NaN"]
    assert (other, again) == want[:2]


def test_a_swap_failing_on_the_worker_after_the_forward_pass_writes_the_steps_cache_entries_off() -> None:
    """A swap that fails on the transfer worker fails the step only once the step's compute ran: the
    entries its demotions wrote can no longer be trusted (the driver's rerun could copy blocks that
    compute overwrote), so they are handed to the write-off hook exactly as when the compute raises.
    Before the fix the second swap check sat outside the write-off."""
    from types import SimpleNamespace

    from kvledger.runtime.executor import TorchExecutor
    from kvledger.runtime.transfer import StepTransfers
    from kvledger.scheduler import StepPlan

    plan = StepPlan(7, demote=[(3, 11)], swap_out=[(4, 12)])

    class FailsOnTheWorker(StepTransfers):
        def wait(self) -> float:  # the worker's part ends in error after the compute
            self.error = OSError(errno.EIO, "swap-out failed on the worker")
            self.done.set()
            return 0.0

    class WorkerFails:
        """Starts the step's transfers; the swap-out on the worker raises only after the compute."""

        @staticmethod
        def start(p: StepPlan, inbound_needed: bool = True) -> StepTransfers:
            return FailsOnTheWorker(p)

    written: list[StepPlan] = []
    runner = SimpleNamespace(spec=SimpleNamespace(block_size=4), store=None)
    stats = SimpleNamespace(copies=0)
    executor = TorchExecutor(runner, WorkerFails(), stats, on_transfer_error=written.append)  # type: ignore[arg-type]
    with pytest.raises(OSError, match="swap-out failed on the worker"):
        executor.execute(plan)
    assert [(p.step, p.demote) for p in written] == [(7, [(3, 11)])]
