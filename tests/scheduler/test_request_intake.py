"""The one check of a request's shape (``scheduler.intake.check_request_shape``), which the engine and the
fleet's ingress both run, so the ingress refuses exactly what a replica would, in the same words."""

from __future__ import annotations

import pytest

from kvledger.errors import AdmissionError, ConfigError
from kvledger.scheduler.intake import check_request_shape


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
