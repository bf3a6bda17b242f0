"""Screen 4-bit KV schemes on tuning texts: teacher-forced KL of SmolLM2's next-token distribution with
fake-quantised K/V (every position attends to the quantised rows, as the store's prefill does) against the
fp32-KV forward. Tuning texts only (never the contract's texts or held-out prompts): the first 512 tokens of
Python's ``textwrap.py`` and of the Apache-2.0 licence, and 4 ``tune`` peer prompts with their 128 reference
ids. A scheme is ``KEYS/VALUES[/sinkN|/xsinkN|/isinkN]`` (quantiser names: :data:`QUANT`; ``sinkN`` keeps the first N
tokens' K and V at bf16, ``xsinkN`` also leaves them out of block 0's per-channel ranges, ``isinkN`` keeps them in
block 0's own bytes, entropy-coded schemes only); each prints its KL,
perplexity change and bytes per token (metadata included, :data:`BYTES`), then one JSON line of every figure.
Codebook schemes (:data:`CODEBOOK`, :data:`BLOCK_ALLOC`, :data:`TRANSFORM`) learn their levels on
:func:`calibration_texts`, apart from every scored text; their per-model codebook bytes are reported apart from the
bytes per token.
``--held-out`` scores 8 peer prompts kept apart from every tuning and calibration choice instead;
``--contract-texts`` ``kvledger quality``'s texts at its contexts (fake-quantised here: an indication).
``--per-layer k:NAME,v:NAME,...`` measures each layer's share instead (one layer's keys or values quantised at a
time) and the best per-layer mix of those grids within ``--ratio`` (:func:`allocate`).
Results and what they say: docs/kv_formats.md, "Screened since".

``--more-tuning`` adds the 6 ``tune`` peer prompts nothing else uses, for choices the 6 tuning texts leave open.
``--slack W`` leaves W of each entropy-coded block's 16-bit words unused: a draw a few bytes from the budget.
Entropy-coded schemes (``pklte{NN}``, ``klte{NN}``) code each block with a real rANS coder (the native one of
``kvledger.runtime.kv_entropy``): their bytes are the coder's, not a model's. ``--tuning-by-kind`` scores two tuning
texts of each kind the contract scores instead (prose, code, chat; :func:`texts_by_kind`), ``--calibration kinds``
fits on prose, code and chat in about equal shares (:func:`calibration_texts`). A trailing ``r`` (``pklte33r``) gives
every layer-head of a side one whitened step (``kv_transform_fit.fit_transforms_ec_shared``: each its own bytes a row,
the side's budget on average); ``w`` weighs each layer's step by what its error costs (the KL a unit of whitened noise
costs, measured layer by layer on the calibration texts and cached); ``j`` (both sides) pools the two budgets under
one weighted step, so the split between keys and values is the allocation's too.

Usage: python benchmarks/kv_4bit_screen.py [--schemes kivi4/tok4h/sink1,pklte33/klte40/sink1,ppq2x8/none] [--threads 2]
       python benchmarks/kv_4bit_screen.py --per-layer k:kivi4,k:tok4h,v:tok4h,v:tok3h [--ratio 3.5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sysconfig
import time
from pathlib import Path

import kv_codebooks as cbq  # beside this script
import torch
import torch.nn.functional as F

from kvledger.core.sizing.kv_formats import get_kv_format
from kvledger.runtime import kv_transform_fit as ktf
from kvledger.runtime.kv_smoothing import for_model
from kvledger.runtime.loading import load_decoder, resolve_model

PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(d)


def bf16(x):
    return x.to(torch.bfloat16).float()


def f16(x):
    return x.half().float()


def asym(x, bits, dim):
    """Asymmetric grid over ``dim`` (fp16 scale and minimum)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    n = 2 ** bits - 1
    s = f16(((hi - lo) / n).clamp_min(1e-8))
    lo = f16(lo)
    return (((x - lo) / s).round().clamp(0, n)) * s + lo


def sym_logscale(x, bits, dim, scale_bits=8):
    """Symmetric grid over ``dim`` whose scale is stored as a ``scale_bits`` log code (1/8-octave steps)."""
    n = 2 ** (bits - 1) - 1
    a = x.abs().amax(dim, keepdim=True).clamp_min(1e-6)
    # round the scale UP to the next 1/8 octave so the grid covers amax
    s = torch.exp2(torch.ceil(torch.log2(a / n) * 8) / 8)
    return (x / s).round().clamp(-n - 1, n) * s


def blocks(x, bs=16):
    """[T, H, D] -> [nb, bs, H, D] padded (pad rows copy the last row)."""
    t = x.shape[0]
    pad = (-t) % bs
    if pad:
        x = torch.cat((x, x[-1:].expand(pad, *x.shape[1:])), 0)
    return x.view(-1, bs, *x.shape[1:]), t


def unblock(xb, t):
    return xb.reshape(-1, *xb.shape[2:])[:t]


# ---- quantisers: f(layer, x [T, H, D]) -> x_hat ----

def q_none(layer, x, ctx):
    return x


def q_tok4_turned(layer, x, ctx, bits=4):
    H = ctx["H"]
    y = x @ H
    return asym(y, bits, -1) @ H.T


def q_tok_turned_mu(layer, x, ctx, bits=4, scale=True):
    mu, s = ctx["mu"][layer], ctx["s"][layer]
    H = ctx["H"]
    if not scale:
        s = torch.ones_like(s)
    y = ((x - mu) / s) @ H
    return (asym(y, bits, -1) @ H.T) * s + mu


def q_kivi(layer, x, ctx, bits=4, bs=16):
    xb, t = blocks(x, bs)
    return unblock(asym(xb, bits, 1), t)


def q_chan_sym_log(layer, x, ctx, bits=4, bs=16, center=True):
    mu = ctx["mu"][layer] if center else 0
    xb, t = blocks(x - mu, bs)
    return unblock(sym_logscale(xb, bits, 1), t) + mu


def q_chan_asym_log(layer, x, ctx, bits=4, bs=16, cover=False):
    """Per channel per block, asymmetric, step and minimum one byte each: the step a log code (1/8-octave
    steps, rounded up), the minimum a whole number of steps (``floor(lo / s)``). ``cover``: the step sized for
    ``n - 1`` intervals, so the grid always reaches the block's maximum (without it the top may clip)."""
    xb, t = blocks(x, bs)
    lo, hi = xb.amin(1, keepdim=True), xb.amax(1, keepdim=True)
    n = 2 ** bits - 1
    s = torch.exp2(torch.ceil(torch.log2(((hi - lo) / (n - 1 if cover else n)).clamp_min(1e-6)) * 8) / 8)
    lo_q = torch.floor(lo / s) * s
    return unblock(((xb - lo_q) / s).round().clamp(0, n) * s + lo_q, t)


