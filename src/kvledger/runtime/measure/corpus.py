"""Prompt text for trace replay: the bundled public-domain corpus, tokenised with the model's tokenizer.

A trace gives lengths and, for Mooncake traces, prefix structure (``hash_ids``: equal ids at position
``i`` mean equal prompts up to and including block ``i``); it gives no text. :class:`PromptSynth`
builds real token sequences with exactly that structure: the corpus is tokenised once, and every
source block of a prompt (512 trace tokens for Mooncake) becomes a slice of ``chunk_tokens`` corpus
tokens chosen by hashing the block's id. Equal block ids give equal slices, so equal hash-id prefixes
give equal token prefixes (which the prefix cache then shares), and nothing else is shared except by
coincidence. Slices are cut from the token array, never re-tokenised, so a shared prefix can not be
changed by how a tokenizer merges text across a slice boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ...errors import ConfigError

CORPUS_DIR = Path(__file__).resolve().parents[2] / "data" / "corpus"
_MASK64 = (1 << 64) - 1


def corpus_text() -> str:
    """Every bundled ``*.txt`` file, in name order, separated by blank lines."""
    files = sorted(CORPUS_DIR.glob("*.txt"))
    if not files:
        raise ConfigError(f"no corpus text in {CORPUS_DIR} (the package data is missing)")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


_CACHE: dict[str, tuple[int, ...]] = {}


def corpus_tokens(encode: Callable[[str], Sequence[int]], key: str | None = None) -> tuple[int, ...]:
    """The corpus as token ids; ``encode`` is the tokenizer (``text -> ids``, no special tokens).
    ``key`` names the tokenizer for caching (e.g. its folder)."""
    if key is None:
        return tuple(encode(corpus_text()))
    if key not in _CACHE:
        _CACHE[key] = tuple(encode(corpus_text()))
    return _CACHE[key]


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class PromptSynth:
    """Token prompts with a trace's prefix structure, cut from corpus tokens."""

    def __init__(self, tokens: Sequence[int], chunk_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if len(tokens) <= chunk_tokens:
            raise ConfigError(f"the corpus has {len(tokens)} tokens, too few for slices of {chunk_tokens}")
        self.tokens = list(tokens)
        self.chunk_tokens = chunk_tokens

    def chunk(self, key: int) -> list[int]:
        """The ``chunk_tokens`` corpus tokens of source block ``key`` (a pure function of the key)."""
        offset = _mix(key & _MASK64) % (len(self.tokens) - self.chunk_tokens + 1)
        return self.tokens[offset : offset + self.chunk_tokens]

    def prompt(self, block_keys: Sequence[int], length: int) -> list[int]:
        """``length`` tokens: the chunks of ``block_keys`` in order (the last key repeated if more
        are needed), cut to ``length``."""
        if length < 1 or not block_keys:
            raise ConfigError("a prompt needs a length >= 1 and at least one block key")
        out: list[int] = []
        i = 0
        while len(out) < length:
            out.extend(self.chunk(block_keys[min(i, len(block_keys) - 1)]))
            i += 1
        return out[:length]


def block_keys(prompt_tokens: Sequence[int], source_block: int) -> list[int]:
    """The identity of each ``source_block``-token block of a trace prompt: its first synthetic token
    id. For Mooncake traces (loaded with ``block_tokens == source_block``) that is ``hash_id *
    source_block``, so it is equal exactly when the hash ids are; other loaders give every prompt
    fresh ids, hence fresh keys."""
    n = len(prompt_tokens)
    return [int(prompt_tokens[i]) for i in range(0, n, source_block)]


__all__ = ["CORPUS_DIR", "PromptSynth", "block_keys", "corpus_text", "corpus_tokens"]
