"""Exercise 1 on the real ledger: the admit payload, the reveal (one trust group against one group per
request), the seed's arithmetic step by step, the scored prediction and the written decision.

Every number here is read from `kvledger.lab.run_lab` (the same payload as `kvledger admit --json`), from
`KVSpec`, or from a replay of the same admissions into a `KVLedger` (`poolmap`). The arithmetic is text
around those numbers: nothing is computed twice by a formula of its own.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ..core.sizing.geometry import KVSpec
from ..lab import LabSpec, run_lab
from ..scheduler import SchedulerConfig
from ..scheduler.policies import OutputLengthTracker, reserve_tokens
from ..units import format_bytes
from .inputs import LabInput
from .poolmap import admitted_in_full, pool_map, replay


@lru_cache(maxsize=64)
def lab_result(spec: LabSpec) -> dict[str, Any]:
    """`run_lab` for one spec; a page asks for the same spec several times (reveal, quiz, decision)."""
    return run_lab(spec)


def admit_payload(inp: LabInput) -> dict[str, Any]:
    """Exactly what `kvledger admit --json` prints for the same controls."""
    spec, pool_bytes, lab = inp.resolve()
    return {"kv_bytes_per_token": spec.bytes_per_token, "block_bytes": spec.block_bytes, "pool_bytes": pool_bytes,
            **lab_result(lab)}


def _n(x: int) -> str:
    return f"{x:,}"


def _panel(inp: LabInput, spec: KVSpec, lab: LabSpec, title: str) -> dict[str, Any]:
    result = lab_result(lab)
    keys = ("groups", "blocks_per_request", "shared_prefix_blocks", "private_blocks_per_request",
            "blocks_needed_all", "blocks_needed_unshared", "admitted", "admitted_blocks", "free_blocks_after",
            "decisions", "growth", "usage", "pool_blocks")
    return {"title": title, **{k: result[k] for k in keys}, "map": pool_map(replay(lab, result))}


def lab_view(inp: LabInput) -> dict[str, Any]:
    """What the page shows after a run: the admit payload, the block maps and the arithmetic."""
    spec, pool_bytes, lab, shown = panels(inp)
    one = lab_result(replace(lab, groups=1))
    iso = lab_result(replace(lab, groups=inp.requests))
    return {"admit": admit_payload(inp), "panels": shown, "arithmetic": arithmetic(lab, spec, pool_bytes, one, iso)}


def panels(inp: LabInput) -> tuple[KVSpec, int, LabSpec, list[dict[str, Any]]]:
    """The block maps to show: one trust group, every request in its own group, and the controls'
    own group count when it is neither."""
    spec, pool_bytes, lab = inp.resolve()
    out = []
    for g in sorted({1, inp.groups, inp.requests}):
        if g == 1:
            title = "One trust group"
        elif g == inp.requests:
            title = f"{inp.requests} trust groups (every request alone)"
        else:
            title = f"{g} trust groups (your controls)"
        out.append(_panel(inp, spec, replace(lab, groups=g), title))
    return spec, pool_bytes, lab, out


def _geometry_step(spec: KVSpec) -> dict[str, str]:
    if spec.attention == "mla":
        formula = (f"{spec.layers} layers x ({spec.kv_lora_rank} latent + {spec.rope_dim} RoPE) x "
                   f"{spec.dtype_bytes} bytes")
    else:
        heads = f"{spec.kv_heads_per_rank} KV heads" + (f" per rank (tp={spec.tp})" if spec.tp > 1 else "")
        formula = f"{spec.layers} layers x {heads} x {spec.head_dim} x 2 K/V x {spec.dtype_bytes} bytes"
    return {"name": "KV bytes per token", "formula": formula,
            "result": f"{_n(spec.bytes_per_token)} bytes = {format_bytes(spec.bytes_per_token)}"}


def arithmetic(spec: LabSpec, kv: KVSpec, pool_bytes: int, shared: dict[str, Any],
               isolated: dict[str, Any]) -> list[dict[str, str]]:
    """The seed's arithmetic, step by step, for the current controls (numbers from the ledger)."""
    bs, n = kv.block_size, spec.requests
    bpr = shared["blocks_per_request"]
    tokens = spec.prompt + spec.max_new
    tail = tokens - (bpr - 1) * bs
    pool_blocks = shared["pool_blocks"]
    spare = pool_bytes - pool_blocks * kv.block_bytes
    s, p = shared["shared_prefix_blocks"], shared["private_blocks_per_request"]
    k, k_iso = shared["admitted"], isolated["admitted"]
    steps = [
        _geometry_step(kv),
        {"name": "Page bytes", "formula": f"{bs} tokens x {format_bytes(kv.bytes_per_token)}",
         "result": f"{_n(kv.block_bytes)} bytes = {format_bytes(kv.block_bytes)}"},
        {"name": "Pool pages", "formula": f"{format_bytes(pool_bytes)} / {format_bytes(kv.block_bytes)}",
         "result": f"{_n(pool_blocks)} pages" + (f" ({format_bytes(spare)} left over, less than a page)"
                                                 if spare else "")},
        {"name": "Request pages", "formula": f"ceil(({_n(spec.prompt)} + {_n(spec.max_new)}) / {bs})",
         "result": f"{_n(bpr)} pages" + (f" (the last page holds {tail} of {bs} tokens and is charged whole)"
                                          if tail and tail < bs else "")},
        {"name": "Shared + private (one trust group)",
         "formula": f"{_n(s)} shared + {n} x {_n(p)} private" if s + n * p == shared["blocks_needed_all"]
         else f"all {n} requests' pages, shared ones once",
         "result": f"{_n(shared['blocks_needed_all'])} pages for all {n} (without sharing {n} x {_n(bpr)} = "
                   f"{_n(shared['blocks_needed_unshared'])})"},
        {"name": "Admitted (one trust group)",
         "formula": f"{_n(s)} + {k} x {_n(p)}" if s + k * p == shared["admitted_blocks"]
         else f"{k} requests' live and promised pages",
         "result": f"{_n(shared['admitted_blocks'])} pages: {k} of {n} admitted, "
                   f"{_n(shared['free_blocks_after'])} left to promise"
                   + (f", fewer than the next request's {_n(p)}" if k < n and spec.policy == "full" else "")},
        {"name": f"Admitted ({n} trust groups)",
         "formula": f"{k_iso} x {_n(bpr)}" if k_iso * bpr == isolated["admitted_blocks"]
         else f"{k_iso} requests' live and promised pages",
         "result": f"{_n(isolated['admitted_blocks'])} pages: {k_iso} of {n} admitted (each group stores its own "
                   f"copy of the prefix), {_n(isolated['free_blocks_after'])} left to promise"},
    ]
    return steps


