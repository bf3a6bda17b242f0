"""What a client is billed: ``usage`` counts exactly the tokens generated for the choices it got back.

The expected counts never come from the server's own ``usage``. A free run with ``ignore_eos`` generates
exactly ``max_tokens`` tokens per choice; the model's tokenizer proposes where its text splits into tokens,
and shorter runs of the same seeded request (sampling depends only on seed, branch and position, so the
first j tokens of any run are the same) confirm from the returned *text* alone after how many tokens a
stop string is complete. Each stop string spans two tokens, so the text before it ends inside a token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
FREE_TOKENS = 12  # tokens per choice in the free run (ignore_eos: exactly this many)
N = 2
PROMPT = "Write a short list of fruits and colors:"


@dataclass(frozen=True)
class Split:
    """A stop string inside one choice's free-run text that spans tokens ``k`` and ``k + 1``."""

    stop: str
    billed: int  # tokens that choice generates up to and including the one that completes ``stop``
    kept: str  # the text before the stop string: what the choice returns


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    seed: int
    texts: list[str]  # the free run, one text per choice, FREE_TOKENS tokens each
    splits: list[Split]  # one per choice; choice i's stop string never occurs in another choice's text


def _post(server, body: dict) -> dict:  # noqa: ANN001
    resp = httpx.post(f"{server.v1}/completions", json={"model": MODEL, **body}, timeout=300, trust_env=False,
                      headers={"Authorization": f"Bearer {server.keys['acme']}"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _texts(server, case_prompt: list[int], seed: int, max_tokens: int) -> list[str]:  # noqa: ANN001
    out = _post(server, {"prompt": case_prompt, "max_tokens": max_tokens, "n": N, "seed": seed,
                         "temperature": 0.8, "ignore_eos": True})
    assert [c["finish_reason"] for c in out["choices"]] == ["length"] * N
    return [c["text"] for c in out["choices"]]


def _candidate(tok, text: str, others: list[str]) -> tuple[str, int, int] | None:  # noqa: ANN001
    """(stop, k, start): a stop string made of the end of token k and the start of token k + 1 of
    ``text``, found first at ``start`` and in no other choice; None when ``text`` does not re-tokenize
    into FREE_TOKENS tokens that decode back to it."""
    ids = tok.encode(text, add_special_tokens=False).ids
    if len(ids) != FREE_TOKENS or tok.decode(ids) != text:
        return None
    for k in range(2, FREE_TOKENS - 3):  # some text before it; complete at k + 2 tokens, before the end
        head, tail = tok.decode([ids[k]]), tok.decode([ids[k + 1]])
        stop = head[-2:] + tail[:2]
        start = len(tok.decode(ids[:k + 1])) - len(head[-2:])
        if (not head.strip() or not tail.strip() or not stop.isascii() or not stop.isprintable()
                or text.find(stop) != start or any(stop in o for o in others)):
            continue
        return stop, k, start
    return None


@pytest.fixture(scope="module")
def case(server) -> Case:  # noqa: ANN001
    from tokenizers import Tokenizer

    from kvledger.runtime.engine import resolve_model

    tok = Tokenizer.from_file(str(Path(resolve_model(MODEL).path) / "tokenizer.json"))
    prompt = tok.encode(PROMPT, add_special_tokens=False).ids
    for seed in range(16):  # the first seed whose two choices each have a stop string to split
        texts = _texts(server, prompt, seed, FREE_TOKENS)
        found = [_candidate(tok, t, texts[:i] + texts[i + 1:]) for i, t in enumerate(texts)]
        if any(f is None for f in found):
            continue
        splits = []
        for i, (stop, k, start) in enumerate(found):
            # Confirmed from the server's text alone: k + 1 tokens end inside the stop string, and the
            # stop string is complete at k + 2 tokens.
            before = _texts(server, prompt, seed, k + 1)[i]
            at = _texts(server, prompt, seed, k + 2)[i]
            assert texts[i].startswith(before) and texts[i].startswith(at)
            assert stop not in before and start < len(before) < start + len(stop) <= len(at), (before, at, stop)
            splits.append(Split(stop, k + 2, texts[i][:start]))
        return Case(prompt, seed, texts, splits)
    raise AssertionError("no seed in 0..15 gave two choices with a stop string to split across tokens")


def _request(case: Case, stops: list[str], prompts: int = 1) -> dict:
    prompt = case.prompt if prompts == 1 else [case.prompt] * prompts
    return {"prompt": prompt, "max_tokens": FREE_TOKENS, "n": N, "seed": case.seed, "temperature": 0.8,
            "ignore_eos": True, "stop": stops}


def _streamed(server, body: dict) -> tuple[dict[int, str], dict[int, str], dict]:  # noqa: ANN001
    """(texts, finish reasons, usage) of a streamed completion with include_usage."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    events = []
    with httpx.stream("POST", f"{server.v1}/completions", timeout=300, trust_env=False,
                      json={"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}},
                      headers={"Authorization": f"Bearer {server.keys['acme']}"}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    for raw in events[:-1]:
        chunk = json.loads(raw)
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                assert c["index"] not in reasons, "a choice finished twice"
                reasons[c["index"]] = c["finish_reason"]
        if chunk["choices"]:
            assert chunk["usage"] is None
        else:
            assert usage is None, "two usage chunks"
            usage = chunk["usage"]
    assert usage is not None and json.loads(events[-2])["choices"] == []  # the usage chunk is the last
    return texts, reasons, usage


def _outcome(server, body: dict, stream: bool) -> tuple[list[str], list[str], dict]:  # noqa: ANN001
    if stream:
        texts, reasons, usage = _streamed(server, body)
        assert sorted(texts) == sorted(reasons) == list(range(len(reasons)))
        return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)], usage
    out = _post(server, body)
    assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
    return [c["text"] for c in out["choices"]], [c["finish_reason"] for c in out["choices"]], out["usage"]


def _check_usage(usage: dict, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage["completion_tokens"] == completion_tokens, usage
    assert usage["prompt_tokens"] == prompt_tokens, usage  # the prompt once per prompt, whatever n
    assert usage["total_tokens"] == prompt_tokens + completion_tokens, usage


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_sibling_outlives_a_choice_stopped_inside_a_token(server, case: Case, stream: bool) -> None:
    """Choice 0 meets a stop string that spans two tokens; choice 1 runs to its length. Billed: choice 0's
    tokens up to the one completing the stop string, plus all of choice 1's. A second stop string that
    choice 1's last characters begin (and nothing completes) holds that text back until the end: it is
    still returned, and billed once."""
    split = case.splits[0]
    held = case.texts[1][-3:] + "\u00a7\u00a7"
    texts, reasons, usage = _outcome(server, _request(case, [split.stop, held]), stream)
    assert texts == [split.kept, case.texts[1]]
    assert reasons == ["stop", "length"]
    _check_usage(usage, len(case.prompt), split.billed + FREE_TOKENS)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_every_choice_stopped_bills_only_up_to_each_stop(server, case: Case, stream: bool) -> None:
    """Both choices stop (then the engine request is cancelled): whatever the engine generated past the
    stop strings before the cancellation landed is not billed."""
    texts, reasons, usage = _outcome(server, _request(case, [s.stop for s in case.splits]), stream)
    assert texts == [s.kept for s in case.splits]
    assert reasons == ["stop", "stop"]
    _check_usage(usage, len(case.prompt), sum(s.billed for s in case.splits))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_batch_of_prompts_bills_every_choice_of_every_prompt(server, case: Case, stream: bool) -> None:
    """Two prompts x n=2: choice = prompt * n + branch; each prompt's choices are billed on their own."""
    split = case.splits[0]
    texts, reasons, usage = _outcome(server, _request(case, [split.stop], prompts=2), stream)
    assert texts == [split.kept, case.texts[1]] * 2
    assert reasons == ["stop", "length"] * 2
    _check_usage(usage, 2 * len(case.prompt), 2 * (split.billed + FREE_TOKENS))
