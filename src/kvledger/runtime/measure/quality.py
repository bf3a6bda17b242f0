"""Measure a quantised KV format against the uncompressed KV of the same model: the quality contract's figures.

For every text kind (prose, source code, chat) at every context length (256 and 2,048 tokens by default),
two runners share one decoder -- one stores K/V in the compute dtype (the baseline), one in the format --
and each case reports:

* teacher-forced perplexity over the context (one prefill, every position's next-token distribution) for
  both, and its relative change ``|ppl_fmt - ppl_base| / ppl_base``;
* next-token KL divergence ``KL(p_base || p_fmt)``, mean and largest over the positions;
* per-layer attention-output relative error ``||o - o_exact|| / ||o_exact||``, where ``o`` is the layer's
  attention output reading the format's K/V and ``o_exact`` the same queries over the same keys and values
  unquantised (so each layer's own representation error, not the drift of the layers before it);
* greedy generation agreement: the baseline generates ``new_tokens`` (128) greedy tokens after the
  context; the format's runner decodes along that same path (fed the baseline's tokens) and its greedy
  choice is compared at every step: the steps where both choose the same token, and the first step where
  they differ (which is where a free-running run of the format would first diverge). Comparing two
  free-running runs after their first divergence would compare unrelated continuations: one near-tie
  early on (a bf16 cache against fp32 already flips one on prose) would score the rest as disagreement.

Texts come from what the package and the system ship (:mod:`.quality_texts`, each with its origin and
hash): the bundled public-domain corpus (prose), a module of Python's own standard library (code), and
Debian's package FAQs turned into a conversation with the model's chat template (chat).

The contract is also scored **held out** (:meth:`QualityRun.measure_held_out`): on prompts no format was tuned
on -- by default a bundled slice of the peer-runtime chat prompts (``kvledger/data/quality/held_out/``), or a
JSON file the user gives -- each prompt is one case (teacher-forced perplexity change, KL and attention error
over the prompt, greedy agreement on the baseline's path after it), with a bf16 KV cache's figures on the same
prompt beside the format's, and the free-running common prefix with the baseline's greedy ids (the first
divergence on the baseline's path is exactly where a free-running greedy run first differs).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ..attention import AttentionBatch
from ..engine import kv_spec_for, load_decoder, resolve_model
from ..model import ModelRunner, SeqStep
from ..weights import Checkpoint
from .quality_records import HELD_OUT_SET
from .quality_texts import KINDS, MAX_HELD_OUT_TOKENS, HeldOutPrompt, quality_texts

DEFAULT_CONTEXTS = (256, 2048)
DEFAULT_NEW_TOKENS = 128
FULL_PROTOCOL = {"kinds": list(KINDS), "min_short": 256, "min_long": 2048, "new_tokens": DEFAULT_NEW_TOKENS}
LOGIT_ROWS = 256  # next-token distributions are computed this many positions at a time


# ---- measurement --------------------------------------------------------------------------------------
class _ExactAttention:
    """Wraps a backend: records, per layer, the relative error of its output against exact attention of the
    same queries over the same (unquantised) keys and values. Single-sequence, single-chunk prefills only."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.errors: dict[int, float] = {}
        self.active = False

    def plan(self, batch: AttentionBatch) -> None:
        self.inner.plan(batch)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                window: int | None = None) -> torch.Tensor:
        out = self.inner.forward(layer, q, k, v, scale=scale, window=window)
        if self.active:
            qs, ks, vs = (x.float().transpose(0, 1)[None] for x in (q, k, v))
            mask = None
            if window is not None and window < q.shape[0]:
                pos = torch.arange(q.shape[0])
                mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
            ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                 enable_gqa=True)[0].transpose(0, 1)
            self.errors[layer] = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
        return out


