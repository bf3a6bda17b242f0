"""The OpenAI wire format: request bodies (read, validated, bounded) and response/chunk builders.

Fields we do not implement are refused with a clear 400 when set to anything but their default, so a
client never silently gets something other than what it asked for. Unknown fields are ignored, as the
OpenAI API and vLLM do.

A body is bytes until :func:`read_request` has made it a request: every way a body can be malformed --
not JSON, not UTF-8, nested past the parser's depth, an integer past CPython's digit bound, a string
with a lone UTF-16 surrogate, a field of the wrong type -- is one :class:`BadRequestBody` (a 400), so
no route ever meets a half-read body.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_N = 16  # samples per prompt
MAX_PROMPTS = 32  # prompts in one /v1/completions batch
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 256
# The default bound on a request body: a generous BODY_BYTES_PER_TOKEN per token of the model's length
# (English text is ~4 bytes a token, a token id ~7 with its separator, \uXXXX-escaped text ~12) plus
# BODY_OVERHEAD_BYTES for the rest of the JSON (fields, chat messages, stop strings).
BODY_BYTES_PER_TOKEN = 64
BODY_OVERHEAD_BYTES = 2**20
MAX_TOKENS_FIELD = 2**63 - 1  # max_tokens past any model's length still gets the length message, in figures
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top_logprobs (chat) and logprobs (completions) up to this
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (each is work in every step of the request)


def default_max_body_bytes(max_model_len: int) -> int:
    """The largest request body accepted by default: ample for a prompt of the model's whole length."""
    return max_model_len * BODY_BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES


class BadRequestBody(ValueError):
    """The body is not a request this server can read: one line for the client (400), and the
    offending field when one is known (the error body's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Refusal(NamedTuple):
    """A field set to something this server does not do (or not in this combination): a 400."""

    message: str
    param: str | None = None


# A JSON escape of a surrogate code unit: only a body with one can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")  # after decoding, a paired escape is one astral character


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or :class:`BadRequestBody`. Strings must be valid Unicode: a lone surrogate
    (``"\\ud800"``) decodes in Python but can reach neither the tokenizer nor a UTF-8 response."""
    try:
        text = raw.decode(json.detect_encoding(raw))
        value = json.loads(text)
    except RecursionError:
        raise BadRequestBody("the body is not valid JSON: it nests arrays or objects too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequestBody("the body is not valid JSON") from None
    except ValueError:  # CPython's bound on the digits of an integer (sys.get_int_max_str_digits)
        raise BadRequestBody("the body is not valid JSON here: it has an integer with too many digits") from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise BadRequestBody("the body has a string with a lone UTF-16 surrogate (\\ud800-\\udfff without its "
                             "pair): not valid Unicode")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]  # iterative: the document may nest as deep as the parser allowed
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: int | None = None  # vLLM's extension; 0 or -1 = off
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # vLLM's extension
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None  # vLLM's extension
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_FIELD)] = 0  # vLLM's extension
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None  # token id -> bias
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=2**63)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # vLLM's extension
    # json_object / json_schema (server/structured.py); on completions too, as vLLM accepts it there
    response_format: dict[str, Any] | None = None
    # Accepted only at their defaults (anything else is a 400 naming the field).
    best_of: int | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("top_k must be -1 or 0 (off) or a positive integer")
        return value

    def unsupported(self) -> Refusal | None:
        """The first field set to something this server does not implement (or a combination it
        refuses), as a message naming the field."""
        if self.best_of not in (None, 1) and self.best_of != self.n:
            return Refusal("best_of is not supported", "best_of")
        limit = self.limit()
        if limit is not None and self.min_tokens > limit:
            return Refusal(f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({limit})",
                           "min_tokens")
        return None

    def limit(self) -> int | None:
        return None

    def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; :class:`BadRequestBody` for a key that is not a token
        id of this model."""
        out = []
        for key, value in (self.logit_bias or {}).items():
            token = int(key) if key.isascii() and key.isdigit() and len(key) < 19 else -1
            if not 0 <= token < vocab_size:
                raise BadRequestBody(f"logit_bias: {key[:32]!r} is not a token id in [0, {vocab_size})", "logit_bias")
            out.append((token, float(value)))
        return tuple(out)

    def stop_ids(self, vocab_size: int) -> list[int]:
        ids = list(self.stop_token_ids or [])
        if any(t >= vocab_size for t in ids):
            raise BadRequestBody(f"stop_token_ids must be token ids in [0, {vocab_size})", "stop_token_ids")
        return ids


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_FIELD)] | None = 16  # the OpenAI default for completions
    echo: bool = False
    suffix: str | None = None
    # Log-probabilities of each token and of this many alternatives (vLLM allows up to its max_logprobs).
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS, strict=True)] | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        return None if value is False else value  # ``false`` is how some clients say "none"

    def limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt batch: text or token ids, one entry per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def unsupported(self) -> Refusal | None:
        if self.suffix:
            return Refusal("suffix is not supported", "suffix")
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_FIELD)] | None = None  # None: up to the model's length
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_FIELD)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True  # vLLM's extension
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS, strict=True)] | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> Refusal | None:
        if self.tools:
            return Refusal("tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            return Refusal("tool_choice is not supported", "tool_choice")
        if self.top_logprobs and not self.logprobs:
            return Refusal("when using `top_logprobs`, `logprobs` must be set to true", "top_logprobs")
        return super().unsupported()


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt`` (``add_special_tokens`` default true) or chat ``messages``
    through the template (``add_special_tokens`` default false, ``add_generation_prompt`` default true)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=2**63)]]


def read_body_as(raw: bytes, kind: type[BaseModel]) -> Any:
    """A body parsed and validated as ``kind``; :class:`BadRequestBody` (with its field) otherwise."""
    value = parse_json(raw)
    try:
        return kind.model_validate(value)
    except ValidationError as exc:
        raise BadRequestBody(validation_message(exc), validation_param(exc)) from None


def validation_message(exc: ValidationError) -> str:
    """One line naming the first offending field."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def validation_param(exc: ValidationError) -> str | None:
    """The top-level field of the first error (OpenAI's ``param``), if there is one."""
    loc = [p for p in exc.errors()[0].get("loc", ()) if p != "body"]
    return str(loc[0]) if loc and isinstance(loc[0], str) else None


