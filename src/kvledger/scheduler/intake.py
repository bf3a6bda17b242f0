"""What a request must be before any ledger is asked about it: the one check of its shape, shared by the
engine and the fleet's ingress (which answers "never" without asking a replica).

:func:`check_request_shape` refuses, with one typed error each: a prompt that is not a non-empty
sequence of integer token ids below the vocabulary size, an output allowance that is not an integer
>= 1, a prompt the model's context cannot hold, more branches than run at once, a malformed trust group or
cache salt. It cuts the allowance to what the context leaves. Whether the request can ever fit the pool
or its trust group's quota is the ledger's question (``KVLedger.can_admit``, ``declared_blocks``), asked
after this one.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from ..errors import AdmissionError, ConfigError


def check_request_shape(
    prompt: Sequence[int], max_new_tokens: int, *, vocab_size: int, max_context: int | None, branches: int = 1,
    max_running: int | None = None, beam: bool = False, trust_group: str = "default",
    cache_salt: str | None = None, request_id: str = "check",
) -> tuple[list[int], int]:
    """``(token ids, max_new_tokens cut to the context)``, or :class:`ConfigError` for malformed input and
    :class:`AdmissionError` for a request the model's context or the scheduler's ``max_running`` can never
    hold (``branches``: ``n`` or, with ``beam``, the beam width)."""
    if isinstance(prompt, (str, bytes)):
        raise ConfigError("the prompt must be a sequence of integer token ids (tokenize text first)")
    try:
        ids = [operator.index(t) for t in prompt]
    except TypeError:
        raise ConfigError("the prompt must be a sequence of integer token ids (tokenize text first)") from None
    if not ids:
        raise ConfigError("the prompt is empty")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ConfigError(f"prompt token ids must be in [0, {vocab_size})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(request_id, str) or not request_id or "/" in request_id:
        raise ConfigError(f"request id must be a non-empty string without '/', got {request_id!r}")
    if max_context is not None:
        if len(ids) >= max_context:
            raise AdmissionError(f"the prompt has {len(ids)} tokens but the model's context is {max_context} "
                                 "tokens: it does not fit")
        max_new_tokens = min(max_new_tokens, max_context - len(ids))
    if max_running is not None and branches > max_running:
        what = f"beam width {branches}" if beam else f"n={branches}"
        raise AdmissionError(f"{what} sequences can never run at once here: at most {max_running} sequences "
                             "run at a time")
    if cache_salt is not None and (type(cache_salt) is not str or not cache_salt):
        raise ConfigError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
    if type(trust_group) is not str or not trust_group:
        raise ConfigError(f"trust_group must be a non-empty string, got {trust_group!r}")
    return ids, max_new_tokens


__all__ = ["check_request_shape"]