def _runner(model: Any, spec: Any, tokens: int, backend: str) -> tuple[ModelRunner, list[int]]:
    blocks = -(-tokens // spec.block_size) + 1
    runner = ModelRunner(model, spec, blocks, backend=backend, residual_slots=1 if spec.format.has_residual else None)
    return runner, list(range(blocks))


def _slots(table: list[int], start: int, end: int, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


@torch.inference_mode()
def _teacher_forced(model: Any, spec: Any, ids: list[int], backend: str) -> tuple[torch.Tensor, dict[int, float]]:
    """Final hidden states at every position of one prefill over ``ids``, and per-layer attention errors."""
    runner, table = _runner(model, spec, len(ids), backend)
    wrapper = _ExactAttention(runner.backend)
    runner.backend = wrapper  # type: ignore[assignment]
    wrapper.active = True
    captured: dict[str, torch.Tensor] = {}

    def hook(_mod: Any, _inp: Any, out: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, pending = out
        captured["h"] = (x + pending).clone() if pending is not None else x.clone()

    handle = model.layers[-1].register_forward_hook(hook)
    try:
        runner.forward([SeqStep(ids, 0, table, _slots(table, 0, len(ids), spec.block_size))])
    finally:
        handle.remove()
    h = model.norm(captured["h"])
    return h, dict(wrapper.errors)


@torch.inference_mode()
def _greedy(model: Any, spec: Any, prompts: list[list[int]], new_tokens: int, backend: str,
            forced: list[list[int]] | None = None) -> list[list[int]]:
    """``new_tokens`` greedy choices after each prompt, all prompts in one batch (one prefill step, then one
    decode step per token), each sequence in blocks of its own.

    Without ``forced`` each sequence feeds back its own choice (free-running greedy generation). With
    ``forced`` (the baseline's greedy tokens) every sequence is fed the baseline's token instead, so the
    choice at step ``i`` is the format's greedy token on the baseline's path: the two agree at ``i`` exactly
    when a free-running run that had not diverged before ``i`` would pick the same token, and the first
    disagreement is the free-running first divergence."""
    bs = spec.block_size
    need = [-(-(len(p) + new_tokens) // bs) for p in prompts]
    slots = len(prompts) if spec.format.has_residual else None
    runner = ModelRunner(model, spec, sum(need), backend=backend, residual_slots=slots)
    tables, at = [], 0
    for n in need:
        tables.append(list(range(at, at + n)))
        at += n
    logits = runner.forward([SeqStep(p, 0, t, _slots(t, 0, len(p), bs)) for p, t in zip(prompts, tables, strict=True)])
    outs = [[int(x)] for x in logits.argmax(-1).tolist()]
    feed = forced if forced is not None else outs
    for i in range(1, new_tokens):
        steps = [SeqStep([f[i - 1]], len(p) + i - 1, t, _slots(t, len(p) + i - 1, len(p) + i, bs))
                 for p, t, f in zip(prompts, tables, feed, strict=True)]
        for o, x in zip(outs, runner.forward(steps).argmax(-1).tolist(), strict=True):
            o.append(int(x))
    return outs


@torch.inference_mode()
def _compare_logits(model: Any, hb: torch.Tensor, hf: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    nll_b = nll_f = 0.0
    kls: list[torch.Tensor] = []
    n = targets.numel()
    for lo in range(0, n, LOGIT_ROWS):
        hi = min(n, lo + LOGIT_ROWS)
        lb = F.log_softmax(model.lm_head(hb[lo:hi]).float(), dim=-1)
        lf = F.log_softmax(model.lm_head(hf[lo:hi]).float(), dim=-1)
        t = targets[lo:hi]
        nll_b += float(-lb.gather(1, t[:, None]).sum())
        nll_f += float(-lf.gather(1, t[:, None]).sum())
        kls.append((lb.exp() * (lb - lf)).sum(-1).clamp_min(0))
    kl = torch.cat(kls)
    ppl_b, ppl_f = math.exp(nll_b / n), math.exp(nll_f / n)
    return {"ppl_base": ppl_b, "ppl": ppl_f, "ppl_rel_change": abs(ppl_f - ppl_b) / ppl_b,
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


@dataclass
class QualityRun:
    """One model, one format: ``measure`` fills a report (baseline figures are cached per case)."""

    ckpt: Checkpoint
    model_name: str
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    backend: str = "auto"

    def __post_init__(self) -> None:
        self._model = load_decoder(self.ckpt, self.dtype)
        self._tok: Any = None
        self._base: dict[tuple[Any, ...], Any] = {}

    @property
    def tokenizer(self) -> Any:
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(self.ckpt.path))
        return self._tok

    def measure(self, kv_dtype: str, *, kinds: Sequence[str] = KINDS, contexts: Sequence[int] = DEFAULT_CONTEXTS,
                new_tokens: int = DEFAULT_NEW_TOKENS, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        base_spec = kv_spec_for(self.ckpt, self.dtype, None, self.block_size)
        spec = kv_spec_for(self.ckpt, self.dtype, kv_dtype, self.block_size)
        texts = quality_texts(self.tokenizer, kinds)
        cases = []
        text_info = []
        t0 = time.perf_counter()
        work: list[tuple[str, int, list[int]]] = []
        for src in texts:
            ids_all = self.tokenizer(src.text, add_special_tokens=False).input_ids
            text_info.append({"kind": src.kind, "origin": src.origin, "sha256": src.sha256, "tokens": len(ids_all)})
            for n in contexts:
                if len(ids_all) < n + 1:
                    raise ConfigError(f"the {src.kind} text has {len(ids_all)} tokens, fewer than a {n}-token context")
                work.append((src.kind, n, ids_all[:n]))
        base_keys = [(kind, n, new_tokens) for kind, n, _ in work]
        if progress:
            progress(f"greedy generation, {len(work)} contexts in one batch")
        if any(k not in self._base for k in base_keys):
            for key, out in zip(base_keys, _greedy(self._model, base_spec, [ids for *_, ids in work], new_tokens,
                                                   self.backend), strict=True):
                self._base[key] = out
        greedy = _greedy(self._model, spec, [ids for *_, ids in work], new_tokens, self.backend,
                         forced=[self._base[k] for k in base_keys])
        for (kind, n, ids), key, gf in zip(work, base_keys, greedy, strict=True):
            if progress:
                progress(f"{kind} at {n} tokens")
            gb = self._base[key]
            hkey = ("hidden", kind, n)
            if hkey not in self._base:
                self._base[hkey] = _teacher_forced(self._model, base_spec, ids, self.backend)[0]
            hb = self._base[hkey]
            hf, errors = _teacher_forced(self._model, spec, ids, self.backend)
            figures = _compare_logits(self._model, hb[:-1], hf[:-1], torch.tensor(ids[1:]))
            match = sum(a == b for a, b in zip(gb, gf, strict=True))
            first = next((i for i, (a, b) in enumerate(zip(gb, gf, strict=True)) if a != b), None)
            layers = [errors[i] for i in sorted(errors)]
            cases.append({"kind": kind, "context": n, **figures, "attn_rel_err": max(layers),
                          "attn_rel_err_mean": sum(layers) / len(layers), "attn_rel_err_by_layer": layers,
                          "greedy_matching": match, "greedy_new_tokens": new_tokens,
                          "greedy_agreement": match / new_tokens, "first_divergence": first})
        from .quality_records import calibration_digest, kvledger_version, weights_revision

        protocol = {"kinds": list(kinds), "contexts": list(contexts), "new_tokens": new_tokens,
                    "greedy": "format decodes along the baseline's greedy path"}
        complete = (all(k in kinds for k in KINDS) and new_tokens >= DEFAULT_NEW_TOKENS
                    and any(c <= 512 for c in contexts) and any(c >= 2048 for c in contexts))
        revision = weights_revision(self.ckpt)
        return {"model": self.model_name, "weights_revision": revision, "format": spec.kv_dtype,
                "kv_format": spec.kv_format_id, "calibration": calibration_digest(spec.kv_dtype, revision),
                "baseline": base_spec.kv_format_id, "compute_dtype": str(self.dtype),
                "block_size": self.block_size, "kvledger_version": kvledger_version(),
                "bytes_per_token": spec.bytes_per_token, "baseline_bytes_per_token": base_spec.bytes_per_token,
                "attention_backend": type(_runner(self._model, spec, 1, self.backend)[0].backend).__name__,
                "protocol": {**protocol, "complete": complete}, "texts": text_info, "cases": cases,
                "seconds": round(time.perf_counter() - t0, 1),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def measure_held_out(self, kv_dtype: str, prompts: Sequence[HeldOutPrompt], origin: str, *,
                         new_tokens: int = DEFAULT_NEW_TOKENS,
                         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Each held-out prompt as one case, the format's figures beside a bf16 KV cache's, and pooled and
        worst-prompt summaries (``report['held_out']``)."""
        base_spec = kv_spec_for(self.ckpt, self.dtype, None, self.block_size)
        bf16_spec = kv_spec_for(self.ckpt, self.dtype, "bf16", self.block_size)
        spec = kv_spec_for(self.ckpt, self.dtype, kv_dtype, self.block_size)
        vocab = len(self.tokenizer)
        ids_list: list[list[int]] = []
        for i, p in enumerate(prompts):
            ids = list(p.ids) if p.ids is not None else self.tokenizer(p.text, add_special_tokens=False).input_ids
            if not 2 <= len(ids) <= MAX_HELD_OUT_TOKENS:
                raise ConfigError(f"held-out prompt {i} has {len(ids)} tokens; it needs 2 to {MAX_HELD_OUT_TOKENS}")
            if max(ids) >= vocab:
                raise ConfigError(f"held-out prompt {i} has token id {max(ids)}, outside the model's vocabulary "
                                  f"of {vocab}")
            ids_list.append(ids)
        t0 = time.perf_counter()
        keys = [("held-greedy", tuple(ids), new_tokens) for ids in ids_list]
        if progress:
            progress(f"held-out: greedy generation, {len(ids_list)} prompts in one batch")
        if any(k not in self._base for k in keys):
            for k, out in zip(keys, _greedy(self._model, base_spec, ids_list, new_tokens, self.backend), strict=True):
                self._base[k] = out
        base_ids = [self._base[k] for k in keys]
        bkeys = [("held-bf16", *k[1:]) for k in keys]
        if any(k not in self._base for k in bkeys):
            for k, out in zip(bkeys, _greedy(self._model, bf16_spec, ids_list, new_tokens, self.backend,
                                               forced=base_ids), strict=True):
                self._base[k] = out
        fmt_ids = _greedy(self._model, spec, ids_list, new_tokens, self.backend, forced=base_ids)
        cases = []
        for i, (p, ids, gb, gf, bk) in enumerate(zip(prompts, ids_list, base_ids, fmt_ids, bkeys, strict=True)):
            if progress:
                progress(f"held-out prompt {i + 1}/{len(ids_list)} ({len(ids)} tokens)")
            targets = torch.tensor(ids[1:])
            hkey, bhkey = ("held-hidden", tuple(ids)), ("held-bf16-hidden", tuple(ids))
            if hkey not in self._base:
                self._base[hkey] = _teacher_forced(self._model, base_spec, ids, self.backend)[0]
            hb = self._base[hkey]
            if bhkey not in self._base:
                h16 = _teacher_forced(self._model, bf16_spec, ids, self.backend)[0]
                self._base[bhkey] = _compare_logits(self._model, hb[:-1], h16[:-1], targets)
            b16 = self._base[bhkey]
            hf, errors = _teacher_forced(self._model, spec, ids, self.backend)
            figures = _compare_logits(self._model, hb[:-1], hf[:-1], targets)
            layers = [errors[j] for j in sorted(errors)]
            first, first16 = _first_difference(gb, gf), _first_difference(gb, self._base[bk])
            cases.append({"prompt": i, "name": p.name, "tokens": len(ids), **figures,
                          "ppl_change": (figures["ppl"] - figures["ppl_base"]) / figures["ppl_base"],
                          "attn_rel_err": max(layers), "attn_rel_err_mean": sum(layers) / len(layers),
                          "greedy_matching": sum(a == b for a, b in zip(gb, gf, strict=True)),
                          "greedy_new_tokens": new_tokens,
                          "greedy_agreement": sum(a == b for a, b in zip(gb, gf, strict=True)) / new_tokens,
                          "first_divergence": first, "common_prefix": new_tokens if first is None else first,
                          "bf16": {"ppl_rel_change": b16["ppl_rel_change"],
                                   "ppl_change": (b16["ppl"] - b16["ppl_base"]) / b16["ppl_base"],
                                   "kl_mean": b16["kl_mean"],
                                   "greedy_agreement": sum(a == b for a, b in zip(gb, self._base[bk], strict=True))
                                   / new_tokens,
                                   "common_prefix": new_tokens if first16 is None else first16}})
        return {"origin": origin, "prompts": len(cases), "new_tokens": new_tokens, "cases": cases,
                "summary": _held_out_summary(cases), "seconds": round(time.perf_counter() - t0, 1)}


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def _held_out_summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled figures over every held-out position (not a mean of per-prompt figures) and the worst prompt of
    each, for the format and for bf16 beside it."""
    n = [c["tokens"] - 1 for c in cases]
    total = sum(n)

    def pooled_ppl_change(base_ppl: list[float], ppl: list[float]) -> float:
        nb = sum(k * math.log(b) for k, b in zip(n, base_ppl, strict=True))
        nf = sum(k * math.log(f) for k, f in zip(n, ppl, strict=True))
        return math.exp(nf / total) / math.exp(nb / total) - 1

    ppl16 = [c["ppl_base"] * (1 + c["bf16"]["ppl_change"]) for c in cases]
    kl = sum(k * c["kl_mean"] for k, c in zip(n, cases, strict=True)) / total
    kl16 = sum(k * c["bf16"]["kl_mean"] for k, c in zip(n, cases, strict=True)) / total
    prefix = sum(c["common_prefix"] for c in cases) / len(cases)
    prefix16 = sum(c["bf16"]["common_prefix"] for c in cases) / len(cases)
    worst_ppl = max(cases, key=lambda c: c["ppl_rel_change"])
    worst_kl = max(cases, key=lambda c: c["kl_mean"])
    worst_agree = min(cases, key=lambda c: c["greedy_agreement"])
    pooled = pooled_ppl_change([c["ppl_base"] for c in cases], [c["ppl"] for c in cases])
    return {"ppl_change_pooled": pooled, "ppl_rel_change_pooled": abs(pooled),
            "ppl_change_pooled_bf16": pooled_ppl_change([c["ppl_base"] for c in cases], ppl16),
            "ppl_rel_change_worst": worst_ppl["ppl_rel_change"], "ppl_rel_change_worst_prompt": worst_ppl["prompt"],
            "ppl_rel_change_worst_bf16": max(c["bf16"]["ppl_rel_change"] for c in cases),
            "kl_mean_pooled": kl, "kl_mean_pooled_bf16": kl16, "kl_vs_bf16": kl / kl16 if kl16 > 0 else None,
            "kl_mean_worst": worst_kl["kl_mean"], "kl_mean_worst_prompt": worst_kl["prompt"],
            "greedy_agreement_mean": sum(c["greedy_agreement"] for c in cases) / len(cases),
            "greedy_agreement_mean_bf16": sum(c["bf16"]["greedy_agreement"] for c in cases) / len(cases),
            "greedy_agreement_worst": worst_agree["greedy_agreement"],
            "greedy_agreement_worst_prompt": worst_agree["prompt"],
            "common_prefix_mean": prefix, "common_prefix_mean_bf16": prefix16,
            "common_prefix_vs_bf16": prefix / prefix16 if prefix16 > 0 else None,
            "identical": sum(c["first_divergence"] is None for c in cases),
            "identical_bf16": sum(c["bf16"]["common_prefix"] == c["greedy_new_tokens"] for c in cases)}


_WORDS = {"ppl_rel_change": "perplexity change", "kl_mean": "KL mean", "attn_rel_err": "attention error",
          "greedy_agreement": "greedy agreement"}


def _show(metric: str, value: float) -> str:
    if metric == "ppl_rel_change":
        return f"{100 * value:+.2f}%"
    if metric == "greedy_agreement":
        return f"{100 * value:.1f}%"
    return f"{value:.3g}"


def _bound(metric: str, value: float) -> str:
    return f"{100 * value:g}%" if metric in ("ppl_rel_change", "greedy_agreement") else f"{value:g}"


def _verdicts(contract: Any, cases: list[dict[str, Any]], where: Callable[[dict[str, Any]], str],
              set_name: str) -> list[dict[str, Any]]:
    """Each threshold over ``cases``, with the case that sets a max or min (``worst``) and the clause in words:
    e.g. 'perplexity change on held-out prompt 7 +0.81% > 0.5%'."""
    from .quality_records import evaluate

    out = []
    for v, t in zip(evaluate(contract, cases), contract.thresholds, strict=True):
        word, bound = _WORDS.get(t.metric, t.metric), t.max if t.max is not None else t.min
        op = ("<=" if v["ok"] else ">") if t.max is not None else (">=" if v["ok"] else "<")
        if t.agg in ("max", "min"):
            worst = (max if t.agg == "max" else min)(cases, key=lambda c: float(c[t.metric]))
            shown = v["value"]
            if t.metric == "ppl_rel_change":  # the signed change, as a user reads it
                shown = worst.get("ppl_change", (worst["ppl"] - worst["ppl_base"]) / worst["ppl_base"])
            clause = f"{word} on {where(worst)} {_show(t.metric, shown)} {op} {_bound(t.metric, bound)}"
            v["worst"] = where(worst)
        else:
            clause = (f"{t.agg} {word} over the {set_name} {_show(t.metric, v['value'])} {op} "
                      f"{_bound(t.metric, bound)}")
        out.append({**v, "set": set_name, "clause": clause})
    return out


def _held_out_verdicts(contract: Any, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The contract's clauses on the held-out set as a whole: pooled perplexity change, KL and free-running
    common prefix relative to a bf16 cache's on the same prompts."""
    out = []
    for t in getattr(contract, "held_out", ()):
        if summary[t.metric] is None:  # bf16's figure is 0 (a bf16 compute dtype: bf16 KV is the baseline)
            continue
        value = float(summary[t.metric])
        ok = t.check(value)
        bound = t.max if t.max is not None else t.min
        op = ("<=" if ok else ">") if t.max is not None else (">=" if ok else "<")
        if t.metric == "ppl_rel_change_pooled":
            clause = (f"pooled perplexity change over the held-out prompts {100 * summary['ppl_change_pooled']:+.2f}% "
                      f"{op} {100 * bound:g}%")
        elif t.metric == "kl_vs_bf16":
            clause = (f"pooled KL over the held-out prompts {summary['kl_mean_pooled']:.3g} = {value:.2f}x bf16's "
                      f"{summary['kl_mean_pooled_bf16']:.3g} {op} {bound:g}x")
        else:
            clause = (f"free-running mean common prefix over the held-out prompts {summary['common_prefix_mean']:.1f} "
                      f"= {value:.2f}x bf16's {summary['common_prefix_mean_bf16']:.1f} {op} {bound:g}x")
        out.append({"threshold": t.describe(), "metric": t.metric, "agg": t.agg, "value": value, "ok": ok,
                    "set": HELD_OUT_SET, "clause": clause})
    return out


def judge(report: dict[str, Any], contract: Any) -> dict[str, Any]:
    """Add the contract, the verdict of each threshold, ``passed`` and a summary to ``report``."""
    cases = report["cases"]
    verdict = _verdicts(contract, cases, lambda c: f"{c['kind']} at {c['context']:,} tokens", "texts")
    if report.get("held_out"):
        verdict += _verdicts(contract, report["held_out"]["cases"], lambda c: f"held-out prompt {c['prompt']}",
                             HELD_OUT_SET)
        verdict += _held_out_verdicts(contract, report["held_out"]["summary"])
    passed = all(v["ok"] for v in verdict)
    failing = [v["clause"] for v in verdict if not v["ok"]]
    summary = {"ppl_rel_change_max": max(c["ppl_rel_change"] for c in cases),
               "kl_mean_max": max(c["kl_mean"] for c in cases),
               "attn_rel_err_max": max(c["attn_rel_err"] for c in cases),
               "greedy_agreement_mean": sum(c["greedy_agreement"] for c in cases) / len(cases),
               "greedy_agreement_min": min(c["greedy_agreement"] for c in cases)}
    return {**report, "contract": contract.to_dict(), "verdict": verdict, "summary": summary, "passed": passed,
            "verdict_line": "passes" if passed else "fails: " + "; ".join(failing)}


def plot_report(report: dict[str, Any], path: Path) -> Path:
    """Per-layer attention error for every case, and perplexity change and greedy agreement per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in cases:
        a1.plot(c["attn_rel_err_by_layer"], marker=".", label=f"{c['kind']} {c['context']}")
    a1.set_xlabel("layer")
    a1.set_ylabel("attention output relative error")
    a1.set_title(f"{report['format']}: each layer's attention vs exact K/V")
    a1.legend(fontsize=8)
    names = [f"{c['kind']}\n{c['context']}" for c in cases]
    x = range(len(cases))
    a2.bar([i - 0.2 for i in x], [100 * c["ppl_rel_change"] for c in cases], width=0.4, label="perplexity change %")
    a2.bar([i + 0.2 for i in x], [100 * c["greedy_agreement"] for c in cases], width=0.4, label="greedy agreement %")
    a2.set_xticks(list(x), names, fontsize=8)
    a2.set_yscale("log")
    a2.set_title(f"{report['model']} {report['kv_format']}"[:90], fontsize=8)
    a2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def measure_format(model: str, kv_dtype: str, **kwargs: Any) -> dict[str, Any]:
    """One-call form: ``measure_format("smollm2-135m", "int8")`` -> the report (not judged)."""
    ckpt = resolve_model(model)
    run = QualityRun(ckpt, model, **{k: kwargs.pop(k) for k in ("dtype", "block_size", "backend") if k in kwargs})
    return run.measure(kv_dtype, **kwargs)


def _main(argv: Sequence[str] | None = None) -> None:  # pragma: no cover - a developer's shortcut
    ap = argparse.ArgumentParser()
    ap.add_argument("kv_dtype")
    args = ap.parse_args(argv)
    print(measure_format("smollm2-135m", args.kv_dtype, contexts=(64,), new_tokens=8))


__all__ = ["DEFAULT_CONTEXTS", "DEFAULT_NEW_TOKENS", "QualityRun", "judge", "measure_format", "plot_report"]
