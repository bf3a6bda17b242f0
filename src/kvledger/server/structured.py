"""``response_format`` ``json_object`` / ``json_schema``: a JSON grammar (llguidance, from PyPI) that masks
the logits inside the engine's sampler.

A request's :class:`JsonConstraint` is compiled on the request side (a bad schema is the client's 400
before anything runs) and rides in its ``SamplingParams.constraint``; the sampler calls
:meth:`JsonConstraint.restrict` for each of its rows. The grammar state of each branch is advanced only
over the branch's *confirmed* output, read from the row at each sampling: a step that failed and ran
again, a preemption that recomputed the sequence, or ``n`` branches never put a matcher out of step with
the tokens it has seen (a branch whose output is not an extension of what its matcher consumed starts a
fresh one). The grammar ends with the request's end-of-turn tokens: once the JSON is complete only they
are allowed. JSON is written without optional whitespace (llguidance's ``whitespace_flexible`` off), so a
small model cannot pad an answer with blank lines until ``max_tokens``; an answer cut by ``max_tokens``
is incomplete JSON with ``finish_reason: "length"``, as with vLLM.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .protocol import BadRequestBody


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class GrammarTokenizer:
    """The model's tokenizer as llguidance reads it (built once per server, on first use: ~0.4 s)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, end_ids: frozenset[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.end_ids = sorted(end_ids)
        self._built: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._built is None:
                import llguidance.hf

                self._built = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                           eos_token=self.end_ids or None)
            return self._built


def json_schema_of(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for (``json_object``: any object), None for text;
    :class:`BadRequestBody` naming ``response_format`` for anything malformed."""
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise BadRequestBody("response_format.json_schema must be an object with a schema", "response_format")
        schema = spec.get("schema", {})
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise BadRequestBody("response_format.json_schema.schema must be a JSON schema (an object)",
                                 "response_format")
        return schema
    raise BadRequestBody(f"response_format type must be text, json_object or json_schema, got {str(kind)[:40]!r}",
                         "response_format")


class JsonConstraint:
    """One request's JSON grammar: a matcher per branch, advanced over the branch's confirmed output."""

    def __init__(self, tokenizer: GrammarTokenizer, schema: dict[str, Any]) -> None:
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except Exception as exc:  # noqa: BLE001 -- a schema llguidance cannot read is the client's input
            raise BadRequestBody(f"response_format: the JSON schema is not usable: {_line(exc)}",
                                 "response_format") from None
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem:
            raise BadRequestBody(f"response_format: the JSON schema is not usable: {_line(problem)}",
                                 "response_format")
        self.schema = schema  # what a process backend sends its engine, which compiles it again
        self.end_ids = tuple(tokenizer.end_ids)
        self._tok = tokenizer.get()
        self._vocab = tokenizer.vocab_size
        self._prototype = llguidance.LLMatcher(self._tok, grammar)
        if self._prototype.is_error():
            raise BadRequestBody(f"response_format: the JSON schema is not usable: "
                                 f"{_line(self._prototype.get_error())}", "response_format")
        self._branches: dict[int, tuple[Any, list[int]]] = {}
        self._mask: torch.Tensor | None = None

    def _matcher(self, branch: int, output: list[int]) -> Any:
        got = self._branches.get(branch)
        if got is not None:
            matcher, seen = got
            if len(output) >= len(seen) and output[:len(seen)] == seen:
                fresh = output[len(seen):]
                if fresh:
                    matcher.consume_tokens(fresh)
                    seen.extend(fresh)
                return matcher
        matcher = self._prototype.deep_copy()
        if output:
            matcher.consume_tokens(list(output))
        self._branches[branch] = (matcher, list(output))
        return matcher

    def restrict(self, logits: torch.Tensor, branch: int, output: Any) -> None:
        """Mask (in place, to -inf) the tokens the grammar forbids after ``output`` on ``branch``."""
        import llguidance.torch as lt

        matcher = self._matcher(branch, list(output))
        if matcher.is_error():
            return  # the output already left the grammar (nothing to mask towards): leave the row alone
        if self._mask is None:
            self._mask = lt.allocate_token_bitmask(1, self._vocab)
        lt.fill_next_token_bitmask(matcher, self._mask)
        lt.apply_token_bitmask_inplace(logits, self._mask.to(logits.device))

    def __deepcopy__(self, memo: dict[int, Any]) -> JsonConstraint:
        return self  # SamplingParams copies (dataclasses.asdict) share the request's one constraint

    def __repr__(self) -> str:
        return f"JsonConstraint(branches={len(self._branches)})"


def _line(problem: Any) -> str:
    return str(problem).strip().splitlines()[0][:300] if str(problem).strip() else "unknown error"


__all__ = ["GrammarTokenizer", "JsonConstraint", "available", "json_schema_of"]

