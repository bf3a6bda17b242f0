"""Text at the boundary: prompts to token ids (the chat template included), token ids back to text as
they stream, and stop strings.

The engine only knows token ids. Stop strings are found here, in the detokenised text: the text is cut
before the stop string, and the request is cancelled so its blocks go back at the next safe point.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError

# Tokenizer pieces that never drop or merge text, so a prompt of C characters is at least
# ceil(C / longest token) tokens. Anything else (a normaliser that strips or composes, a pre-tokenizer that
# drops whitespace, an unknown-token that swallows a word, a BPE without an unknown token or byte fallback,
# whose unknown characters vanish) leaves the bound unknown.
_KEEPS_TEXT_NORMALIZERS = {"Prepend", "NFD", "NFKD"}
_KEEPS_TEXT_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def _keeps_text(part: dict[str, Any] | None, kinds: set[str]) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        inner = part.get("normalizers", part.get("pretokenizers", []))
        return all(_keeps_text(p, kinds) for p in inner)
    if kind == "Replace":  # a fixed string by another at least as long (" " -> "\u2581")
        pattern = part.get("pattern", {})
        return "String" in pattern and len(part.get("content", "")) >= len(pattern["String"])
    if kind in ("Split", "Punctuation"):
        return part.get("behavior") != "Removed"
    return kind in kinds


def _byte_level(part: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer maps the text to byte symbols (GPT-2's ByteLevel, alone or in a Sequence)."""
    if part is None:
        return False
    if part.get("type") == "Sequence":
        return any(_byte_level(p) for p in part.get("pretokenizers", []))
    return part.get("type") == "ByteLevel"


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token can stand for, when the tokenizer provably never drops or merges
    text (see above); None when that is not known. A vocabulary entry's length bounds its text: a
    byte-level entry has one character per byte, a SentencePiece entry one per character (its byte
    fallbacks, ``<0xE3>``, six for one byte)."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        model = spec["model"]
        if model.get("type") != "BPE" or (model.get("unk_token") and model.get("fuse_unk")
                                          and not model.get("byte_fallback")):
            return None
        if not (model.get("unk_token") or model.get("byte_fallback") or _byte_level(spec.get("pre_tokenizer"))):
            return None  # a character outside the vocabulary is dropped without a token
        if not (_keeps_text(spec.get("normalizer"), _KEEPS_TEXT_NORMALIZERS)
                and _keeps_text(spec.get("pre_tokenizer"), _KEEPS_TEXT_PRE_TOKENIZERS)):
            return None
        return max(len(token) for token in tokenizer.get_vocab()) or None  # added tokens included
    except Exception:  # noqa: BLE001 -- a slow or unusual tokenizer: no bound, the body limit still holds
        return None


class TextCodec:
    """A Hugging Face tokenizer behind the few calls the server makes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.max_token_chars = longest_token_chars(tokenizer)
        self.eos_ids = frozenset(t for t in (tokenizer.eos_token_id,) if isinstance(t, int))
        end = None
        if getattr(tokenizer, "chat_template", None):
            # Chat models close a turn with their own token (ChatML's <|im_end|>); stop there too.
            for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
                tid = tokenizer.convert_tokens_to_ids(name)
                if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
                    end = tid
                    break
        self.turn_end_ids = frozenset(() if end is None else (end,)) | self.eos_ids

    @classmethod
    def from_pretrained(cls, path: str) -> TextCodec:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("the server needs the transformers package (for the model's tokenizer)") from None
        try:
            return cls(AutoTokenizer.from_pretrained(path))
        except Exception as exc:  # noqa: BLE001 -- any tokenizer failure is one clear line
            raise ConfigError(f"no usable tokenizer in {path}: {str(exc).splitlines()[0][:200]}") from None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text`` that costs nothing (0 when no bound is known): no
        token covers more than ``max_token_chars`` characters. A prompt this bound already puts past
        the model's length is refused without tokenizing it."""
        if self.max_token_chars is None:
            return 0
        return -(-len(text) // self.max_token_chars)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text).input_ids)

    def chat_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation through the model's chat template, as text (``encode_chat`` tokenizes it)."""
        if not self.has_chat_template:
            raise ConfigError("this model has no chat template: use /v1/completions")
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                tokenize=False)
        except Exception as exc:  # noqa: BLE001 -- a template error (e.g. role order) is the client's input
            raise ConfigError(f"the chat template refused these messages: {str(exc).splitlines()[0][:200]}") \
                from None

    def encode_chat(self, text: str) -> list[int]:
        # The template already wrote every special token it wants.
        return list(self.tok(text, add_special_tokens=False).input_ids)

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode_chat(self.chat_text(messages, add_generation_prompt))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """``/tokenize``'s ids (the special tokens the tokenizer adds only when asked)."""
        return list(self.tok(text, add_special_tokens=add_special_tokens).input_ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        """``/detokenize``'s text: every token written, special ones included (as vLLM's)."""
        return self.tok.decode(list(ids))

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.decode)

    def info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: the tokenizer's configuration (``tokenizer_config.json``'s keys, file
        paths left out), its class and chat template. lm-eval's ``remote`` tokenizer needs ``eos_token``
        here (then tokenizes through ``/tokenize``), so it is always present."""

        def plain(value: Any) -> Any:
            if hasattr(value, "content"):  # an AddedToken
                return value.content
            if isinstance(value, dict):
                return {str(k): plain(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [plain(v) for v in value]
            return value if value is None or isinstance(value, str | int | float | bool) else str(value)

        config = {k: plain(v) for k, v in (getattr(self.tok, "init_kwargs", None) or {}).items()
                  if not k.endswith("_file") and k != "name_or_path"}
        for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
            config.setdefault(name, getattr(self.tok, name, None))
        config["tokenizer_class"] = type(self.tok).__name__
        if self.has_chat_template:
            config["chat_template"] = self.tok.chat_template
        return config


class Detokenizer:
    """Incremental decoding: text is released once it is stable. A byte-level BPE token can end in the
    middle of a UTF-8 character ("\\ufffd" until the next token completes it), and SentencePiece drops
    a word's leading space when a token is decoded alone, so each step decodes a short window of
    already-emitted tokens plus the new ones and emits only the difference."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text was emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character stays as the replacement mark)."""
        if self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):]


class StopMatcher:
    """Finds stop strings in streamed text. Text that could still become the start of a stop string is
    held back until it cannot (or the stream ends), so no stop string is ever partly emitted."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """New text in; the part that is safe to emit out. Sets ``stopped`` on a match (the returned
        text then ends right before the stop string)."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        keep = min(self._hold, len(buf))
        # Hold back only a suffix that is a proper prefix of some stop string.
        while keep and not any(s.startswith(buf[len(buf) - keep:]) for s in self.stops):
            keep -= 1
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep] if keep else buf

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


__all__ = ["Detokenizer", "StopMatcher", "TextCodec", "longest_token_chars"]
