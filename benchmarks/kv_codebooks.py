"""Codebook quantisers for the 4-bit KV screen (benchmarks/kv_4bit_screen.py): Lloyd's k-means codebooks
learned on calibration rows, applied as product quantisation of a head's row. A row of ``D`` channels is cut
into ``D / d`` sub-vectors of ``d`` channels, each replaced by the index of its nearest centroid in its own
codebook of ``2 ** bits`` entries: ``d = 2`` pairs channel ``j`` with ``j + D / 2`` (the pairs RoPE turns
together, so a pre-RoPE codebook commutes with RoPE as CommVQ's does); ``d = 1`` is a per-channel
non-uniform scalar grid (KVQuant-style levels). An optional per-row scale (the row's RMS, fp16) is divided out
before the lookup and multiplied back after. Codebooks are per model (layer, KV head, sub-vector), not per
token: their bytes are stated apart from the bytes per token. Below them, transform coding in a calibrated,
metric-whitened basis: fixed-rate levels (:func:`fit_transform`) and entropy-coded uniform steps under a byte budget
a block (fitted by ``kvledger.runtime.kv_transform_fit``, coded by :func:`ec_quantise` into the runtime's slots,
``kvledger.runtime.kv_transform``; rANS by ``kvledger.runtime.kv_entropy``'s native coder).
"""

from __future__ import annotations

import torch

from kvledger.runtime import kv_entropy as ke
from kvledger.runtime import kv_transform as kt
from kvledger.runtime.kv_transform_fit import FLUSH_BYTES, symbol_bits, whitened_klt


def pair_order(dim: int, d: int) -> torch.Tensor:
    """Channel order that puts each sub-vector's channels side by side: for ``d = 1`` the identity; for even
    ``d``, RoPE pairs ``(j, j + dim / 2)`` in turn, ``d / 2`` consecutive pairs to a sub-vector."""
    if d == 1:
        return torch.arange(dim)
    if d % 2 or dim % d:
        raise ValueError(f"sub-vector width {d} must be 1 or an even divisor of {dim}")
    half = dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), -1).reshape(-1)


