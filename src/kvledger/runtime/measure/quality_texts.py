"""The quality contract's texts and held-out prompts: what :mod:`kvledger.runtime.measure.quality` scores.

Texts of three kinds, each with its origin and hash (:func:`quality_texts`): the bundled public-domain corpus
(prose), a module of Python's own standard library (code), and Debian's package FAQs turned into a conversation
with the model's chat template (chat). Held-out prompts (:func:`load_held_out`): a bundled slice of the peer
runtime's chat prompts, or a JSON file the user gives, bounded in bytes, prompts and tokens before anything runs.
Kept apart from the measurement so a caller that only needs the texts (the CLI's choices, a benchmark's tuning
screen) does not load the runner.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .corpus import CORPUS_DIR, corpus_text

KINDS = ("prose", "code", "chat")
CODE_MODULE = "argparse.py"  # a long, stable module every CPython ships
FAQ_FILES = ("/usr/share/doc/base-files/FAQ", "/usr/share/doc/man-db/FAQ", "/usr/share/doc/ncurses-base/FAQ")
HELD_OUT_FILE = Path(__file__).resolve().parents[2] / "data" / "quality" / "held_out" / "peer_chat.json"
DEFAULT_HELD_OUT = 4  # of the bundled slice, for a bounded default run: 4 took 131 s, all 8 took 368 s
MAX_HELD_OUT = 64  # prompts in a held-out file
MAX_HELD_OUT_TOKENS = 8192  # tokens in one held-out prompt
MAX_HELD_OUT_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class TextSource:
    kind: str
    text: str
    origin: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


# ---- texts --------------------------------------------------------------------------------------------
def _code_text() -> TextSource:
    path = Path(sysconfig.get_paths()["stdlib"]) / CODE_MODULE
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"the code text {path} (Python's standard library) is unreadable: {exc}") from None
    return TextSource("code", text, f"Python standard library {path}")


def _faq_pairs(path: Path) -> list[tuple[str, str]]:
    """Question/answer pairs of a Debian FAQ: 'Q.'/'A.' paragraphs, underlined headings, or entries
    between rows of asterisks."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    pairs: list[tuple[str, str]] = []
    if any(line.startswith("Q. ") for line in lines):
        questions: list[str] = []
        answer: list[str] = []
        for para in [p.strip() for p in text.split("\n\n")] + ["Q. "]:
            if para.startswith("Q. "):
                if answer:
                    pairs.append((" ".join(questions), "\n\n".join(answer)))
                    questions, answer = [], []
                if para[3:].strip():
                    questions.append(" ".join(para[3:].split()))
            elif para.startswith("A. "):
                answer = [para[3:].strip()]
            elif answer and para and not para.startswith("* "):
                answer.append(para)
        return [(q, a) for q, a in pairs if q and a]
    if "********" in text:
        for chunk in text.split("********")[1:]:
            paras = [p.strip() for p in chunk.strip().split("\n\n") if p.strip()]
            if len(paras) >= 2:
                pairs.append((" ".join(paras[0].split()), "\n\n".join(paras[1:])))
        return pairs
    heading, body = None, []
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if nxt.startswith("===") and line.strip():
            if heading and body:
                pairs.append((heading, "\n".join(body).strip()))
            heading, body = line.strip(), []
        elif heading and not line.startswith("==="):
            body.append(line)
    if heading and body:
        pairs.append((heading, "\n".join(body).strip()))
    return pairs


def _chat_text(apply_template: Callable[[list[dict[str, str]]], str] | None) -> TextSource:
    pairs: list[tuple[str, str]] = []
    used = []
    for name in FAQ_FILES:
        p = Path(name)
        if p.is_file():
            got = _faq_pairs(p)
            if got:
                pairs += got
                used.append(name)
    if not pairs:
        raise ConfigError(f"no chat text: none of {', '.join(FAQ_FILES)} (Debian's package FAQs) is readable here")
    messages = [{"role": "system", "content": "You are a helpful assistant who answers questions about a "
                 "Debian system."}]
    for question, answer in pairs:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if apply_template is None:
        text = "\n".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>" for m in messages)
    else:
        text = apply_template(messages)
    return TextSource("chat", text, "Debian package FAQs (" + ", ".join(used) + ") as user/assistant turns in the "
                      "model's chat template")


