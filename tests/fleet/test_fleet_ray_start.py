"""How the fleet's Ray tests start Ray on a busy machine (tests/fleet/conftest.py), without starting one: a
slow raylet is waited for, a timed-out start is tried once more, a second time-out fails in one line naming
the load, and a real fault (a Ray listening beyond loopback) is never retried."""

from __future__ import annotations

import sys

import pytest

from kvledger.errors import ConfigError

from . import conftest

TIMED_OUT = "The current node timed out during startup. This could happen because some of the raylet failed to " \
            "startup or the GCS has become overloaded."


@pytest.fixture()
def no_ray_to_stop(monkeypatch):
    stopped: list[int] = []
    monkeypatch.setattr(conftest, "stop_ray", lambda *a, **k: stopped.append(1) or [])
    return stopped


def test_the_node_lookup_waits_for_a_slow_raylet_then_gives_up_past_its_time(monkeypatch):
    from ray._private import services

    calls: list[int] = []

    def slow(_gcs, _node):  # noqa: ANN202
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("node info not available")
        return {"node_id": "n"}

    monkeypatch.setattr(services, "get_node", slow)
    with conftest.patient_node_registration(30):
        assert services.get_node("gcs", "n") == {"node_id": "n"}
    assert len(calls) == 3 and services.get_node is slow  # put back afterwards

    monkeypatch.setattr(services, "get_node", lambda *_: (_ for _ in ()).throw(RuntimeError("never")))
    with conftest.patient_node_registration(0.0), pytest.raises(RuntimeError, match="never"):
        services.get_node("gcs", "n")


def test_a_timed_out_start_is_tried_once_more(no_ray_to_stop):
    tries: list[int] = []

    def start() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise Exception(TIMED_OUT)  # noqa: TRY002 -- what Ray raises
        return "context"

    assert conftest.start_local_ray(start, timeout_s=1) == "context"
    assert len(tries) == 2 and no_ray_to_stop == [1]


def test_two_timed_out_starts_fail_in_one_line_naming_the_load(no_ray_to_stop):
    def start() -> str:
        raise Exception(TIMED_OUT)  # noqa: TRY002 -- what Ray raises

    with pytest.raises(pytest.fail.Exception) as failed:
        conftest.start_local_ray(start, timeout_s=1)
    message = str(failed.value)
    assert message.startswith("Ray did not start within ") and " s under load " in message
    assert "tried twice" in message and "\n" not in message and no_ray_to_stop == [1, 1]


def test_a_real_fault_is_raised_at_once(no_ray_to_stop):
    tries: list[int] = []

    def start() -> str:
        tries.append(1)
        raise ConfigError("Ray listens beyond 127.0.0.1")

    with pytest.raises(ConfigError):
        conftest.start_local_ray(start, timeout_s=1)
    assert tries == [1] and no_ray_to_stop == []


def test_a_subprocess_whose_ray_timed_out_is_run_once_more_then_fails_in_one_line(tmp_path):
    count = tmp_path / "runs"
    code = (f"import pathlib, sys; p = pathlib.Path({str(count)!r}); p.write_text(p.read_text() + 'x' "
            f"if p.exists() else 'x'); sys.exit({TIMED_OUT!r})")
    with pytest.raises(pytest.fail.Exception, match=r"^Ray did not start within \d+ s under load "):
        conftest.run_with_ray([sys.executable, "-c", code], timeout_s=60)
    assert count.read_text() == "xx"

    ok = conftest.run_with_ray([sys.executable, "-c", "import sys; sys.exit('ConfigError: listens beyond')"])
    assert ok.returncode == 1 and "ConfigError" in ok.stderr  # a real fault: returned for the test to judge


# ---- the product: `local_ray` and `kvledger fleet serve` (Ray's start mocked; no Ray is started) ----------

