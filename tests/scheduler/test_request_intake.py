"""The one check of a request's shape (``scheduler.intake.check_request_shape``), which the engine and the
fleet's ingress both run, so the ingress refuses exactly what a replica would, in the same words."""

from __future__ import annotations

import re

import pytest

from kvledger.core.ledger import KVLedger
from kvledger.errors import AdmissionError, ConfigError
from kvledger.scheduler import (
    GenRequest,
    Scheduler,
    SchedulerConfig,
    validate_request,
)
from kvledger.scheduler.intake import check_request_shape

try:  # the module name pytest gives tests/scheduler/test_scheduler.py depends on its import mode
    from tests.scheduler.test_scheduler import BS
except ImportError:  # pragma: no cover
    from test_scheduler import BS


def _check(prompt, max_new=4, **kw):
    return check_request_shape(prompt, max_new, **{"vocab_size": 100, "max_context": 10, **kw})


@pytest.mark.parametrize("prompt, error, message", [
    ("hello", ConfigError, "a sequence of integer token ids (tokenize text first)"),
    (b"\x01\x02", ConfigError, "a sequence of integer token ids"),
    ([1.0, 2.0], ConfigError, "a sequence of integer token ids"),
    ([], ConfigError, "the prompt is empty"),
    ([100], ConfigError, "prompt token ids must be in [0, 100)"),
    ([-1], ConfigError, "prompt token ids must be in [0, 100)"),
    ([1] * 10, AdmissionError, "the prompt has 10 tokens but the model's context is 10 tokens: it does not fit"),
])
def test_malformed_or_too_long_prompts(prompt, error, message) -> None:
    with pytest.raises(error) as err:
        _check(prompt)
    assert message in str(err.value)


def test_the_allowance_is_cut_to_the_context_and_checked() -> None:
    assert _check([1, 2, 3], 100) == ([1, 2, 3], 7)
    assert _check([1, 2, 3], 100, max_context=None) == ([1, 2, 3], 100)
    for bad in (0, True, 2.0, None):
        with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 1"):
            _check([1], bad)


def test_branches_trust_groups_salts_and_ids() -> None:
    assert _check([1], branches=4, max_running=4) == ([1], 4)
    with pytest.raises(AdmissionError, match=r"^n=5 sequences can never run at once here: at most 4 sequences"):
        _check([1], branches=5, max_running=4)
    with pytest.raises(AdmissionError, match=r"^beam width 5 sequences can never run"):
        _check([1], branches=5, max_running=4, beam=True)
    for kw, message in (({"trust_group": ""}, "trust_group must be a non-empty string"),
                        ({"cache_salt": ""}, "cache_salt must be a non-empty string or None"),
                        ({"request_id": "a/b"}, "request id must be a non-empty string without '/'")):
        with pytest.raises(ConfigError, match=message):
            _check([1], **kw)


@pytest.mark.parametrize(("changes", "message"), [
    ({"request_id": ""}, "a request id must be a non-empty string without '/', got ''"),
    ({"request_id": "a/b"}, "a request id must be a non-empty string without '/', got 'a/b'"),
    ({"request_id": 7}, "a request id must be a non-empty string without '/', got 7"),
    ({"n": 0}, "request 'r': n must be an integer >= 1, got 0"),
    ({"n": True}, "request 'r': n must be an integer >= 1, got True"),
    ({"max_new_tokens": 0}, "request 'r': max_new_tokens must be an integer >= 1, got 0"),
    ({"max_new_tokens": 2.0}, "request 'r': max_new_tokens must be an integer >= 1, got 2.0"),
    ({"lookahead": -1}, "request 'r': lookahead must be an integer >= 0, got -1"),
    ({"priority": 1.5}, "request 'r': priority must be an integer, got 1.5"),
    ({"priority": False}, "request 'r': priority must be an integer, got False"),
    ({"prompt": ()}, "request 'r' needs a non-empty prompt"),
    ({"arrival_s": "0"}, "request 'r': arrival_s must be a number, got '0'"),
    ({"arrival_s": float("nan")}, "request 'r': arrival_s must be a number, got nan"),
])
def test_a_bad_request_is_refused_with_its_exact_message(changes: dict, message: str) -> None:
    fields = {"request_id": "r", "prompt": (1, 2, 3), "max_new_tokens": 4, **changes}
    request = GenRequest(**fields)
    with pytest.raises(ConfigError) as err:
        validate_request(request)
    assert str(err.value) == message
    s = Scheduler(KVLedger(8, BS), SchedulerConfig())
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        s.add(request)
    assert not s.has_work()


def test_the_smallest_good_requests_pass_validation() -> None:
    validate_request(GenRequest("r", [5], 1, n=1, lookahead=0, priority=-3, arrival_s=0))
    validate_request(GenRequest("r", (5,), 1, arrival_s=2.5))
    with pytest.raises(ConfigError, match="^expected a GenRequest, got dict$"):
        validate_request({"request_id": "r"})  # type: ignore[arg-type]