def q_tok_sym_log_turned(layer, x, ctx, bits=4):
    """Turned, symmetric per token and head, the scale a 1-byte log code: ``D / 2 + 1`` bytes at 4 bits."""
    H = ctx["H"]
    return sym_logscale(x @ H, bits, -1) @ H.T


def q_kivi_outliers(layer, x, ctx, bits=4, bs=16, keep=4):
    """KIVI per channel per block, the ``keep`` values per (block, head) farthest from their channel's block
    median kept exact (fp16 + a 2-byte index each) and left out of the grid."""
    xb, t = blocks(x, bs)  # [nb, bs, H, D]
    med = xb.median(1, keepdim=True).values
    dev = (xb - med).abs().permute(0, 2, 1, 3).reshape(xb.shape[0], xb.shape[2], -1)  # [nb, H, bs*D]
    idx = dev.topk(keep, -1).indices
    mask = torch.zeros_like(dev, dtype=torch.bool).scatter_(-1, idx, True)
    mask = mask.view(xb.shape[0], xb.shape[2], bs, -1).permute(0, 2, 1, 3)
    inl = torch.where(mask, med.expand_as(xb), xb)
    q = asym(inl, bits, 1)
    return unblock(torch.where(mask, f16(xb), q), t)


NF4 = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461,
                    0.3379, 0.4407, 0.5626, 0.7230, 1.0])


def q_kivi_nf4(layer, x, ctx, bs=16):
    """Per channel per block like KIVI, but the 16 levels are NF4's (normal quantiles) over the block's
    [min, max] (centre and half-range in fp16): denser near the centre."""
    xb, t = blocks(x, bs)
    lo, hi = xb.amin(1, keepdim=True), xb.amax(1, keepdim=True)
    c, r = f16((hi + lo) / 2), f16(((hi - lo) / 2).clamp_min(1e-8))
    u = ((xb - c) / r)[..., None]
    q = NF4[(u - NF4).abs().argmin(-1)]
    return unblock(q * r + c, t)


QUANT = {
    "knf4": q_kivi_nf4,
    "vsym4l": q_tok_sym_log_turned,
    "kivi4o": q_kivi_outliers,
    "kivi4o8": lambda layer, x, c: q_kivi_outliers(layer, x, c, keep=8),
    "none": q_none,
    "bf16": lambda layer, x, c: bf16(x),
    "tok4h": q_tok4_turned,
    "tok4": lambda layer, x, c: asym(x, 4, -1),  # not turned: the shipped int4's values
    "tok5h": lambda layer, x, c: q_tok4_turned(layer, x, c, 5),
    "tok3h": lambda layer, x, c: q_tok4_turned(layer, x, c, 3),
    "smooth4": q_tok_turned_mu,
    "smooth5": lambda layer, x, c: q_tok_turned_mu(layer, x, c, 5),
    "mu4": lambda layer, x, c: q_tok_turned_mu(layer, x, c, 4, False),
    "kivi4": q_kivi,
    "kivi3": lambda layer, x, c: q_kivi(layer, x, c, 3),
    "kivi5": lambda layer, x, c: q_kivi(layer, x, c, 5),
    "chsym4": q_chan_sym_log,
    "chsym4nc": lambda layer, x, c: q_chan_sym_log(layer, x, c, center=False),
    "chasym4": q_chan_asym_log,
    "chasym4c": lambda layer, x, c: q_chan_asym_log(layer, x, c, cover=True),
    "chasym5": lambda layer, x, c: q_chan_asym_log(layer, x, c, 5),
    "chasym3": lambda layer, x, c: q_chan_asym_log(layer, x, c, 3),
}


QUANT["prekivi4"] = lambda layer, x, c: q_kivi(layer, x, c)
QUANT["prekivi4"].pre_rope = True


# Bytes per token, KV head and layer of each quantiser at D = 64, 16-token blocks, metadata included
# ("none": the side left exact, fp32 here; a screen of the other side alone has no byte figure).
BYTES = {"none": None, "bf16": 128, "tok4h": 36, "tok4": 36, "tok5h": 44, "tok3h": 28, "smooth4": 36, "smooth5": 44,
         "mu4": 36, "kivi4": 48, "kivi3": 40, "kivi5": 56, "chsym4": 36, "chsym4nc": 36, "chasym4": 40, "chasym4c": 40,
         "chasym5": 48, "chasym3": 32, "vsym4l": 33, "kivi4o": 49, "kivi4o8": 50, "knf4": 48, "prekivi4": 48}
HEAD_DIM = 64  # the width BYTES and the Hadamard turn are written for