def read_request(raw: bytes, chat: bool) -> CompletionRequest | ChatCompletionRequest:
    """A request body, parsed and validated; :class:`BadRequestBody` for anything else."""
    value = parse_json(raw)
    try:
        return (ChatCompletionRequest if chat else CompletionRequest).model_validate(value)
    except ValidationError as exc:
        raise BadRequestBody(validation_message(exc), validation_param(exc)) from None


# ---- responses ----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class LogprobFormat:
    """Token log-probabilities as OpenAI and vLLM write them: ``chat`` -> ``{"content": [{token,
    logprob, bytes, top_logprobs}]}``, completions -> ``{tokens, token_logprobs, top_logprobs, text_offset}``
    (each top dict holds the token itself and ``k`` alternatives, as vLLM's). A token's text is its own
    decoding; logprobs below -9999 (a masked token's -inf) are written as -9999.0, as OpenAI and vLLM do.
    Entries are ``(token id, TokenLogprobs or None)``: None for the first prompt token, which nothing scores."""

    def __init__(self, chat: bool, k: int, decode: Any) -> None:
        self.chat = chat
        self.k = k
        self._decode = decode
        self._texts: dict[int, str] = {}

    def text(self, token: int) -> str:
        got = self._texts.get(token)
        if got is None:
            got = self._texts[token] = self._decode([token])
        return got

    def chat_entries(self, entries: list[tuple[int, Any]]) -> dict[str, Any]:
        content = []
        for token, lp in entries:
            t = self.text(token)
            top = [] if lp is None else [{"token": self.text(a), "logprob": max(v, -9999.0),
                                          "bytes": list(self.text(a).encode("utf-8"))} for a, v in lp.top[:self.k]]
            content.append({"token": t, "logprob": -9999.0 if lp is None else max(lp.logprob, -9999.0),
                            "bytes": list(t.encode("utf-8")), "top_logprobs": top})
        return {"content": content}

    def completion_entries(self, entries: list[tuple[int, Any]], offset: int) -> tuple[dict[str, Any], int]:
        """The completions object for ``entries`` whose text starts at ``offset``; and the offset after."""
        tokens, values, tops, offsets = [], [], [], []
        for token, lp in entries:
            t = self.text(token)
            tokens.append(t)
            offsets.append(offset)
            offset += len(t)
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(max(lp.logprob, -9999.0))
            top: dict[str, float] = {}
            ids: list[int] = []
            for a, v in ((lp.token, lp.logprob), *lp.top):
                if a not in ids and len(ids) <= self.k:
                    ids.append(a)
                    top[self.text(a)] = max(v, -9999.0)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


class ResponseShape:
    """Builds the bodies and chunks of one response (completions or chat)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, texts: list[str], reasons: list[str | None], usage: dict[str, Any],
             logprobs: list[Any] | None = None) -> dict[str, Any]:
        """The whole response; ``logprobs``: each choice's logprobs object (see :class:`LogprobFormat`)."""
        lps = logprobs or [None] * len(texts)
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp,
                        "finish_reason": r} for i, (t, r, lp) in enumerate(zip(texts, reasons, lps, strict=True))]
            return {**self._head("chat.completion"), "choices": choices, "usage": usage}
        choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                   for i, (t, r, lp) in enumerate(zip(texts, reasons, lps, strict=True))]
        return {**self._head("text_completion"), "choices": choices, "usage": usage}

    def chunk(self, index: int, text: str | None, reason: str | None, *, role: bool = False,
              with_usage: bool = False, logprobs: Any = None) -> dict[str, Any]:
        """One choice's delta. ``text`` None with ``reason`` set is the choice's closing chunk."""
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}


__all__ = ["MAX_LOGPROBS", "MAX_N", "MAX_PROMPTS", "BadRequestBody", "ChatCompletionRequest", "ChatMessage",
           "CompletionRequest", "DetokenizeRequest", "LogprobFormat", "Refusal", "ResponseShape", "TokenizeRequest",
           "default_max_body_bytes", "error_body", "new_id", "parse_json", "read_body_as", "read_request",
           "usage_body", "validation_message"]
