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