def to_subvectors(x: torch.Tensor, d: int) -> torch.Tensor:
    """``[..., D]`` -> ``[..., D / d, d]`` in :func:`pair_order`."""
    return x[..., pair_order(x.shape[-1], d)].reshape(*x.shape[:-1], x.shape[-1] // d, d)


def from_subvectors(s: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_subvectors`."""
    dim = s.shape[-2] * s.shape[-1]
    flat = s.reshape(*s.shape[:-2], dim)
    out = torch.empty_like(flat)
    out[..., pair_order(dim, s.shape[-1])] = flat
    return out


def nearest(x: torch.Tensor, cb: torch.Tensor, chunk_elems: int = 2 ** 22) -> torch.Tensor:
    """Index of the nearest centroid (squared Euclidean) per group: ``x [G, N, d]``, ``cb [G, k, d]`` ->
    ``[G, N]`` int64. One batched product per chunk: ``[x, 1] . [-2c, |c|^2]`` is ``|x - c|^2 - |x|^2``."""
    g, n, _ = x.shape
    k = cb.shape[1]
    xa = torch.cat((x, torch.ones(g, n, 1)), -1)
    ca = torch.cat((-2 * cb, (cb * cb).sum(-1, keepdim=True)), -1).transpose(1, 2).contiguous()
    out = torch.empty(g, n, dtype=torch.long)
    step = max(1, chunk_elems // max(1, g * k))
    for i in range(0, n, step):
        out[:, i:i + step] = torch.bmm(xa[:, i:i + step], ca).argmin(-1)
    return out


def grid_init(x: torch.Tensor, k: int) -> torch.Tensor:
    """Initial centroids for ``d`` of 1 or 2: the product of per-channel quantiles (``k`` of them for one
    channel; ``2 ** ceil(b / 2)`` by ``2 ** floor(b / 2)`` for two), at the midpoints ``(i + 0.5) / m``."""
    g, n, d = x.shape
    bits = k.bit_length() - 1
    if d not in (1, 2) or 2 ** bits != k:
        raise ValueError("grid_init takes 1 or 2 channels and a power-of-two k")
    sizes = [k] if d == 1 else [2 ** ((bits + 1) // 2), 2 ** (bits // 2)]
    axes = [torch.quantile(x[..., c], (torch.arange(m) + 0.5) / m, dim=1).T for c, m in enumerate(sizes)]
    if d == 1:
        return axes[0][..., None]
    a, b = axes  # [G, m0], [G, m1]
    return torch.stack((a[:, :, None].expand(-1, -1, sizes[1]), b[:, None, :].expand(-1, sizes[0], -1)), -1
                       ).reshape(g, k, 2)


def kmeans(x: torch.Tensor, k: int, iters: int = 12) -> torch.Tensor:
    """Lloyd's k-means per group, ``x [G, N, d]`` (d of 1 or 2) -> centroids ``[G, k, d]`` (fp32),
    deterministic: :func:`grid_init`, then ``iters`` rounds of assign-and-average. A centroid left with no
    points keeps its place."""
    x = x.float()
    g, n, d = x.shape
    cb = grid_init(x, k)
    for _ in range(iters):
        idx = nearest(x, cb)
        sums = torch.zeros(g, k, d).scatter_add_(1, idx[..., None].expand(g, n, d), x)
        counts = torch.zeros(g, k).scatter_add_(1, idx, torch.ones(g, n))
        cb = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], cb)
    return cb


def row_scale(x: torch.Tensor) -> torch.Tensor:
    """A row's RMS over its last axis, rounded to fp16 (what a per-row scale stores), never below 1e-6."""
    return x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6).half().float()


def fit(x: torch.Tensor, d: int, bits: int, scaled: bool, iters: int = 12, max_rows: int = 8192) -> torch.Tensor:
    """Codebooks for rows ``x [N, H, D]`` (one set per head): ``[H, D / d, 2 ** bits, d]``, rounded to fp16.
    ``scaled``: learned on the rows divided by their :func:`row_scale`. At most ``max_rows`` rows are used
    (evenly spaced)."""
    if x.shape[0] > max_rows:
        x = x[torch.linspace(0, x.shape[0] - 1, max_rows).long()]
    if scaled:
        x = x / row_scale(x)
    s = to_subvectors(x.float(), d)  # [N, H, G, d]
    n, h, g, _ = s.shape
    cb = kmeans(s.permute(1, 2, 0, 3).reshape(h * g, n, d), 2 ** bits, iters)
    return cb.half().float().view(h, g, 2 ** bits, d)


def encode(x: torch.Tensor, cb: torch.Tensor, scaled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``x [N, H, D]`` -> codes ``[N, H, D / d]`` (int64, each in ``[0, 2 ** bits)``) and the fp16 row
    scales ``[N, H, 1]`` (None unless ``scaled``)."""
    h, g, k, d = cb.shape
    s = row_scale(x) if scaled else None
    sub = to_subvectors(x.float() / s if scaled else x.float(), d)  # [N, H, G, d]
    n = sub.shape[0]
    codes = nearest(sub.permute(1, 2, 0, 3).reshape(h * g, n, d), cb.reshape(h * g, k, d))
    return codes.view(h, g, n).permute(2, 0, 1), s


def decode(codes: torch.Tensor, cb: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """Codes ``[N, H, G]`` (and row scales) -> rows ``[N, H, D]``."""
    h, g, _, d = cb.shape
    hi = torch.arange(h)[None, :, None]
    gi = torch.arange(g)[None, None, :]
    x = from_subvectors(cb[hi, gi, codes])
    return x * s if s is not None else x


def code_bytes(dim: int, d: int, bits: int, scaled: bool) -> float:
    """Bytes per row and head: the packed codes, plus 2 for an fp16 row scale."""
    return dim // d * bits / 8 + (2 if scaled else 0)


def codebook_bytes(layers: int, heads: int, dim: int, d: int, bits: int) -> int:
    """Bytes of one model's codebooks at fp16: per layer, head and sub-vector, ``2 ** bits`` entries of ``d``."""
    return layers * heads * (dim // d) * 2 ** bits * d * 2


def allocate(err: torch.Tensor, total_bits: int, max_bits: int = 8) -> torch.Tensor:
    """Bits per channel ``[G]`` summing to ``total_bits``, handed out one at a time (greedy), each to the channel
    whose modelled error it cuts most (ties: the lower index): channel ``c`` at ``b`` bits is modelled as
    ``err[c] * 4 ** -b`` (a scalar quantiser's error falls 4x a bit). ``err``: what the channel's error costs
    at 0 bits (its variance times the weight of its error downstream)."""
    if total_bits > max_bits * err.numel():
        raise ValueError(f"{total_bits} bits do not fit {err.numel()} channels of at most {max_bits}")
    bits = torch.zeros(err.numel(), dtype=torch.long)
    err = err.double().flatten()
    for _ in range(total_bits):
        gain = torch.where(bits < max_bits, err * 0.75 * 4.0 ** -bits.double(), -1.0)
        bits[int(gain.argmax())] += 1
    return bits


def fit_allocated(x: torch.Tensor, weight: torch.Tensor, total_bits: int, iters: int = 12,
                  max_bits: int = 8, max_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel levels for rows ``x [N, H, D]`` with :func:`allocate`'s bits per channel (per head, ``total_bits``
    a row), the error cost of channel ``c`` its variance times ``weight [H, D]``. Returns the bits ``[H, D]`` and
    codebooks ``[H, D, 2 ** max_bits, 1]`` (fp16-rounded) usable by :func:`encode`/:func:`decode` with ``d = 1``: a
    channel of ``b`` bits holds its ``2 ** b`` levels first, the rest copies of its first level (the lower index
    wins a tie, so its codes stay below ``2 ** b``). A channel of 0 bits is its calibration mean."""
    if x.shape[0] > max_rows:
        x = x[torch.linspace(0, x.shape[0] - 1, max_rows).long()]
    x = x.float()
    h, dim = x.shape[1:]
    bits = torch.stack([allocate(weight[i] * x[:, i].var(0), total_bits, max_bits) for i in range(h)])
    cb = torch.empty(h, dim, 2 ** max_bits, 1)
    for b in bits.unique().tolist():
        hs, cs = (bits == b).nonzero(as_tuple=True)
        levels = kmeans(x[:, hs, cs].T[..., None], 2 ** b, iters)  # [G_b, 2 ** b, 1]
        cb[hs, cs] = torch.cat((levels, levels[:, :1].expand(-1, 2 ** max_bits - 2 ** b, 1)), 1)
    return bits, cb.half().float()


def allocate_table(err: torch.Tensor, budget: float, first_cost: float) -> torch.Tensor:
    """Bits per channel from a table of modelled errors ``err [G, B + 1]`` (channel ``c`` at ``b`` bits), greedy on
    the table's lower hull: each step buys, for some channel, the move from its bits ``b`` to the ``b' > b`` that
    cuts the most error per bit spent (a jump of several bits when its first bits alone gain little: a 1-bit
    grid over a block's range can be worse than none), while the ``budget`` (bits) lasts; a channel's first bit
    costs ``first_cost`` (1 plus its per-block metadata, per row), later ones 1. Ties: the lower channel, then
    the smaller move."""
    g, top = err.shape[0], err.shape[1] - 1
    err = err.double()
    bits = torch.zeros(g, dtype=torch.long)
    rows = torch.arange(g)
    to = torch.arange(top + 1)
    left = float(budget)
    while True:
        cost = (to[None, :] - bits[:, None]).double() + torch.where(bits == 0, first_cost - 1, 0.0).double()[:, None]
        gain = (err[rows, bits][:, None] - err) / cost.clamp_min(1e-9)
        ok = (to[None, :] > bits[:, None]) & (cost <= left + 1e-9)
        gain = torch.where(ok, gain, -1.0)
        best = int(gain.flatten().argmax())
        c, nb = divmod(best, top + 1)
        if gain[c, nb] <= 0:
            return bits
        left -= float(cost[c, nb])
        bits[c] = nb


def block_errors(x: torch.Tensor, weight: torch.Tensor, bs: int = 16, max_bits: int = 8) -> torch.Tensor:
    """Modelled error table ``[H, D, max_bits + 1]`` of rows ``x [N, H, D]`` under per-block (``bs`` rows) asymmetric
    grids: at ``b >= 1`` bits ``weight * E[range^2] / (12 (2^b - 1)^2)`` (a uniform grid's error over the block's
    range), at 0 bits ``weight * variance`` (the channel left at its calibration mean)."""
    n = x.shape[0] // bs * bs
    xb = x[:n].float().view(-1, bs, *x.shape[1:])
    r2 = ((xb.amax(1) - xb.amin(1)) ** 2).mean(0)  # [H, D]
    steps = (2.0 ** torch.arange(1, max_bits + 1) - 1) ** 2
    err = torch.cat(((x.float().var(0))[..., None], r2[..., None] / (12 * steps)), -1)
    return weight[..., None] * err


def block_allocated(x: torch.Tensor, bits: torch.Tensor, mean: torch.Tensor, bs: int = 16) -> torch.Tensor:
    """Rows ``x [N, H, D]`` through per-block (``bs`` rows) per-channel asymmetric grids of ``bits [H, D]`` bits
    (fp16 step and minimum a channel and block; the last block padded with copies of the last row); channels of 0
    bits are their calibration ``mean [H, D]``."""
    t = x.shape[0]
    pad = (-t) % bs
    xp = torch.cat((x, x[-1:].expand(pad, *x.shape[1:]))) if pad else x
    xb = xp.view(-1, bs, *x.shape[1:])
    lo, hi = xb.amin(1, keepdim=True), xb.amax(1, keepdim=True)
    n = (2.0 ** bits - 1).clamp_min(1)
    s = ((hi - lo) / n).clamp_min(2.0 ** -14).half().float()  # fp16's smallest normal: a flat block stays finite
    lo = lo.half().float()
    q = ((xb - lo) / s).round().clamp(torch.zeros_like(n), n) * s + lo
    q = torch.where(bits > 0, q, mean.expand_as(q))
    return q.reshape(-1, *x.shape[1:])[:t]


# ---- transform coding: a calibrated, metric-whitened KLT with water-filled bits and static levels ----

def fit_transform(x: torch.Tensor, metric: torch.Tensor, total_bits: int, iters: int = 12, max_bits: int = 8,
                  max_rows: int = 8192) -> dict:
    """Transform coding of one head's rows ``x [N, D]`` under the error metric ``metric [D, D]`` (what an error
    ``e`` costs is ``e M e^T``: for keys the queries' second moment, since a score moves by ``q . e``; for values
    the ``o_proj`` columns' Gram matrix). Rows are centred on their calibration mean, whitened by ``M^1/2`` (so
    the metric becomes the plain squared error) and turned onto the whitened rows' principal axes (the KLT,
    whose coefficients are uncorrelated); :func:`allocate` hands ``total_bits`` a row to the coefficients by their
    variance (reverse water-filling), and each coefficient of ``b`` bits gets ``2 ** b`` k-means levels (0 bits:
    the coefficient is its mean, 0). No per-row metadata: a row is its codes alone. Returns ``mu [D]``, ``T [D, D]``
    (``y = (x - mu) T``), ``Ti`` (``x = y Ti + mu``; ``Ti M Ti^T = I``), ``bits [D]`` and ``levels [D, 2 ** max_bits]``
    (fp16-rounded; a coefficient's unused entries repeat its first level)."""
    mu, t, ti, y = whitened_klt(x, metric)
    y = y.float()
    bits = allocate(y.var(0), total_bits, max_bits)
    if len(y) > max_rows:
        y = y[torch.linspace(0, len(y) - 1, max_rows).long()]
    levels = torch.zeros(y.shape[1], 2 ** max_bits)
    for b in bits.unique().tolist():
        if b == 0:
            continue
        cs = (bits == b).nonzero(as_tuple=True)[0]
        lv = kmeans(y[:, cs].T[..., None].contiguous(), 2 ** b, iters)[..., 0]  # [G_b, 2 ** b]
        levels[cs] = torch.cat((lv, lv[:, :1].expand(-1, 2 ** max_bits - 2 ** b)), 1)
    return {"mu": mu.float(), "T": t.float(), "Ti": ti.float(), "bits": bits, "levels": levels.half().float()}


def transform_codes(x: torch.Tensor, f: dict) -> torch.Tensor:
    """Rows ``x [N, D]`` -> each coefficient's level index ``[N, D]`` (below ``2 ** bits`` of its coefficient)."""
    y = (x.float() - f["mu"]) @ f["T"]
    return (y[..., None] - f["levels"]).abs().argmin(-1)


def transform_decode(codes: torch.Tensor, f: dict) -> torch.Tensor:
    """Codes ``[N, D]`` -> rows ``[N, D]``: the levels, turned back and un-whitened, plus the mean."""
    return f["levels"].gather(1, codes.T).T @ f["Ti"] + f["mu"]


def transform_bytes(layers: int, heads: int, dim: int, max_bits: int = 8) -> int:
    """Per-model bytes of the transforms at fp16: per layer and head ``T``, ``Ti``, the mean and the levels."""
    return layers * heads * (2 * dim * dim + dim + dim * 2 ** max_bits) * 2


# ---- entropy-coded transform coding: the same basis, one uniform step a block under a byte budget ----
# The fits (basis, models, base step, shared weighted steps) are the runtime's (kvledger.runtime.kv_transform_fit,
# which says why a uniform step, entropy-coded, beats fixed-rate levels); a block is coded into the runtime's slots
# (kvledger.runtime.kv_transform): one byte naming its step, the smallest of :data:`STEP_CODES` whose coded words
# fit the block's bytes, as a paged store needs.

STEP_CODES = ke.STEP_CODES  # the block's step: base * 2 ** ((code - 128) / 8), one byte
STEP_BYTES = kt.STEP_BYTES  # a block's step code
# An adaptive block (``adapt``) also names, in one more byte, a multiplier of every coefficient's deviation in the
# coder's model, so a block whose coefficients are spread wider or narrower than the calibration rows' (another kind
# of text) is coded under a model that fits it: the multiplier with the smallest modelled step is kept.
MODEL_SCALES = 2.0 ** ((torch.arange(8, dtype=torch.float64) - 3) / 2)
SYMBOL_RANGE = ke.SYMBOL_MAX  # symbols lie in [-SYMBOL_RANGE, SYMBOL_RANGE - 1] (clamped), the coder's alphabet


def block_rows(n: int, bs: int) -> torch.Tensor:
    """Rows of each block of ``bs`` over ``n`` rows (the last may be short): ``[ceil(n / bs)]`` int64."""
    rows = torch.full((-(-n // bs),), bs, dtype=torch.long)
    if n % bs:
        rows[-1] = n % bs
    return rows


def to_symbols(y: torch.Tensor, step: torch.Tensor | float) -> torch.Tensor:
    """Coefficients ``y`` on the grid of ``step``: the nearest integers, clamped to the coder's alphabet."""
    return (y / step).round().clamp(-SYMBOL_RANGE, SYMBOL_RANGE - 1)


def transform_ec_bytes(layers: int, heads: int, dim: int) -> int:
    """Per-model bytes of the entropy-coded transforms: per layer and head ``T``, ``Ti``, the mean and each
    coefficient's deviation at fp16, a byte a coefficient naming its model, and the base step at fp32."""
    return layers * heads * ((2 * dim * dim + 2 * dim) * 2 + dim + 4)


def step_of(base: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The step a block's byte ``code`` names: ``base * 2 ** ((code - 128) / 8)``."""
    return base * ke.step_rel(code)


block_budget = kt.block_bytes  # bytes of a block of ``rows`` rows at ``nbytes`` a row, rounded down


def ec_quantise(x: torch.Tensor, f: dict, adapt: bool = False, slack_words: int = 0, held: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``x [N, D]`` through ``kv_transform_fit.fit_transform_ec``'s code: per block of ``bs`` rows (the last may be
    short) the smallest step whose coded block (header plus the coder's 16-bit words, ``kvledger.runtime.kv_entropy``)
    fits ``nbytes`` a row, found on the real coded sizes. The header is the step's byte and, where ``adapt``, a byte
    naming the model's deviation multiplier (:data:`MODEL_SCALES`; the one whose modelled step is smallest, then whose
    modelled bits are fewest). Returns the decoded rows, each block's step code ``[B]``, multiplier code ``[B]`` (0 ..
    7; where not ``adapt`` always the multiplier 1's) and bytes ``[B]`` (header, held rows and words). Without ``adapt``
    the blocks are the runtime's slots (``kvledger.runtime.kv_transform.SideCode``), written and read back, and a block
    that fits at no step is an error; an ``adapt`` block that fits at none keeps the largest (its bytes then exceed the
    budget; the returned bytes say so). ``slack_words`` leaves that many of a block's 16-bit words unused: a draw a few
    bytes from the budget. ``held`` first rows (a sequence's first tokens, kept at bf16) are not coded: block 0 holds
    them at bf16 in its own bytes (``2 D`` a row) and codes its other rows in the rest, so they cost no page beside the
    blocks."""
    n, bs, d = x.shape[0], f["bs"], x.shape[1]
    if not 0 <= held < min(bs, n):
        raise ValueError(f"held rows {held} must leave block 0 a row to code")
    unit = int((MODEL_SCALES == 1).nonzero()[0])
    full = block_rows(n, bs)  # each block's rows, held ones included: what its bytes are
    if not adapt:  # the runtime's slots (kvledger.runtime.kv_transform), written and read back
        code = kt.SideCode.from_heads([[f]], bs)
        xb = torch.cat((x, torch.zeros(len(full) * bs - n, d, dtype=x.dtype))).view(-1, bs, d)
        parts = [(slice(0, 1), held), (slice(1, None), 0)] if held else [(slice(None), 0)]
        out = []
        for sl, h in parts:
            if len(full[sl]):
                slots, codes, used = code.encode(0, 0, xb[sl], full[sl], held=h, spare_words=slack_words)
                out.append((code.decode(0, 0, slots, full[sl], held=h), codes, used))
        xq = torch.cat([o[0] for o in out]).reshape(-1, d)[:n]
        codes = torch.cat([o[1] for o in out])
        return xq.to(x.dtype), codes, torch.full((len(full),), unit), torch.cat([o[2] for o in out])
    header = STEP_BYTES + 1
    rows = full.clone()
    rows[0] -= held
    nblocks = len(rows)
    y = (x.double() - f["mu"].double()) @ f["T"].double()
    pad = torch.zeros(nblocks * bs - n + held, d, dtype=y.dtype)
    # block 0's coded rows first in their block (the coder reads a block's first rows), the rest padded after
    yb = torch.cat((y[held:int(full[0])], pad[:held], y[int(full[0]):], pad[held:])).view(-1, bs, d)
    budget = block_budget(full, f["nbytes"])  # bytes a block
    budget[0] -= held * d * kt.HELD_ELEMENT_BYTES
    scale_code = model_scale_codes(yb, rows, f, budget - header)
    base = float(f["base"])
    deviation = f["sigma"].double()[None] * MODEL_SCALES[scale_code][:, None] / base  # in base steps
    code, nwords, _ = ke.fit_blocks(yb / base, rows, ke.class_of(deviation), f["laplace"],
                                    (budget - header) // 2 - slack_words)
    k = ke.symbols(yb / base, code).double()
    qb = k * step_of(f["base"], code.long())[:, None, None]
    q = torch.cat((y[:held], qb[0, :int(rows[0])], qb[1:].reshape(-1, d)))[:n]
    used = header + 2 * nwords.long()
    used[0] += held * d * kt.HELD_ELEMENT_BYTES  # the held rows' bytes, as the slots count them
    xq = (q @ f["Ti"].double() + f["mu"].double()).to(x.dtype)
    xq[:held] = x[:held].to(torch.bfloat16).to(x.dtype)  # the held rows at bf16, as the slots keep them
    return xq, code.long(), scale_code, used


def model_scale_codes(yb: torch.Tensor, rows: torch.Tensor, f: dict, budget: torch.Tensor) -> torch.Tensor:
    """Per block of ``yb [B, bs, D]`` (coefficients; rows past ``rows[b]`` ignored) the :data:`MODEL_SCALES` code
    whose modelled bits fit ``budget[b]`` bytes (less the coder's state) at the smallest step, then in the fewest
    bits: the model that fits the block's spread."""
    nblocks, bs = yb.shape[0], yb.shape[1]
    live = (torch.arange(bs)[None] < rows[:, None])[..., None]
    sig = f["sigma"].double()[None] * MODEL_SCALES[:, None]  # [S, D]

    def modelled(code):  # code [S, B] -> modelled bits [S, B]
        step = step_of(f["base"], code)[..., None, None]
        k = to_symbols(yb, step)
        return (symbol_bits(k, step, sig[:, None, None, :], f["laplace"]) * live).sum((-2, -1))

    lo = torch.zeros(len(MODEL_SCALES), nblocks, dtype=torch.long)  # the modelled answer lies in [lo, hi]
    hi = torch.full((len(MODEL_SCALES), nblocks), STEP_CODES - 1, dtype=torch.long)
    while bool((lo < hi).any()):
        mid = (lo + hi) // 2
        fits = modelled(mid) <= (budget - FLUSH_BYTES) * 8
        hi = torch.where(fits & (lo < hi), mid, hi)
        lo = torch.where(~fits & (lo < hi), mid + 1, lo)
    return (lo * 2 ** 40 + modelled(lo).round().long()).argmin(0)  # the smallest step, then the fewest bits