# ---- the prediction -------------------------------------------------------------------------------------
_Count = Annotated[int, Field(strict=True, ge=0, le=10**9)] | None


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    blocks_per_request: _Count = None
    one_group_needed: _Count = None
    one_group_admitted: _Count = None
    isolated_needed: _Count = None
    isolated_admitted: _Count = None


def score(inp: LabInput, prediction: Prediction) -> dict[str, Any]:
    spec, pool_bytes, lab = inp.resolve()
    one = lab_result(replace(lab, groups=1))
    iso = lab_result(replace(lab, groups=inp.requests))
    n = inp.requests
    rows = [
        ("blocks_per_request", "Pages per request", one["blocks_per_request"]),
        ("one_group_needed", f"One trust group: pages all {n} need", one["blocks_needed_all"]),
        ("one_group_admitted", "One trust group: requests admitted", one["admitted"]),
        ("isolated_needed", f"{n} trust groups: pages all {n} need", iso["blocks_needed_all"]),
        ("isolated_admitted", f"{n} trust groups: requests admitted", iso["admitted"]),
    ]
    items = []
    for key, label, actual in rows:
        guess = getattr(prediction, key)
        items.append({"key": key, "label": label, "predicted": guess, "actual": actual,
                      "correct": None if guess is None else guess == actual})
    right = sum(1 for i in items if i["correct"])
    return {"items": items, "correct": right, "total": len(items),
            "arithmetic": arithmetic(lab, spec, pool_bytes, one, iso)}