def quality_texts(tokenizer: Any = None, kinds: Sequence[str] = KINDS) -> list[TextSource]:
    """The texts of each kind, with where they come from."""
    out = []
    for kind in kinds:
        if kind == "prose":
            origin = f"kvledger's bundled public-domain corpus (kvledger/data/{CORPUS_DIR.name}/)"
            out.append(TextSource("prose", corpus_text(), origin))
        elif kind == "code":
            out.append(_code_text())
        elif kind == "chat":
            template = None
            if tokenizer is not None and getattr(tokenizer, "chat_template", None):
                def template(msgs: list[dict[str, str]]) -> str:
                    return tokenizer.apply_chat_template(msgs, tokenize=False)
            out.append(_chat_text(template))
        else:
            raise ConfigError(f"unknown text kind {kind!r} (known: {', '.join(KINDS)})")
    return out


# ---- held-out prompts ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HeldOutPrompt:
    """One held-out prompt: token ids (used as given) or a text (tokenised as is, no chat template added)."""

    name: str
    text: str | None = None
    ids: tuple[int, ...] | None = None


def load_held_out(path: str | Path | None = None) -> tuple[list[HeldOutPrompt], str]:
    """The prompts of a held-out file and where they come from; without ``path`` the bundled slice of the
    peer chat prompts. A file is a JSON list whose items are texts, lists of token ids, or objects with
    ``text`` or ``ids`` (optionally inside ``{"prompts": [...]}``); anything else is one ConfigError line.
    The bundled default is cut to its first :data:`DEFAULT_HELD_OUT` prompts (two with the peers' shared
    system header, two without) to keep a default run's time bounded."""
    p = HELD_OUT_FILE if path is None else Path(path)
    what = f"--held-out file {p}"
    try:
        if p.stat().st_size > MAX_HELD_OUT_BYTES:
            raise ConfigError(f"{what} is larger than {MAX_HELD_OUT_BYTES // 2**20} MiB")
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read {what}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{what} is not valid JSON: {str(exc)[:120]}") from None
    items = data.get("prompts") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{what} must hold a non-empty JSON list of prompts (texts or lists of token ids)")
    if len(items) > MAX_HELD_OUT:
        raise ConfigError(f"{what} has {len(items)} prompts; at most {MAX_HELD_OUT}")
    out = []
    for i, item in enumerate(items):
        name = str(i)
        if isinstance(item, dict):
            if "peer_index" in item:
                name = f"{i} (peer {item['peer_index']})"
            item = item.get("ids", item.get("text"))
        if isinstance(item, str) and item.strip():
            out.append(HeldOutPrompt(name, text=item))
        elif (isinstance(item, list) and len(item) >= 2 and len(item) <= MAX_HELD_OUT_TOKENS
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in item)):
            out.append(HeldOutPrompt(name, ids=tuple(item)))
        else:
            raise ConfigError(f"{what}: prompt {i} is neither a non-empty text nor a list of 2 to "
                              f"{MAX_HELD_OUT_TOKENS} token ids (non-negative integers)")
    if path is None:
        out = out[:DEFAULT_HELD_OUT]
    origin = (f"kvledger's bundled slice of the peer chat prompts (kvledger/data/quality/held_out/{p.name}, "
              f"the first {len(out)})" if path is None else str(p))
    return out, origin


__all__ = ["DEFAULT_HELD_OUT", "HELD_OUT_FILE", "KINDS", "MAX_HELD_OUT_TOKENS", "HeldOutPrompt", "TextSource",
           "load_held_out", "quality_texts"]
