"""Where the tiers' bytes live, what the host swap store counts, and the transfer worker's lifetime.

What an operator notices: a disk tier configured on a folder (a fast local disk, say) must put its file
there -- not in the system's temporary folder -- and a folder it cannot use is refused at start, naming
it; the host swap store's counters are running totals (a dashboard differentiates them); and a process
that forgets :meth:`TransferEngine.close` must still exit: the worker thread that runs a step's deferred
copies is a daemon, so it never holds the interpreter open at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kvledger.core import KVSpec
from kvledger.errors import ConfigError
from kvledger.runtime import KVStore
from kvledger.runtime.host_store import BlockRows, FileTier, HostKVStore, MemoryTier, TierStores
from kvledger.runtime.transfer import TransferEngine
from kvledger.scheduler import StepPlan

SPEC = KVSpec(2, 2, 8, kv_dtype="fp32", block_size=4)  # 1024 bytes per block
BLOCK = 1024
EXIT_GUARD_S = 120  # a child not exited (a step not done) by then never will be: a hang guard, not a timing


def filled(num_blocks: int = 4) -> KVStore:
    store = KVStore(SPEC, num_blocks)
    store.block_view.copy_(torch.randn(store.block_view.shape, generator=torch.Generator().manual_seed(3)))
    return store


# ---- the disk tier's folder ---------------------------------------------------------------------------


def test_disk_tiers_put_their_files_in_the_configured_folder_and_create_it(tmp_path: Path) -> None:
    """``disk_dir`` that does not exist yet: it is created, and each disk tier's (unlinked) file was made
    there -- with the given compression -- while the host tier is memory. Without ``disk_dir`` the file
    goes to the system's temporary folder."""
    folder = tmp_path / "nvme" / "kv-tiers"
    stores = TierStores(filled(), ["host", "disk", "disk"], [1, 2, 3], disk_dir=folder, compression="zlib")
    try:
        assert folder.is_dir() and not list(folder.iterdir())  # the files are unlinked: nothing left behind
        host, first, second = stores.tiers
        assert isinstance(host, MemoryTier) and isinstance(first, FileTier) and isinstance(second, FileTier)
        for tier in (first, second):
            assert Path(tier.path.removesuffix(" (unlinked)")).parent == folder
            assert tier.path.endswith(".kv (unlinked)") and Path(tier.path).name.startswith("kvledger-tier-")
        assert stores.stats() == {
            "host": {"slots": 1, "bytes": BLOCK, "block_bytes": BLOCK},
            "disk": {"slots": 3, "bytes": 3 * BLOCK, "block_bytes": BLOCK, "compression": "zlib", "bytes_raw": 0,
                     "bytes_stored": 0, "compression_ratio": None},
        }  # (two tiers named "disk": the stats keep the last)
        assert [stores.tier_name(s) for s in range(6)] == ["host", "disk", "disk", "disk", "disk", "disk"]
    finally:
        stores.close()
    default = TierStores(filled(), ["disk"], [1])
    try:
        assert Path(default.tiers[0].path.removesuffix(" (unlinked)")).parent == Path(tempfile.gettempdir())
    finally:
        default.close()


def test_tier_names_and_sizes_must_pair_up(tmp_path: Path) -> None:
    """Two tier names and one size (or the reverse) is refused, not built as fewer tiers than asked."""
    for names, sizes in ((["host", "disk"], [1]), (["host"], [1, 2])):
        with pytest.raises(ValueError, match="zip"):
            TierStores(filled(), names, sizes, disk_dir=tmp_path)


def test_a_disk_folder_that_cannot_be_used_is_refused_naming_it(tmp_path: Path) -> None:
    """A ``disk_dir`` below a plain file cannot be created: the tiers are refused at once with a
    ConfigError naming the folder (not a disk tier silently placed elsewhere)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=rf"^cannot create the disk tier's file in {blocker / 'kv'}: "):
        TierStores(filled(), ["host", "disk"], [1, 1], disk_dir=blocker / "kv")


# ---- the host swap store's counters ---------------------------------------------------------------------


def test_the_host_swap_store_counts_every_copy_so_far_in_both_directions() -> None:
    """Three swap-outs and three swap-ins in separate calls: the counters are running totals (3 and 3
    after two calls of 2 + 1), and every block comes back exactly."""
    store = filled()
    rows = BlockRows(store)
    before = [rows.snapshot(b) for b in range(4)]
    host = HostKVStore(store, 3)
    host.swap_out([(0, 2), (1, 0)])
    host.swap_out([(3, 1)])
    assert (host.blocks_out, host.blocks_in) == (3, 0)
    store.kv.zero_()
    host.swap_in([(2, 0), (0, 1)])
    assert (host.blocks_out, host.blocks_in) == (3, 2)
    host.swap_in([(1, 3)])
    assert (host.blocks_out, host.blocks_in) == (3, 3)
    assert [rows.snapshot(b) == before[b] for b in range(4)] == [True, True, False, True]  # 2 was not swapped


# ---- the transfer worker's lifetime ---------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import torch
    from kvledger.core import KVSpec
    from kvledger.runtime import KVStore
    from kvledger.runtime.host_store import TierStores
    from kvledger.runtime.transfer import TransferEngine
    from kvledger.scheduler import StepPlan

    store = KVStore(KVSpec(1, 1, 4, kv_dtype="fp32", block_size=2), 2)
    store.block_view.fill_(1.5)
    engine = TransferEngine(TierStores(store, ["host"], [2]))
    batch = engine.start(StepPlan(1, writeback=[(1, 0)]), inbound_needed=False)  # deferred: on the worker
    batch.wait()
    assert batch.error is None
    worker = engine._thread
    print(worker.name, worker.is_alive(), worker.daemon, flush=True)
    # No engine.close(): the interpreter must exit anyway.
""")


def test_a_process_that_never_closes_its_transfer_engine_still_exits() -> None:
    """The worker that runs a step's deferred copies is one daemon thread named for what it does, serving
    every step, gone after ``close()``; and a child process that runs one step whose write-back goes to
    that worker, then ends without ``close()``, exits with status 0 (a non-daemon worker, blocked on its
    queue, would hold the interpreter open for ever)."""
    store = filled(2)
    before = set(threading.enumerate())  # other tests' engines may leave workers of their own running
    engine = TransferEngine(TierStores(store, ["host"], [2]))
    try:
        # (A worker that never runs the step would leave it undone: the guard fails instead of hanging.)
        assert engine.start(StepPlan(1, writeback=[(0, 1)]), inbound_needed=False).done.wait(EXIT_GUARD_S)
        worker = engine._thread
        assert worker is not None and worker.is_alive()
        assert (worker.name, worker.daemon) == ("kvledger-transfers", True)
        assert engine.start(StepPlan(2, writeback=[(1, 0)]), inbound_needed=False).done.wait(EXIT_GUARD_S)
        assert engine._thread is worker  # one worker for every step, not a thread per step
        assert [t for t in threading.enumerate() if t.name == "kvledger-transfers" and t not in before] == [worker]
    finally:
        engine.close()
    assert engine._thread is None and not worker.is_alive()

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the kvledger this test imports
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        out, err = child.communicate(timeout=EXIT_GUARD_S)
    except subprocess.TimeoutExpired:
        child.kill()  # our own child, by its handle
        child.communicate()
        pytest.fail("the process did not exit: the transfer worker held it open")
    assert child.returncode == 0, err
    assert out.split() == ["kvledger-transfers", "True", "True"]