# ---- the written decision --------------------------------------------------------------------------------
_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                     "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}
_SHORTER = re.compile(r"\b(shorter|smaller|lower\w*|less|reduc\w*|fewer|cut\w*|shrink\w*|drop\w*|decreas\w*|"
                      r"trim\w*)\b", re.I)
_OUTPUT = re.compile(r"\b(output|allowance|max[_ -]?new|generat\w*|tokens?)\b", re.I)


def numbers_in(text: str) -> set[int]:
    """Integers a person wrote: 1,160 / 1160 / seven."""
    found = {int(m.replace(",", "")) for m in re.findall(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d,])|\d+", text)}
    found |= {_WORDS[w.lower()] for w in re.findall(r"[A-Za-z]+", text) if w.lower() in _WORDS}
    return found


def _largest_allowance(inp: LabInput, lab: LabSpec, groups: int, at_least: int) -> int | None:
    """The largest output allowance (0..controls' allowance) with at least ``at_least`` admitted, by the
    ledger's own admissions (monotone in the allowance under full reservation); None if even 0 fails."""
    lo, hi = 0, inp.max_new
    if admitted_in_full(replace(lab, groups=groups, max_new=0)) < at_least:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if admitted_in_full(replace(lab, groups=groups, max_new=mid)) >= at_least:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def model_answer(inp: LabInput) -> dict[str, Any]:
    """A written admission decision for the current controls, and the numbers it must mention."""
    spec, pool_bytes, lab = inp.resolve()
    one = lab_result(replace(lab, groups=1))
    iso = lab_result(replace(lab, groups=inp.requests))
    n, bs = inp.requests, spec.block_size
    bpr, s, p = one["blocks_per_request"], one["shared_prefix_blocks"], one["private_blocks_per_request"]
    k, k_iso, pool = one["admitted"], iso["admitted"], one["pool_blocks"]
    tail = inp.prompt + inp.max_new - (bpr - 1) * bs
    policy = "reserving the full output allowance" if inp.policy == "full" else f"under the {inp.policy} policy"
    text = [f"Decision for the {format_bytes(pool_bytes)} pool ({pool:,} pages of {bs} tokens), {policy}: "
            f"admit at most {k} of the {n} requests when they share one trust group, and {k_iso} when every "
            f"request is its own trust group."]
    text.append(f"Each request is charged ceil(({inp.prompt:,} + {inp.max_new:,}) / {bs}) = {bpr:,} pages"
                + (f"; the last page holds {tail} token{'s' if tail != 1 else ''} and is still a whole page."
                   if 0 < tail < bs else "."))
    text.append(f"In one group the {s:,} prefix pages are stored once and each request adds {p:,} private pages: "
                f"all {n} would need {s:,} + {n} x {p:,} = {one['blocks_needed_all']:,} pages"
                + (f", more than the {pool:,} in the pool. {k} take {one['admitted_blocks']:,}, leaving "
                   f"{one['free_blocks_after']:,}, which cannot cover the next request's {p:,}."
                   if k < n else f", which fits the {pool:,}-page pool." if one["blocks_needed_all"] <= pool else
                   f", more than the {pool:,} in the pool, yet all {n} are admitted: together they hold or are "
                   f"promised only {one['admitted_blocks']:,}, because admission reserves less than the whole "
                   "allowance."))
    text.append(f"Across trust groups nothing is shared: every request needs its own {bpr:,} pages, so "
                f"{k_iso} {'fits' if k_iso == 1 else 'fit'} ({iso['admitted_blocks']:,} pages).")
    threshold = threshold_iso = None
    if inp.policy == "full":
        if k < n:
            threshold = _largest_allowance(inp, lab, 1, n)
            if threshold is None:
                text.append(f"A shorter output allowance alone cannot admit all {n}: even the prompts need more "
                            f"than the pool.")
            else:
                at = lab_result(replace(lab, groups=1, max_new=threshold))
                text.append(f"A shorter output allowance shrinks only the private pages: with {threshold:,} output "
                            f"tokens or fewer each request needs {at['private_blocks_per_request']:,} private pages "
                            f"and all {n} fit in one group ({at['admitted_blocks']:,} pages).")
        else:
            text.append("A shorter output allowance would only leave more pages free; a longer one shrinks "
                        "the admitted count once the private pages no longer fit.")
        if k_iso < n:
            threshold_iso = _largest_allowance(inp, lab, n, k_iso + 1)
            nth = _ordinal(k_iso + 1)
            if threshold_iso is None:
                text.append(f"Isolated requests gain nothing: no output allowance admits a {nth}.")
            elif threshold_iso == 0:
                text.append(f"Isolated requests gain almost nothing: a {nth} fits only with no output allowance "
                            f"at all.")
            else:
                text.append(f"Isolated requests gain little: a {nth} fits only with an allowance of "
                            f"{threshold_iso:,} tokens or fewer.")
    else:  # the key point stands under every policy: what a shorter allowance changes (or that it does not)
        reserve = reserve_tokens(SchedulerConfig(policy=inp.policy), OutputLengthTracker(), inp.max_new, inp.max_new)
        if reserve < inp.max_new:
            text.append(f"Under {inp.policy} admission a request reserves {reserve} output "
                        f"token{'s' if reserve != 1 else ''}, not its whole allowance, so a shorter output "
                        "allowance changes nothing at admission: it only limits how far each request may grow "
                        "later, and so how often growth must preempt.")
        else:
            text.append(f"Under {inp.policy} admission nothing has finished yet to learn output lengths from, so "
                        "each request reserves its whole allowance as under full: a shorter output allowance "
                        "shrinks the private pages as it would there.")
    key = [
        {"key": "pages_per_request", "label": f"pages per request, rounded up to whole pages ({bpr})",
         "any_of": [bpr]},
        {"key": "admitted_shared", "label": f"requests admitted in one trust group ({k})", "any_of": [k]},
        {"key": "admitted_isolated", "label": f"requests admitted with separate trust groups ({k_iso})",
         "any_of": [k_iso]},
        {"key": "ownership", "label": f"the shared prefix counted once ({s} pages) beside private pages ({p})",
         "any_of": [s]},
        {"key": "totals", "label": f"a page total: {one['blocks_needed_all']} needed, {one['admitted_blocks']} "
                                   f"admitted or {one['free_blocks_after']} left",
         "any_of": sorted({one["blocks_needed_all"], one["admitted_blocks"], one["free_blocks_after"]})},
        {"key": "shorter_allowance", "label": "what a shorter output allowance changes", "any_of": []},
    ]
    return {"text": " ".join(text), "key_numbers": key, "threshold_allowance": threshold,
            "threshold_allowance_isolated": threshold_iso}