class Shape:
    """The screened model's KV geometry (layers, KV heads, head dim), read from the loaded model, and its bf16
    bytes per token from the KV-format registry (``kvledger.core.sizing.kv_formats``, which owns every byte
    figure): a bf16 sink token costs those bytes once per sequence, and a scheme's ratio is taken against them."""

    __slots__ = ("layers", "kv_heads", "head_dim")

    def __init__(self, layers: int, kv_heads: int, head_dim: int) -> None:
        if head_dim != HEAD_DIM:
            raise SystemExit(f"the screen's byte table is for head dim {HEAD_DIM}; this model's is {head_dim}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim

    @classmethod
    def of(cls, model) -> Shape:
        attn = model.layers[0].self_attn
        return cls(len(model.layers), attn.kv_heads, attn.head_dim)

    @property
    def layer_heads(self) -> int:
        return self.layers * self.kv_heads

    def token_bytes(self, fmt: str) -> int:
        """Bytes per token of the registry's format ``fmt`` over every layer (16-token blocks, metadata included)."""
        return self.layers * get_kv_format(fmt).layer_block_bytes(16, self.kv_heads, self.head_dim) // 16

    def scheme_bytes(self, keys: str, values: str) -> int | None:
        """Bytes per token of screen quantisers ``keys``/``values`` (:data:`BYTES`), None when either has none."""
        k, v = quantiser_bytes(keys, "k"), quantiser_bytes(values, "v")
        return None if k is None or v is None else (k + v) * self.layer_heads


# Codebook quantisers (kv_codebooks.py), learned on calibration texts: ``[p]pq{d}x{bits}[s]`` product
# quantisation in d-channel sub-vectors (d = 2: RoPE pairs), ``[p]nuq{bits}[s]`` per-channel levels; ``p``: keys
# before RoPE (RoPE applied to the dequantised key); ``s``: an fp16 per-row (token, head) RMS scale; ``nuqa{bits}``:
# per-channel levels with ``64 * bits`` bits a row spread over the channels by what their error costs (keys: the
# variance times the query energy of the channel; values: times the squared norm of its o_proj columns).
CODEBOOK = re.compile(r"^(?P<pre>p?)(?:pq(?P<d>\d)x(?P<bits>\d+)|nuq(?P<a>a?)(?P<nbits>\d+))(?P<s>s?)$")
CODEBOOK_CACHE = Path("/tmp/kv_codebooks")
# ``[p]kva{NN}``: keys per channel per 16-token block like KIVI (fp16 step and minimum), the bits of each channel
# allocated on calibration texts (NN bytes a row, metadata included) by what its error costs (the block range
# times the channel's query energy); channels given no bits are their calibration mean (no bytes).
BLOCK_ALLOC = re.compile(r"^(?P<pre>p?)kva(?P<nbytes>\d+)$")
# ``klt{NN}``: transform coding (``cbq.fit_transform``): centred, whitened by the error metric (keys: the queries'
# second moment; values: the o_proj columns' Gram matrix), turned onto the principal axes, NN bytes a row of codes
# water-filled over the coefficients, static k-means levels: no per-token or per-block metadata.
# ``pklt{NN}``: the same on pre-RoPE keys (RoPE applied to the decoded key), whitened by what a pre-RoPE key error
# costs: the second moment of ``R_n^T q_m`` (a query turned back to the key's position n <= m, sampled).
# ``[p]klte{NN}``: the same basis, entropy-coded (``kv_transform_fit.fit_transform_ec``): one uniform step a 16-row
# block (a byte naming it), the symbols range-coded under a static per-coefficient model, NN bytes a row a block,
# overhead included.
# A trailing ``a`` (``pklte33a``): each block also names a multiplier of the model's deviations (one more byte).
# Before it, ``r``: one whitened step for every layer-head of the side, each its own bytes a row (NN on average);
# ``w``: that step weighed per layer by the measured KL a unit of its whitened error costs; ``j``: both sides' budgets
# pooled under one weighted step.
TRANSFORM = re.compile(r"^(?P<pre>p?)klt(?P<ec>e?)(?P<nbytes>\d+)(?P<shared>[rwjh]?)(?P<adapt>a?)$")


def quantiser_bytes(name, slot):
    """Bytes per token and layer-head of quantiser ``name`` for ``slot`` (what :func:`quantiser` sets as ``.bytes``)."""
    m, ba, tr = CODEBOOK.match(name), BLOCK_ALLOC.match(name), TRANSFORM.match(name)
    if tr is not None:
        return int(tr["nbytes"])
    if ba is not None and slot == "k":
        return int(ba["nbytes"])
    if m is None:
        return BYTES[name]
    d, bits = (1, int(m["nbits"])) if m["nbits"] else (int(m["d"]), int(m["bits"]))
    return cbq.code_bytes(HEAD_DIM, d, bits, bool(m["s"]))


def quantiser(name, slot, shape=None):
    """The quantiser a scheme names for ``slot`` ("k" or "v"), with ``.bytes`` per token, head and layer."""
    m, ba, tr = CODEBOOK.match(name), BLOCK_ALLOC.match(name), TRANSFORM.match(name)
    if tr is not None:
        nbytes, pre = int(tr["nbytes"]), bool(tr["pre"]) and slot == "k"
        if tr["shared"] and not tr["ec"]:
            raise ValueError(f"{name}: a shared step (r, w) is for the entropy-coded transforms (klte) only")
        source = "kpre" if pre else slot
        if tr["ec"]:
            def fe(layer, x, ctx):
                if tr["shared"] == "j":  # the scheme's two budgets, pooled: ctx["split"] is (key, value) bytes
                    fits = ctx["codebooks"]("kv", 0, ctx["split"], False, "kltj")[source][layer]
                else:
                    fits = ctx["codebooks"](source, 0, nbytes, False,
                                            {"r": "kltr", "w": "kltw", "h": "kltwh"}.get(tr["shared"], "klte"))[layer]
                if ctx.get("first_bytes"):  # fsinkN: block 0's page allocated apart, its held rows paid by all heads
                    if tr["shared"] != "w":
                        raise ValueError(f"{name}: fsinkN allocates block 0 by the weighted step (w) only")
                    firsts = ctx["codebooks"](source, 0, nbytes, False, "kltwf")[layer]
                    fits = [dict(f, nbytes_first=g["nbytes"]) for f, g in zip(fits, firsts, strict=True)]
                out = [cbq.ec_quantise(x[:, h], fh, bool(tr["adapt"]), ctx.get("slack", 0), ctx.get("held", 0))
                       for h, fh in enumerate(fits)]
                rows = cbq.block_rows(x.shape[0], fits[0]["bs"])
                over = sum(int((o[3] > cbq.block_budget(rows, fh["nbytes"])).sum())
                           for o, fh in zip(out, fits, strict=True))
                if over:
                    print(f"  {name} layer {layer}: {over} blocks over budget", flush=True)
                return torch.stack([o[0] for o in out], 1)

            fe.pre_rope, fe.bytes = pre, quantiser_bytes(name, slot)
            fe.model_bytes = shape and cbq.transform_ec_bytes(shape.layers, shape.kv_heads, shape.head_dim)
            return fe

        def ft(layer, x, ctx):
            fits = ctx["codebooks"](source, 0, nbytes, False, "klt")[layer]
            return torch.stack([cbq.transform_decode(cbq.transform_codes(x[:, h], fh), fh)
                                for h, fh in enumerate(fits)], 1)

        ft.pre_rope, ft.bytes = pre, quantiser_bytes(name, slot)
        ft.model_bytes = shape and cbq.transform_bytes(shape.layers, shape.kv_heads, shape.head_dim)
        return ft
    if ba is not None and slot == "k":
        pre, nbytes = bool(ba["pre"]), int(ba["nbytes"])

        def fb(layer, x, ctx):
            bits, mean, used = ctx["codebooks"]("kpre" if pre else "k", 0, nbytes, False, "block")[layer]
            return cbq.block_allocated(x, bits, mean)

        fb.pre_rope, fb.bytes = pre, quantiser_bytes(name, slot)  # the budget; the bytes used are printed when fitted
        return fb
    if m is None:
        f = QUANT[name]
        f.bytes = quantiser_bytes(name, slot)
        return f
    d, bits = (1, int(m["nbits"])) if m["nbits"] else (int(m["d"]), int(m["bits"]))
    scaled, pre, alloc = bool(m["s"]), bool(m["pre"]) and slot == "k", bool(m["a"])
    source = "v" if slot == "v" else "kpre" if pre else "k"
    if alloc and scaled:
        raise ValueError(f"{name}: allocated levels take no row scale")

    def f(layer, x, ctx):
        cb = ctx["codebooks"](source, d, bits, scaled, alloc)[layer]
        codes, s = cbq.encode(x, cb, scaled)
        return cbq.decode(codes, cb, s)

    f.pre_rope = pre
    f.bytes = quantiser_bytes(name, slot)
    # allocated levels: stored here padded to 2 ** 8 a channel (the bound; fewer are used)
    f.model_bytes = shape and cbq.codebook_bytes(shape.layers, shape.kv_heads, shape.head_dim, d, 8 if alloc else bits)
    return f


WIDE_LICENCES = ("MPL-2.0", "LGPL-2.1", "Artistic", "GFDL-1.3")  # more prose-like calibration (``--wide-calibration``)
WIDE_CODE = ("shutil.py", "tarfile.py", "inspect.py", "statistics.py")


CALIBRATIONS = {"narrow": 0, "kinds": 1, "wide": 4}  # how many of each WIDE_ list a calibration adds


def calibration_texts(tok, calibration="narrow"):
    """Texts the codebooks learn from, apart from every text the screen scores and from the quality
    contract's texts (bundled corpus, ``argparse.py``, Debian FAQs) and held-out prompts (peers 2, 3, 6, 7, ...):
    the first 1,024 tokens of ``difflib.py`` and of the GPL-3 licence, and the ``tune`` peer prompts 8, 9, 12,
    13, 16 and 17 with their reference ids (``narrow``: 4.3k tokens, half of them chat). ``kinds`` also takes the
    first 1,024 tokens of the first of :data:`WIDE_LICENCES` and of :data:`WIDE_CODE` (prose, code and chat about
    a third each); ``wide`` of all four of each (12.5k tokens, chat a sixth)."""
    out = []
    n = CALIBRATIONS[calibration]
    for name in WIDE_LICENCES[:n]:
        out.append(tok(Path("/usr/share/common-licenses", name).read_text(), add_special_tokens=False).input_ids[:1024])
    for name in WIDE_CODE[:n]:
        out.append(tok((Path(sysconfig.get_paths()["stdlib"]) / name).read_text(),
                       add_special_tokens=False).input_ids[:1024])
    for p in (Path(sysconfig.get_paths()["stdlib"]) / "difflib.py", Path("/usr/share/common-licenses/GPL-3")):
        out.append(tok(p.read_text(), add_special_tokens=False).input_ids[:1024])
    wl = json.loads((PEERS / "workload.json").read_text())
    ref = json.loads((PEERS / "reference_outputs_fp32.json").read_text())["outputs"]
    for i in (8, 9, 12, 13, 16, 17):
        r = ref[i]
        out.append(wl["requests"][i]["ids"] + list(r["ids"] if isinstance(r, dict) else r))
    return out


def codebook_source(model, tok, calibration="narrow"):
    """A memoised ``(source, d, bits, scaled) -> [per-layer codebooks]``, fitted on :func:`calibration_texts`
    (their K/V rows tapped from the exact forward) and cached under :data:`CODEBOOK_CACHE`."""
    calib, taps, memo = calibration_texts(tok, calibration), [], {}
    # the cache key covers the calibration ids and the quantisers' source: a changed fit never reads a stale file
    tag = hashlib.sha256(json.dumps(calib).encode() + Path(cbq.__file__).read_bytes()).hexdigest()[:12]

    def importance(li, source):
        if source == "v":  # |o_proj column|^2 summed over the query heads that read this KV head
            a = model.layers[li].self_attn
            w = (a.o_proj.weight.float() ** 2).sum(0).view(a.kv_heads, -1, a.head_dim).sum(1)
            return w
        e = sum(t[li]["qepre" if source == "kpre" else "qe"] for t in taps)
        return e / sum(len(t[li]["k"]) for t in taps)

    def metric_of(li, source):
        """``[KV heads, D, D]``: keys, the second moment of the (post-RoPE) queries that read each KV head;
        values, the Gram matrix of the o_proj columns that read it."""
        if source == "v":
            a = model.layers[li].self_attn
            w = a.o_proj.weight.float()
            w = w.view(w.shape[0], a.kv_heads, -1, a.head_dim)
            return torch.einsum("hgqd,hgqe->gde", w, w)
        moment = "qqpre" if source == "kpre" else "qq"
        return sum(t[li][moment] for t in taps) / sum(len(t[li]["k"]) for t in taps)

    # The sensitivities are keyed on the calibration ids alone, not on the quantisers' source as the fits are: every
    # edit of kv_codebooks.py would re-measure them (12 minutes a side here). Delete them from the cache when the
    # uniform fits or the measurement itself change.
    sens_tag = hashlib.sha256(json.dumps(calib).encode() + b"sensitivity-v1").hexdigest()[:12]

    def sensitivities(source, per_head=False):
        """:func:`measure_sensitivities` at the uniform fit of ``SENSITIVITY_BYTES[source]`` (a unit of whitened error
        costs about the same at nearby budgets: one measurement serves every budget), cached."""
        bits = SENSITIVITY_BYTES[source]
        path = CODEBOOK_CACHE / f"sens_{source}_{bits}{'_h' if per_head else ''}_{sens_tag}.pt"
        if not path.exists():
            CODEBOOK_CACHE.mkdir(exist_ok=True)
            torch.save(measure_sensitivities(source, get(source, 0, bits, False, "klte"), per_head), path)
        return torch.load(path)

    def measure_sensitivities(source, fits, per_head=False):
        """Per layer-head, the KL a unit of whitened error costs: each layer's rows (that side only, the first row
        kept exact as ``sink1``) get Gaussian noise in the whitened basis of ``fits`` (each head's coefficients a
        deviation of its step over sqrt 12, what its quantiser leaves), and the mean KL on the first 512 tokens of
        the first four calibration texts is divided by the noise's power; a layer's heads share its figure
        (``per_head``: each head's rows alone get the noise, one figure a head, three times the work)."""
        sens = [(ids[:512], forward(model, ids[:512])) for ids in calib[:4]]
        out = []
        for li, fl in enumerate(fits):
            if per_head:
                for h, fh in enumerate(fl):
                    def one(layer, x, ctx, fl=fl, li=li, h=h):
                        return whitened_noise(x, fl, torch.Generator().manual_seed(1000 + 8 * li + h), only=h)
                    one.pre_rope = source == "kpre"
                    pick = (one, q_none) if source != "v" else (q_none, one)
                    kl = torch.cat([kl_and_ppl(base, forward(model, ids, None, None, {}, sink=1, per_layer={li: pick}),
                                               ids)[0] for ids, base in sens]).mean().item()
                    power = float(fh["base"]) ** 2 / 12 * len(fh["sigma"])
                    out.append(max(kl, 1e-12) / power)
                    print(f"  {source} layer {li:2d} head {h}: KL {kl:.2e} at whitened noise power {power:.3e}",
                          flush=True)
                continue
            def noisy(layer, x, ctx, fl=fl, li=li):
                return whitened_noise(x, fl, torch.Generator().manual_seed(1000 + li))
            noisy.pre_rope = source == "kpre"
            pick = (noisy, q_none) if source != "v" else (q_none, noisy)
            kl = torch.cat([kl_and_ppl(base, forward(model, ids, None, None, {}, sink=1, per_layer={li: pick}),
                                       ids)[0] for ids, base in sens]).mean().item()
            power = sum(float(fh["base"]) ** 2 / 12 * len(fh["sigma"]) for fh in fl)
            out += [max(kl, 1e-12) / power] * len(fl)
            print(f"  {source} layer {li:2d}: KL {kl:.2e} at whitened noise power {power:.3e}", flush=True)
        return out

    def head_rows(source):
        """Every KV head's calibration rows ``[N, D]`` and error metric ``[D, D]`` of one side, layer by layer."""
        xs, metrics = [], []
        for li in range(len(taps[0])):
            x, metric = torch.cat([t[li][source] for t in taps]), metric_of(li, source)
            xs += [x[:, h] for h in range(x.shape[1])]
            metrics += [metric[h] for h in range(x.shape[1])]
        return xs, metrics

    def get(source, d, bits, scaled, alloc=False):
        key = (source, d, bits, scaled, alloc)
        if key not in memo:
            kind = {"klt": "t", "klte": "te", "kltr": "tr", "kltw": "tw", "kltwh": "twh", "kltwf": "twf",
                    "kltj": "tj"}.get(
                alloc, "a" if alloc else "")
            label = "+".join(map(str, bits)) if isinstance(bits, tuple) else bits
            path = CODEBOOK_CACHE / f"{source}_{d}x{label}{kind}{'s' if scaled else ''}_{tag}.pt"
            if path.exists():
                memo[key] = torch.load(path)
            else:
                if not taps:
                    for ids in calib:
                        layers = []
                        forward(model, ids, taps=layers)
                        taps.append(layers)
                t0 = time.time()
                if alloc == "klt":  # one transform per layer and KV head
                    memo[key] = []
                    for li in range(len(taps[0])):
                        x = torch.cat([t[li][source] for t in taps])
                        metric = metric_of(li, source)
                        memo[key].append([cbq.fit_transform(x[:, h], metric[h], 8 * bits) for h in range(x.shape[1])])
                    print(f"  {source} klt{bits}: bits per coefficient " + " ".join(
                        f"{v}:{int(sum((f['bits'] == v).sum() for fl in memo[key] for f in fl))}" for v in range(9)),
                        flush=True)
                elif alloc == "klte":  # one entropy-coded transform per layer and KV head
                    memo[key] = []
                    for li in range(len(taps[0])):
                        x = torch.cat([t[li][source] for t in taps])
                        metric = metric_of(li, source)
                        memo[key].append([ktf.fit_transform_ec(x[:, h], metric[h], bits) for h in range(x.shape[1])])
                    print(f"  {source} klte{bits}: Laplacian coefficients "
                          f"{int(sum(f['laplace'].sum() for fl in memo[key] for f in fl))} of "
                          f"{sum(len(f['laplace']) for fl in memo[key] for f in fl)}", flush=True)
                elif alloc in ("kltr", "kltw", "kltwh"):  # entropy-coded transforms, one step shared by all heads
                    weights = None if alloc == "kltr" else sensitivities(source, per_head=alloc == "kltwh")
                    fl = ktf.fit_transforms_ec_shared(*head_rows(source), bits, weights=weights)
                    heads = len(fl) // len(taps[0])
                    memo[key] = [fl[li * heads:(li + 1) * heads] for li in range(len(taps[0]))]
                    print(f"  {source} klte{bits}{alloc[-1]}: bytes a row by layer " + " ".join(
                        f"{sum(f['nbytes'] for f in fs) / heads:.1f}" for fs in memo[key]), flush=True)
                elif alloc == "kltwf":  # kltw's step for a sequence's first block, its sink row held at bf16
                    fl = ktf.fit_transforms_ec_shared(*head_rows(source), bits, weights=sensitivities(source), held=1)
                    heads = len(fl) // len(taps[0])
                    memo[key] = [fl[li * heads:(li + 1) * heads] for li in range(len(taps[0]))]
                    print(f"  {source} klte{bits}wf: a first block's bytes a row by layer " + " ".join(
                        f"{sum(f['nbytes'] for f in fs) / heads:.1f}" for fs in memo[key]), flush=True)
                elif alloc == "kltj":  # keys and values under one weighted step: bits is (key bytes, value bytes)
                    (kx, km), (vx, vm) = head_rows("kpre"), head_rows("v")
                    fl = ktf.fit_transforms_ec_shared(kx + vx, km + vm, sum(bits) / 2,
                                                      weights=sensitivities("kpre") + sensitivities("v"))
                    nl = len(taps[0])
                    heads = len(fl) // (2 * nl)
                    memo[key] = {side: [fl[(si * nl + li) * heads:(si * nl + li + 1) * heads] for li in range(nl)]
                                 for si, side in enumerate(("kpre", "v"))}
                    for side, fs in memo[key].items():
                        print(f"  {side} joint {'+'.join(map(str, bits))}: bytes a row by layer " + " ".join(
                            f"{sum(f['nbytes'] for f in fh) / heads:.1f}" for fh in fs), flush=True)
                elif alloc == "block":  # (bits, mean, bytes a row used) per layer
                    memo[key] = []
                    for li in range(len(taps[0])):
                        x = torch.cat([t[li][source] for t in taps])
                        err = cbq.block_errors(x, importance(li, source))
                        nb = torch.stack([cbq.allocate_table(e, 8 * bits, 1 + 32 / 16) for e in err])
                        used = (nb.sum(-1) / 8 + (nb > 0).sum(-1) * 4 / 16).mean().item()
                        memo[key].append((nb, x.float().mean(0).half().float(), used))
                    print(f"  {source} kva{bits}: bits per channel " + " ".join(
                        f"{v}:{int(sum((m[0] == v).sum() for m in memo[key]))}" for v in range(9)) +
                        f"; bytes a row used {sum(m[2] for m in memo[key]) / len(memo[key]):.2f}", flush=True)
                elif alloc:
                    memo[key] = [cbq.fit_allocated(torch.cat([t[li][source] for t in taps]),
                                                   importance(li, source), 64 * bits)[1] for li in range(len(taps[0]))]
                else:
                    memo[key] = [cbq.fit(torch.cat([t[li][source] for t in taps]), d, bits, scaled)
                                 for li in range(len(taps[0]))]
                print(f"  codebooks {source} {d}x{bits}{'s' if scaled else ''}: fitted on "
                      f"{sum(len(c) for c in calib)} calibration tokens in {time.time() - t0:.0f}s", flush=True)
                CODEBOOK_CACHE.mkdir(exist_ok=True)
                torch.save(memo[key], path)
        return memo[key]

    return get


def whitened_noise(x, fits, generator, only=None):
    """Rows ``x [N, H, D]`` plus Gaussian noise in each head's whitened basis (``fits[h]``'s ``Ti``): every
    coefficient gets a deviation of the head's base step over sqrt 12, the error a uniform quantiser of that step
    leaves, so the noise costs ``D * base ** 2 / 12`` a row in what an error costs."""
    out = x.clone()
    for h, fh in enumerate(fits):
        if only is not None and h != only:
            continue
        e = torch.randn(x.shape[0], x.shape[2], generator=generator, dtype=torch.float64)
        e = e * (float(fh["base"]) / 12 ** 0.5)
        out[:, h] += (e @ fh["Ti"].double()).to(x.dtype)
    return out


TAP_KEYS = 8  # key positions sampled per query for the pre-RoPE key metric
SENSITIVITY_BYTES = {"kpre": 33, "v": 40, "k": 33}  # the uniform fits the layers' sensitivities are measured at


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


@torch.inference_mode()
def forward(model, ids, kq=None, vq=None, ctx=None, sink=0, per_layer=None, exclude=False, taps=None):
    """Logits at every position; ``kq``/``vq`` quantise post-RoPE K / V per layer; the first ``sink`` rows
    are kept bf16 (``exclude``: and left out of their block's grid). ``per_layer``: {layer: (kq, vq)} overrides.
    ``taps``: a list that receives each layer's exact ``{"kpre", "k", "v"}`` rows (calibration)."""
    t = len(ids)
    pos = torch.arange(t)
    ang = pos.float()[:, None] * model.inv_freq[None, :]
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos(), ang.sin()
    x = model.embed_tokens(torch.tensor(ids))
    for li, layer in enumerate(model.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = a.qkv_proj(h).split(a.split, -1)
        qv = q.view(t, a.heads, a.head_dim)
        q = rope(qv, cos, sin)
        kpre = k.view(t, a.kv_heads, a.head_dim)
        k = rope(kpre, cos, sin)
        v = v.view(t, a.kv_heads, a.head_dim)
        if taps is not None:  # and each KV head's query energy per channel (summed over its query heads)
            qg = q.reshape(t, a.kv_heads, -1, a.head_dim)  # and its queries' second moment (transform coding)
            # A pre-RoPE key error e at position n moves the score of query m >= n by (R_n^T q_m) . e: the second
            # moment of R_n^T q_m over 8 key positions n <= m per query (drawn with a fixed seed)
            m_at = torch.arange(t).repeat_interleave(TAP_KEYS)
            n_at = (torch.rand(len(m_at), generator=torch.Generator().manual_seed(li)) * (m_at + 1)).long()
            qb = rope(q[m_at], cos[n_at], -sin[n_at]).reshape(len(m_at), a.kv_heads, -1, a.head_dim)
            taps.append({"kpre": kpre, "k": k, "v": v,
                         "qe": (q ** 2).view(t, a.kv_heads, -1, a.head_dim).sum((0, 2)),
                         "qepre": (qv ** 2).view(t, a.kv_heads, -1, a.head_dim).sum((0, 2)),
                         "qq": torch.einsum("tgqd,tgqe->gde", qg, qg),
                         "qqpre": torch.einsum("tgqd,tgqe->gde", qb, qb) / TAP_KEYS})
        fk, fv = (per_layer or {}).get(li, (kq, vq))
        if fk is not None:
            kin, kpin, vin = k, kpre, v
            if sink and exclude:  # the kept rows take no part in their block's grid: the next row stands in
                kin, kpin, vin = (torch.cat((y[sink:sink + 1].expand(sink, *y.shape[1:]), y[sink:]))
                                  for y in (k, kpre, v))
            # keys quantised before RoPE (RoPE applied to the dequantised key) where the quantiser says so
            kh = rope(fk(li, kpin, ctx), cos, sin) if getattr(fk, "pre_rope", False) else fk(li, kin, ctx)
            vh = fv(li, vin, ctx)
            if sink:
                kh = torch.cat((bf16(k[:sink]), kh[sink:]))
                vh = torch.cat((bf16(v[:sink]), vh[sink:]))
            k, v = kh, vh
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, scale=a.scale, enable_gqa=True)[0].transpose(0, 1)
        x = x + a.o_proj(o.reshape(t, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.norm(x)).float()


def held_out_texts(n=8):
    """The first ``n`` peer prompts of the held-out half (2, 3, 6, 7, 10, ...: apart from the ``tune`` prompts that
    :func:`texts` scores and :func:`calibration_texts` fits on), each with its 128 reference ids."""
    wl = json.loads((PEERS / "workload.json").read_text())
    ref = json.loads((PEERS / "reference_outputs_fp32.json").read_text())["outputs"]
    held = [i for i in range(len(wl["requests"])) if (i // 2) % 2 == 1][:n]
    return [(f"peer{i}", wl["requests"][i]["ids"] + list(ref[i]["ids"] if isinstance(ref[i], dict) else ref[i]))
            for i in held]


def contract_texts(tok):
    """``kvledger quality``'s texts (prose, code, chat) cut to its contexts (256 and 2,048 tokens), as it cuts
    them: an indication of the contract's per-text clause through this harness's fake quantisation, not the
    contract's own measurement (that runs the store)."""
    from kvledger.runtime.measure.quality import DEFAULT_CONTEXTS
    from kvledger.runtime.measure.quality_texts import quality_texts

    out = []
    for src in quality_texts(tok):
        ids = tok(src.text, add_special_tokens=False).input_ids
        out += [(f"{src.kind}:{n}", ids[:n]) for n in DEFAULT_CONTEXTS]
    return out


def texts(tok, more=False):
    """The tuning texts; ``more``: also the ``tune`` peer prompts that neither these nor the calibration use (20, 21,
    24, 25, 28 and 29), for choices these six do not resolve."""
    out = []
    for p in (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py", Path("/usr/share/common-licenses/Apache-2.0")):
        out.append(("text:" + p.name, tok(p.read_text(), add_special_tokens=False).input_ids[:512]))
    wl = json.loads((PEERS / "workload.json").read_text())
    ref = json.loads((PEERS / "reference_outputs_fp32.json").read_text())["outputs"]
    tune = [i for i in range(len(wl["requests"])) if (i // 2) % 2 == 0]
    for i in tune[:4] + (tune[10:] if more else []):
        r = ref[i]
        rid = r["ids"] if isinstance(r, dict) else r
        out.append((f"peer{i}", wl["requests"][i]["ids"] + list(rid)))
    return out


SEEDS = PEERS.parent / "seeds"  # the course module's text: prose no calibration, contract or held-out set uses


def texts_by_kind(tok):
    """Tuning texts in the contract's three kinds, two each, apart from every calibration text, every contract
    text and every held-out prompt: prose (the first two 512-token pieces of the course module's first seed
    text), code (the first 512 tokens of ``textwrap.py`` and of ``heapq.py``), chat (``tune`` peer prompts 0
    and 1 with their reference ids). Each kind weighs the same in :func:`kind_balanced_kl`."""
    seed = tok((SEEDS / "000_6bf96146bac364f5.txt").read_text(), add_special_tokens=False).input_ids
    out = [("prose:seed0a", seed[:512]), ("prose:seed0b", seed[512:1024])]
    for name in ("textwrap.py", "heapq.py"):
        text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()
        out.append((f"code:{name}", tok(text, add_special_tokens=False).input_ids[:512]))
    wl = json.loads((PEERS / "workload.json").read_text())
    ref = json.loads((PEERS / "reference_outputs_fp32.json").read_text())["outputs"]
    for i in (0, 1):
        r = ref[i]
        out.append((f"chat:peer{i}", wl["requests"][i]["ids"] + list(r["ids"] if isinstance(r, dict) else r)))
    return out


def kind_balanced_kl(names, kls):
    """The mean over kinds (the text name's prefix before ``:``) of each kind's KL over its positions."""
    kinds = {}
    for name, kl in zip(names, kls, strict=True):
        kinds.setdefault(name.split(":")[0], []).append(kl)
    return sum(torch.cat(v).mean().item() for v in kinds.values()) / len(kinds)


def kl_and_ppl(base, lg, ids):
    lp, lq = F.log_softmax(base[:-1], -1), F.log_softmax(lg[:-1], -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    tgt = torch.tensor(ids[1:])
    nll_b = -lp.gather(1, tgt[:, None]).squeeze(1)
    nll_q = -lq.gather(1, tgt[:, None]).squeeze(1)
    return kl, nll_b, nll_q


def allocate(scan, costs, layers, budget):
    """The per-layer choice of one key and one value quantiser (from ``scan``: ``{"k:NAME" | "v:NAME": [KL with
    only that layer quantised, per layer]}``, each costing ``costs[...]`` bytes per token and layer-head) with the
    least summed KL within ``budget`` bytes per token and layer-head on average (a knapsack over layers; the sum
    assumes the layers' KLs add, which the full scheme then checks). Returns ``(summed KL, bytes used, [(key,
    value) per layer])`` or None when nothing fits."""
    keys = [n.split(":", 1)[1] for n in scan if n.startswith("k:")]
    values = [n.split(":", 1)[1] for n in scan if n.startswith("v:")]
    cap = int(budget * layers)
    best = {0: (0.0, [])}  # bytes so far -> (least KL, choices): only the non-dominated states are kept
    for li in range(layers):
        nxt = {}
        for kn in keys:
            for vn in values:
                cost = costs["k:" + kn] + costs["v:" + vn]
                kl = scan["k:" + kn][li] + scan["v:" + vn][li]
                for used, (acc, picks) in best.items():
                    if used + cost <= cap and (used + cost not in nxt or nxt[used + cost][0] > acc + kl):
                        nxt[used + cost] = (acc + kl, picks + [(kn, vn)])
        best, floor = {}, math.inf
        for used, (acc, picks) in sorted(nxt.items()):
            if acc < floor:
                best[used], floor = (acc, picks), acc
    if not best:
        return None
    used, (acc, picks) = min(best.items(), key=lambda kv: kv[1][0])
    return acc, used / layers, picks


def per_layer_scan(model, ctx, data, bases, variants, ratio, shape):
    """KL with one layer's keys (or values) quantised and everything else exact (the sink row kept, as
    ``sink1``), for each ``k:NAME`` / ``v:NAME`` in ``variants`` and each layer; then the best per-layer mix
    within ``ratio`` (bytes per token at most bf16's / ratio) by :func:`allocate`."""
    scan, costs = {}, {}
    for var in variants:
        side, name = var.split(":")
        fq = quantiser(name, side, shape)
        if fq.bytes is None:
            raise SystemExit(f"--per-layer {var}: {name} has no byte figure to budget")
        scan[var], costs[var] = [], fq.bytes
        for li in range(len(model.layers)):
            t0 = time.time()
            kls = []
            for (_, ids), base in zip(data, bases, strict=True):
                pick = (fq, q_none) if side == "k" else (q_none, fq)
                lg = forward(model, ids, None, None, ctx, sink=1, per_layer={li: pick})
                kls.append(kl_and_ppl(base, lg, ids)[0])
            scan[var].append(torch.cat(kls).mean().item())
            print(f"{var:10s} layer {li:2d}  KL {scan[var][-1]:.2e}  ({time.time() - t0:.0f}s)", flush=True)
        print(f"{var:10s} summed over layers {sum(scan[var]):.3e}", flush=True)
    budget = shape.token_bytes("bf16") / shape.layer_heads / ratio  # bytes per token and layer-head
    mix = allocate(scan, costs, len(model.layers), budget)
    if mix is not None:
        kl, used, picks = mix
        counts = {f"{k}/{v}": picks.count((k, v)) for k, v in dict.fromkeys(picks)}
        print(f"best per-layer mix within {ratio}x ({budget:.1f} B a layer-head): summed KL {kl:.3e} at {used:.1f} B: "
              + ", ".join(f"{n} x{c}" for n, c in counts.items()), flush=True)
    else:
        print(f"no mix of these grids fits within {ratio}x ({budget:.1f} B a layer-head)", flush=True)
    return {"per_layer_kl": scan, "ratio": ratio, "budget_bytes_per_layer_head": budget,
            "best_mix": None if mix is None else {"summed_kl": mix[0], "bytes_per_layer_head": mix[1],
                                                  "per_layer": [f"{k}/{v}" for k, v in mix[2]]}}


def write_tables(source, ckpt, out, calibration, split=None):
    """kvtc's tables: the weighted entropy-coded transforms of pre-RoPE keys and of values at the format's page
    shares (``CODED_KEY_BYTES`` / ``CODED_VALUE_BYTES`` a head-row per 64 channels), saved for the runtime."""
    from kvledger.core.sizing.kv_formats import coded_row_bytes
    from kvledger.runtime import kv_transform_pages as ktp
    from kvledger.runtime.kv_transform import SideCode
    from kvledger.runtime.measure.quality_records import weights_revision

    kb, vb = split or (coded_row_bytes("k", HEAD_DIM), coded_row_bytes("v", HEAD_DIM))
    page = coded_row_bytes("k", HEAD_DIM) + coded_row_bytes("v", HEAD_DIM)
    if kb + vb != page:
        raise SystemExit(f"--split {kb}/{vb}: the page holds {page} bytes a head-row")
    # The sink row held in block 0's own slots (isink1, chosen on the tuning texts over fsink1: a first block laid
    # out apart, its held rows paid by every head, which the tables could carry as first_row_bytes)
    keys = SideCode.from_heads(source("kpre", 0, kb, False, "kltw"), 16)
    values = SideCode.from_heads(source("v", 0, vb, False, "kltw"), 16)
    revision = weights_revision(ckpt)
    path = Path(out) if out else ktp.path_for(revision)
    tables = ktp.TransformTables(keys, values, str(path))
    tables.to_file(path, revision=revision, calibration=calibration, key_bytes=kb, value_bytes=vb,
                   command="python benchmarks/kv_4bit_screen.py --write-tables")
    used = ktp.HEADER_BYTES + int(keys.slot_bytes.sum()) + int(values.slot_bytes.sum())
    first = ktp.HEADER_BYTES + int(keys.first_slot_bytes.sum()) + int(values.first_slot_bytes.sum())
    heads = keys.mu.shape[0] * keys.mu.shape[1]
    print(f"wrote {path}: a page uses {used} of {16 * heads * (kb + vb)} bytes (a first block's {first})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="tok4h/tok4h,kivi4/tok4h")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-layer", metavar="VARIANTS",
                    help="instead of --schemes: k:NAME,v:NAME,... each quantised one layer at a time (KL per layer), "
                         "then the best per-layer mix within --ratio")
    ap.add_argument("--ratio", type=float, default=3.5, help="bytes bound of --per-layer's mix, as bf16's / ratio")
    ap.add_argument("--held-out", action="store_true",
                    help="score 8 held-out peer prompts (never tuned or calibrated on) instead of the tuning texts")
    ap.add_argument("--calibration", choices=list(CALIBRATIONS), default="narrow",
                    help="the codebooks' calibration texts (calibration_texts): narrow, kinds (prose, code and chat "
                         "a third each) or wide")
    ap.add_argument("--wide-calibration", dest="calibration", action="store_const", const="wide",
                    help="fit the codebooks on 8 more texts (4 licences, 4 standard-library modules) as well")
    ap.add_argument("--more-tuning", action="store_true",
                    help="score the tuning texts and 6 more tune peer prompts (20, 21, 24, 25, 28, 29)")
    ap.add_argument("--tuning-by-kind", action="store_true",
                    help="score two tuning texts of each kind the contract scores (prose, code, chat) instead")
    ap.add_argument("--slack", type=int, default=0, metavar="WORDS",
                    help="entropy-coded blocks leave this many 16-bit words unused (0-16): a draw a few bytes from "
                         "the budget, to see how far a figure moves with the rate")
    ap.add_argument("--write-tables", nargs="?", const="", metavar="PATH",
                    help="instead of scoring: fit kvtc's tables (pklte/klte at the format's bytes, each layer weighed "
                         "by its measured cost) and write them where the runtime looks (default "
                         "kvledger/data/kv_transform/<weights revision>.pt)")
    ap.add_argument("--split", default=None, metavar="K/V",
                    help="with --write-tables: the keys' and values' bytes a head-row (default the format's, 33/40 at "
                         "64 channels; the page holds their sum)")
    ap.add_argument("--contract-texts", action="store_true",
                    help="score kvledger quality's texts at its contexts (an indication, fake-quantised) instead")
    args = ap.parse_args()
    if not 0 <= args.slack <= 16:
        ap.error("--slack must be in [0, 16] words")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    ckpt = resolve_model("smollm2-135m")
    model = load_decoder(ckpt, torch.float32, cached=False)
    tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    shape = Shape.of(model)
    sm = for_model(model)  # int4-smooth's shipped constants for these weights
    ctx = {"H": hadamard(shape.head_dim), "mu": sm.mean, "s": sm.scale,
           "codebooks": codebook_source(model, tok, args.calibration), "slack": args.slack}
    if args.write_tables is not None:
        split = tuple(int(b) for b in args.split.split("/")) if args.split else None
        write_tables(ctx["codebooks"], ckpt, args.write_tables, args.calibration, split)
        return
    data = (held_out_texts() if args.held_out else contract_texts(tok) if args.contract_texts
            else texts_by_kind(tok) if args.tuning_by_kind else texts(tok, args.more_tuning))
    bases = [forward(model, ids) for _, ids in data]
    if args.per_layer:
        found = per_layer_scan(model, ctx, data, bases, [v.strip() for v in args.per_layer.split(",")], args.ratio,
                               shape)
        print(json.dumps({"texts": [n for n, _ in data], **found}))
        return
    results = []
    for scheme in args.schemes.split(","):
        t0 = time.time()
        parts = scheme.split("/")
        kname, vname = parts[0], parts[1]
        fk, fv = quantiser(kname, "k", shape), quantiser(vname, "v", shape)
        if kname.endswith("j") != vname.endswith("j"):
            raise SystemExit(f"{scheme}: a joint budget (j) names both sides")
        ctx["split"] = (quantiser_bytes(kname, "k"), quantiser_bytes(vname, "v"))
        # sinkN: the first N rows kept bf16; xsinkN: and left out of block 0's per-channel ranges
        sink = int(parts[2].split("sink")[1]) if len(parts) > 2 and "sink" in parts[2] else 0
        exclude = len(parts) > 2 and parts[2].startswith("x")
        # isinkN: the sink rows live in block 0's own bytes (entropy-coded schemes), no page beside the blocks;
        # fsinkN: and block 0's page is allocated apart, the held rows' bytes spread over every head by the step
        in_block = len(parts) > 2 and parts[2][:1] in ("i", "f")
        ctx["first_bytes"] = len(parts) > 2 and parts[2].startswith("f")
        if in_block and not all((m := TRANSFORM.match(n)) is not None and m["ec"] for n in (kname, vname)):
            raise SystemExit(f"{scheme}: isinkN holds the sink in an entropy-coded block's bytes")
        ctx["held"] = sink if in_block else 0
        kls, nb, nq, worst = [], [], [], []
        for (_, ids), base in zip(data, bases, strict=True):
            lg = forward(model, ids, fk, fv, ctx, sink, exclude=exclude)
            kl, a, b = kl_and_ppl(base, lg, ids)
            kls.append(kl)
            nb.append(a)
            nq.append(b)
            worst.append((math.exp(b.mean()) / math.exp(a.mean()) - 1) * 100)
        kl = torch.cat(kls).mean().item()
        ppl = (math.exp(torch.cat(nq).mean()) / math.exp(torch.cat(nb).mean()) - 1) * 100
        bpt = shape.scheme_bytes(kname, vname)
        model_bytes = (getattr(fk, "model_bytes", 0) or 0) + (getattr(fv, "model_bytes", 0) or 0)
        results.append({"scheme": scheme, "bytes_per_token": bpt,
                        "ratio": bpt and round(shape.token_bytes("bf16") / bpt, 3),
                        "sink_bytes_per_sequence": 0 if in_block else shape.token_bytes("bf16") * sink,
                        "codebook_bytes_per_model": model_bytes, "kl": kl, "ppl_pooled_pct": ppl,
                        "ppl_per_text_pct": worst, "kl_per_text": [k.mean().item() for k in kls],
                        "slack_words": args.slack})
        if args.tuning_by_kind:
            results[-1]["kl_kind_balanced"] = kind_balanced_kl([n for n, _ in data], kls)
        print(f"{scheme:28s} B/token {bpt}  KL {kl:.3e}  ppl pooled {ppl:+.2f}%  per text " +
              " ".join(f"{w:+.1f}" for w in worst) + f"  ({time.time() - t0:.0f}s)"
              + (f"  kind-balanced KL {results[-1]['kl_kind_balanced']:.3e}" if args.tuning_by_kind else ""),
              flush=True)
    print(json.dumps({"texts": [n for n, _ in data], "results": results}))


if __name__ == "__main__":
    main()