class _Ray:
    """ray.init / ray.shutdown stand-ins: ``init`` raises ``errors`` in turn, then returns a context."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors, self.inits, self.shutdowns = list(errors), 0, 0

    def init(self, **_options: object) -> str:
        self.inits += 1
        if self.errors:
            raise self.errors.pop(0)
        return "context"

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture()
def fake_ray(monkeypatch):
    import ray

    from kvledger.fleet import serve as fleet_serve

    def install(*errors: BaseException) -> _Ray:
        fake = _Ray(*errors)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(fleet_serve, "ray_listeners", lambda: [("127.0.0.1", 6379, "gcs_server")])
        return fake

    return install


def test_local_ray_tries_a_timed_out_start_once_more(fake_ray):
    from kvledger.fleet.serve import local_ray

    fake = fake_ray(Exception(TIMED_OUT))  # noqa: TRY002 -- what Ray raises
    assert local_ray() == "context"
    assert (fake.inits, fake.shutdowns) == (2, 1)  # the half-started node was stopped before the second try


def test_local_ray_fails_in_one_line_after_two_time_outs_and_at_once_for_a_fault(fake_ray):
    from kvledger.fleet.serve import local_ray

    fake = fake_ray(Exception(TIMED_OUT), Exception(TIMED_OUT))  # noqa: TRY002
    with pytest.raises(ConfigError) as err:
        local_ray()
    message = str(err.value)
    assert message.startswith("Ray did not start within ") and "(tried 2 times; load " in message
    assert "GCS has become overloaded" in message and "\n" not in message
    assert (fake.inits, fake.shutdowns) == (2, 2)

    fake = fake_ray(ValueError("bad option"))
    with pytest.raises(ConfigError, match=r"^Ray did not start: ValueError: bad option$"):
        local_ray()
    assert (fake.inits, fake.shutdowns) == (1, 1)  # a fault is not retried


def test_fleet_serve_says_in_one_line_that_ray_did_not_start(fake_ray, monkeypatch, capsys):
    """Before: Ray's start-up time-out reached the user as a traceback. Now: one line, exit 2."""
    from cli_run import run
    from kvledger.cli import fleet_serve_cmds

    monkeypatch.setattr(fleet_serve_cmds, "_resolve_model", lambda config: None)  # no model load: Ray is the point
    fake = fake_ray(Exception(TIMED_OUT), Exception(TIMED_OUT))  # noqa: TRY002
    rc, out, err = run(capsys, "fleet", "serve", "--port", "0")
    assert rc == 2, err
    banner, line = err.strip().splitlines()  # the banner (what would be served), then the one error line
    assert banner.startswith("kvledger fleet serve: model ") and "Traceback" not in err
    assert line.startswith("kvledger: error: Ray did not start within ") and "try again when it is quieter" in line
    assert fake.inits == 2


def test_fleet_serve_that_fails_leaves_a_callers_ray_and_signal_handlers_as_they_were(fake_ray, monkeypatch, capsys):
    """Run in a process that already has Ray children (a test session's shared Ray, an embedding), a fleet
    serve whose own start failed used to kill them after its wait (they looked like leftovers of its Ray)
    -- the session's Ray driver then died with them -- and left SIGTERM at its default handler."""
    import signal
    import subprocess

    from cli_run import run
    from kvledger.cli import fleet_serve_cmds

    monkeypatch.setattr(fleet_serve_cmds, "_resolve_model", lambda config: None)
    monkeypatch.setattr(fleet_serve_cmds, "STOP_WAIT_S", 0.5)
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "ray-of-the-caller"])
    mine = lambda *_: None  # noqa: E731 -- a handler of the caller's
    old = signal.signal(signal.SIGTERM, mine)
    try:
        fake_ray(Exception(TIMED_OUT), Exception(TIMED_OUT))  # noqa: TRY002
        rc, _, err = run(capsys, "fleet", "serve", "--port", "0")
        assert rc == 2, err
        assert theirs.poll() is None, "the caller's Ray process was killed"
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)
        theirs.kill()
        theirs.wait()
