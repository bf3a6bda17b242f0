"""Check yourself: the seed's two questions, and a few generated from the current controls.

Questions go to the page without their answers; `check` answers one question at a time, after the learner
has committed an answer. Every expected value comes from the core (`KVSpec`) or from `run_lab`.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ..core.sizing.geometry import KVSpec
from ..errors import ConfigError
from ..lab import LabSpec
from ..units import format_bytes
from .inputs import LabInput
from .lesson import lab_result, numbers_in

# The seed's own example: 32 layers, 8 KV heads, head dim 128, BF16, 16-token pages, a 512 MiB pool,
# eight requests sharing a 2,048-token prompt with a 257-token output allowance.
SEED_KV = KVSpec(32, 8, 128, kv_dtype="bf16", block_size=16)
SEED_LAB = LabSpec(SEED_KV.pool_blocks("512MiB"), 16, 8, 2048, 2048, 257, 1)


def _seed_questions() -> list[dict[str, Any]]:
    pages = SEED_KV.blocks_for_tokens(2048 + 257)
    return [
        {"id": "seed-pages", "kind": "choice", "source": "seed",
         "text": "How many 16-token pages cover a 2,048-token prompt and 257 generated tokens?",
         "options": [str(x) for x in sorted({pages - 1, pages, 257})]},
        {"id": "seed-why", "kind": "text", "source": "seed",
         "text": "Why do eight shared-prefix requests fail admission into the 256-page pool?"},
    ]


def _seed_answer(qid: str) -> tuple[Any, str, list[dict[str, Any]]]:
    lab = lab_result(SEED_LAB)
    pages, s, p = lab["blocks_per_request"], lab["shared_prefix_blocks"], lab["private_blocks_per_request"]
    if qid == "seed-pages":
        return pages, (f"ceil((2,048 + 257) / 16) = {pages}: the prompt fills {2048 // 16} pages exactly and the "
                       f"257 output tokens need {pages - 2048 // 16} more; the last holds one token and is "
                       f"charged whole."), []
    need, pool = lab["blocks_needed_all"], lab["pool_blocks"]
    explanation = (f"Sharing stores the {s} prefix pages once, but each request still needs {p} private pages for "
                   f"its 257-token allowance: {s} + 8 x {p} = {need} pages, more than the {pool}-page pool. Seven "
                   f"take {s} + 7 x {p} = {lab['admitted_blocks']}, and the {lab['free_blocks_after']} left cannot "
                   f"cover an eighth private reservation of {p}.")
    items = [{"label": f"all eight need {need} pages ({s} shared + 8 x {p} private)", "any_of": [need]},
             {"label": f"seven use {lab['admitted_blocks']}, leaving {lab['free_blocks_after']} < {p}",
              "any_of": [lab["admitted_blocks"], lab["free_blocks_after"]]}]
    return None, explanation, items


def questions(inp: LabInput) -> list[dict[str, Any]]:
    spec, pool_bytes, lab = inp.resolve()
    bs, n = spec.block_size, inp.requests
    one = lab_result(replace(lab, groups=1))
    pages = one["blocks_per_request"]
    options = sorted({pages, max(pages - 1, 1) if pages * bs != inp.prompt + inp.max_new else pages + 1,
                      -(-inp.prompt // bs), max(inp.max_new, 1)})
    geometry = spec.name or f"{spec.layers} layers, {spec.kv_heads} KV heads, head dim {spec.head_dim}"
    generated = []
    if (inp.prompt, inp.max_new, bs) != (SEED_LAB.prompt, SEED_LAB.max_new, SEED_LAB.block_size):
        generated.append(
            {"id": "pages", "kind": "choice", "source": "controls",
             "text": f"With your controls: how many {bs}-token pages cover a {inp.prompt:,}-token prompt and "
                     f"{inp.max_new:,} generated tokens?", "options": [str(x) for x in options]})
    return _seed_questions() + generated + [
        {"id": "private", "kind": "number", "source": "controls",
         "text": f"In one trust group, how many private pages does each request need beside the shared "
                 f"{inp.shared_prefix:,}-token prefix?"},
        {"id": "kv-bytes", "kind": "number", "source": "controls",
         "text": f"How many KV bytes does one token take ({geometry}, {spec.kv_dtype} K/V"
                 + (f", tp={spec.tp}" if spec.tp > 1 else "") + ")?"},
        {"id": "admitted", "kind": "number", "source": "controls",
         "text": f"{n} requests in one trust group, a {format_bytes(pool_bytes)} pool: how many does the ledger "
                 f"admit ({inp.policy} reservation)?"},
        {"id": "unshared", "kind": "number", "source": "controls",
         "text": f"How many pages would all {n} requests need with every request in its own trust group?"},
        {"id": "left", "kind": "number", "source": "controls",
         "text": "After the one-group admission, how many pages are left to promise?"},
    ]


def check(inp: LabInput, qid: str, answer: str) -> dict[str, Any]:
    """Whether ``answer`` is right, the expected answer and why."""
    if qid.startswith("seed-"):
        if qid not in ("seed-pages", "seed-why"):
            raise ConfigError(f"unknown question {qid!r}")
        expected, why, items = _seed_answer(qid)
    else:
        expected, why, items = _controls_answer(inp, qid)
    given = numbers_in(answer)
    if items:
        found = [{"label": i["label"], "found": any(x in given for x in i["any_of"])} for i in items]
        return {"id": qid, "correct": any(f["found"] for f in found), "expected": None, "items": found,
                "explanation": why}
    first = _first_number(answer)
    return {"id": qid, "correct": first == expected, "expected": expected, "items": [], "explanation": why}


def _first_number(text: str) -> int | None:
    m = re.search(r"\d[\d,]*", text)
    return int(m.group().replace(",", "")) if m else None


def _controls_answer(inp: LabInput, qid: str) -> tuple[int, str, list[dict[str, Any]]]:
    spec, _pool_bytes, lab = inp.resolve()
    one = lab_result(replace(lab, groups=1))
    iso = lab_result(replace(lab, groups=inp.requests))
    bs, n = spec.block_size, inp.requests
    if qid == "pages":
        x = one["blocks_per_request"]
        return x, f"ceil(({inp.prompt:,} + {inp.max_new:,}) / {bs}) = {x:,}: a partly filled last page is whole.", []
    if qid == "private":
        x, s = one["private_blocks_per_request"], one["shared_prefix_blocks"]
        return x, (f"{one['blocks_per_request']:,} pages per request - {s:,} full prefix pages shared in the group "
                   f"= {x:,} private pages (the rest of the prompt and the output allowance)."), []
    if qid == "kv-bytes":
        x = spec.bytes_per_token
        return x, (f"{spec.layers} layers x {spec.layer_bytes_per_token:,} bytes per layer = {x:,} bytes "
                   f"= {format_bytes(x)}"), []
    if qid == "admitted":
        x = one["admitted"]
        return x, (f"The ledger admitted {x} of {n}: {one['admitted_blocks']:,} pages live or promised, "
                   f"{one['free_blocks_after']:,} left."), []
    if qid == "unshared":
        x = iso["blocks_needed_all"]
        return x, f"No sharing across trust groups: {n} x {one['blocks_per_request']:,} = {x:,} pages.", []
    if qid == "left":
        x = one["free_blocks_after"]
        return x, (f"{one['pool_blocks']:,} pages - {one['admitted_blocks']:,} live or promised = {x:,} "
                   f"(free + evictable - promised)."), []
    raise ConfigError(f"unknown question {qid!r}")