def _names_allowance(written: str, threshold: int | None) -> bool:
    """Whether ``written`` gives the allowance at which all requests fit ("max_new 256", "256 output tokens"):
    that states the point as a number, without a word like "shorter"."""
    if not threshold:
        return False
    num = "|".join(re.escape(x) for x in sorted({str(threshold), f"{threshold:,}"}))
    num = rf"(?<![\d,])(?:{num})(?![\d,])"
    return bool(re.search(rf"(?:max[_ -]?new|allowance|output)[^\d.]{{0,24}}{num}|{num}\s*(?:output\s+)?tokens?\b",
                          written, re.I))


def check_decision(inp: LabInput, written: str) -> dict[str, Any]:
    """Which key numbers (and the shorter-allowance point) a written decision mentions; the model answer."""
    answer = model_answer(inp)
    numbers = numbers_in(written)
    items = []
    for item in answer["key_numbers"]:
        if item["key"] == "shorter_allowance":
            ok = bool(_SHORTER.search(written) and _OUTPUT.search(written)) or _names_allowance(
                written, answer["threshold_allowance"])
        else:
            ok = any(x in numbers for x in item["any_of"])
        items.append({"key": item["key"], "label": item["label"], "found": ok})
    return {"items": items, "found": sum(i["found"] for i in items), "total": len(items),
            "model_answer": answer["text"]}
