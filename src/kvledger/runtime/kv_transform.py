"""Transform-coded KV blocks: one head's block of K (before RoPE) or V rows in a calibrated, metric-whitened
principal basis, entropy-coded into a slot of fixed bytes.

Per layer and KV head a side's code holds the calibration mean ``mu``, the turn ``T`` (``y = (x - mu) T``: the
rows whitened by what an error costs -- keys: the second moment of the queries that read them, turned back to the
key's position; values: the Gram matrix of the ``o_proj`` columns that read them -- and turned onto the whitened
rows' principal axes) and its inverse, each coefficient's calibrated deviation and model (a Gaussian or a
Laplacian), the base step and the head's bytes a row. A block of ``R`` rows is coded at one step, ``base * 2 **
((code - 128) / 8)``, the smallest whose coded words fit the slot (``kvledger.runtime.kv_entropy``: rANS under
the static models, rate control in the native kernels), so a page of fixed bytes always holds it.

Slot layout (``slot_bytes`` for a whole block; a short block is given its rows' share, rounded down): byte 0 the
step code; then the block's ``held`` first rows at bf16 (a sequence's first token, kept exact, paid from the
block's own bytes); then the coder's 16-bit words, little-endian; then zeros. The decoder needs no word count: a
slot whose words past the ones it reads are not zero, or that does not end on the coder's initial state, is
refused (corrupt, never wrong).

The tables come from calibration (``benchmarks/kv_4bit_screen.py`` fits them today; docs/kv_formats.md,
"Entropy-coded transform coding").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from . import kv_entropy as ke

STEP_BYTES = 1  # the slot's first byte: its step code
STATE_BYTES = 4  # the coder's final state, the two 16-bit words every coded block starts with
HELD_ELEMENT_BYTES = 2  # a held row's values at bf16


@dataclass(frozen=True, slots=True)
class SideCode:
    """One side's tables (keys before RoPE, or values) for every layer and KV head."""

    mu: torch.Tensor  # [L, H, D] float64
    turn: torch.Tensor  # [L, H, D, D] float64: y = (x - mu) @ turn
    back: torch.Tensor  # [L, H, D, D] float64: x = y @ back + mu
    sigma: torch.Tensor  # [L, H, D] float64: each coefficient's calibrated deviation
    laplace: torch.Tensor  # [L, H, D] bool: a Laplacian model (else a Gaussian)
    base: torch.Tensor  # [L, H] float64: the step that code 128 names
    row_bytes: torch.Tensor  # [L, H] float64: the head's bytes a row (a block of R rows: floor(R * row_bytes))
    block_size: int
    # [L, H] float64: the same for a block with held rows (a sequence's first), its page laid out apart (None: as
    # every block): the held rows' bytes spread over every head by the shared step, not each head paying its own
    first_row_bytes: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mu.dim() != 3:
            raise ConfigError(f"mu must be [layers, heads, dim], got {tuple(self.mu.shape)}")
        lhd = tuple(self.mu.shape)
        lh, d = lhd[:2], lhd[2]
        for name, t, shape in (("turn", self.turn, (*lhd, d)), ("back", self.back, (*lhd, d)),
                               ("sigma", self.sigma, lhd), ("laplace", self.laplace, lhd), ("base", self.base, lh),
                               ("row_bytes", self.row_bytes, lh),
                               *((("first_row_bytes", self.first_row_bytes, lh),)
                                 if self.first_row_bytes is not None else ())):
            if tuple(t.shape) != shape:
                raise ConfigError(f"{name} must be {list(shape)}, got {list(t.shape)}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be at least 1, got {self.block_size}")
        if not bool((self.base > 0).all()) or not bool((self.sigma > 0).all()):
            raise ConfigError("steps and deviations must be positive")
        least = STEP_BYTES + STATE_BYTES
        if bool((self.slot_bytes < least).any()) or bool((self.first_slot_bytes < least).any()):
            raise ConfigError(f"every slot needs at least {least} bytes; the smallest is {int(self.slot_bytes.min())}")

    @classmethod
    def from_heads(cls, heads: list[list[dict]], block_size: int) -> SideCode:
        """From per-layer lists of per-head fits (``mu``, ``T``, ``Ti``, ``sigma``, ``laplace``, ``base``,
        ``nbytes``: what the calibration's fits return)."""
        def stack(key: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.stack([torch.stack([torch.as_tensor(h[key]).to(dtype) for h in layer]) for layer in heads])
        first = stack("nbytes_first", torch.float64) if "nbytes_first" in heads[0][0] else None
        return cls(stack("mu", torch.float64), stack("T", torch.float64), stack("Ti", torch.float64),
                   stack("sigma", torch.float64), stack("laplace", torch.bool), stack("base", torch.float64),
                   stack("nbytes", torch.float64), block_size, first)

    @property
    def slot_bytes(self) -> torch.Tensor:
        """``[L, H]`` int64: the bytes of a whole block's slot."""
        return block_bytes(torch.tensor(self.block_size), self.row_bytes)

    @property
    def first_slot_bytes(self) -> torch.Tensor:
        """``[L, H]`` int64: the bytes of a whole block's slot where the block holds rows at bf16."""
        return block_bytes(torch.tensor(self.block_size), self._rows_bytes(True))

    def _rows_bytes(self, held: bool) -> torch.Tensor:
        return self.first_row_bytes if held and self.first_row_bytes is not None else self.row_bytes

    def _head(self, layer: int, head: int) -> tuple[torch.Tensor, ...]:
        return (self.mu[layer, head], self.turn[layer, head], self.back[layer, head], self.sigma[layer, head],
                self.laplace[layer, head], self.base[layer, head])

    def encode(self, layer: int, head: int, x: torch.Tensor, rows: torch.Tensor | None = None,
               held: int = 0, spare_words: int = 0, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Blocks ``x [N, R, D]`` of one head (``R <= block_size``; block ``b`` holds its first ``rows[b]`` rows,
        all ``R`` by default) into slots ``[N, slot_bytes]`` uint8, each at the smallest step whose words fit its
        bytes: ``floor(rows * row_bytes)``, less ``held`` rows at bf16 (its first rows, kept exact; ``held <
        rows``) and ``spare_words`` words left unused. ``skip``: the block's first rows are not in the slot at all
        (the caller keeps them; the other rows have the whole slot). Returns the slots, each block's step code
        ``[N]`` and the bytes it uses ``[N]``. A block that fits at no step is a :class:`ConfigError` (its rows
        are not finite-sized for this code: values no calibration row came near)."""
        n, r, d = x.shape
        if r > self.block_size:
            raise ConfigError(f"a block holds at most {self.block_size} rows, got {r}")
        rows = torch.full((n,), r, dtype=torch.long) if rows is None else rows.long()
        if held and skip:
            raise ConfigError("a block's first rows are held in its slot or kept apart, not both")
        apart = held + skip
        if n and (not bool(((rows >= 1) & (rows <= r)).all()) or not 0 <= apart < int(rows.min())):
            raise ConfigError(f"each block needs 1 to {r} rows and more than its {apart} held rows")
        mu, turn, _, sigma, laplace, base = self._head(layer, head)
        per_row = self._rows_bytes(held > 0)[layer, head]
        budget = block_bytes(rows, per_row) - STEP_BYTES - held * d * HELD_ELEMENT_BYTES
        words = budget // 2 - spare_words
        y = (x.double() - mu) @ turn / base
        coded = torch.zeros_like(y)  # the coded rows first in their block (the coder reads a block's first rows)
        coded[:, :r - apart] = y[:, apart:]
        class0 = ke.class_of(sigma / base)[None].expand(n, d)
        codes, nwords, w = ke.fit_blocks(coded, rows - apart, class0, laplace, words)
        if bool((nwords > words).any()):
            bad = int((nwords > words).nonzero()[0])
            raise ConfigError(f"layer {layer} head {head} block {bad}: fits its {int(budget[bad])} bytes at no step")
        slot = int(block_bytes(torch.tensor(self.block_size), per_row))
        out = torch.zeros(n, slot, dtype=torch.uint8)
        out[:, 0] = codes.to(torch.uint8)
        at = STEP_BYTES
        if held:
            hb = x[:, :held].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, -1)
            out[:, at:at + hb.shape[1]] = hb
            at += hb.shape[1]
        cap = (slot - at) // 2
        w = w[:, :cap].to(torch.int64)
        out[:, at:at + 2 * w.shape[1]:2] = (w & 0xFF).to(torch.uint8)
        out[:, at + 1:at + 2 * w.shape[1]:2] = (w >> 8).to(torch.uint8)
        return out, codes.long(), at + 2 * nwords.long()

    def decode(self, layer: int, head: int, slots: torch.Tensor, rows: torch.Tensor | None = None,
               held: int = 0, skip: int = 0) -> torch.Tensor:
        """:meth:`encode`'s inverse: slots ``[N, slot_bytes]`` uint8 -> rows ``[N, R, D]`` float32 (``R`` the
        block size; rows past ``rows[b]`` decode as symbols 0, the mean; the ``skip`` rows kept apart are zero).
        A corrupt slot is a :class:`RuntimeError`."""
        if held and skip:
            raise ConfigError("a block's first rows are held in its slot or kept apart, not both")
        if skip:
            n, r = slots.shape[0], self.block_size
            coded = (torch.full((n,), r, dtype=torch.long) if rows is None else rows.long()) - skip
            x = torch.zeros(n, r, self.mu.shape[2])
            x[:, skip:] = self.decode(layer, head, slots, coded)[:, :r - skip]
            return x
        n, d, r = slots.shape[0], self.mu.shape[2], self.block_size
        rows = torch.full((n,), r, dtype=torch.long) if rows is None else rows.long()
        mu, _, back, sigma, laplace, base = self._head(layer, head)
        codes = slots[:, 0].to(torch.int32)
        at = STEP_BYTES + held * d * HELD_ELEMENT_BYTES
        cap = (slots.shape[1] - at) // 2
        if bool(slots[:, at + 2 * cap:].any()):
            raise RuntimeError("transform-coded slot: its last byte (past the words) is not zero (corrupt slot)")
        b = slots[:, at:at + 2 * cap].to(torch.int32)
        words = b[:, 0::2] | (b[:, 1::2] << 8)
        class0 = ke.class_of(sigma / base)[None].expand(n, d)
        k = ke.decode_blocks(words, torch.zeros(n, dtype=torch.int32), codes, rows - held, class0, laplace, r)
        y = k.double() * (base * ke.step_rel(codes))[:, None, None]
        x = torch.empty(n, r, d, dtype=torch.float64)
        x[:, held:] = y[:, :r - held] @ back + mu
        if held:
            raw = slots[:, STEP_BYTES:at].clone(memory_format=torch.contiguous_format)  # offset 0, even strides
            x[:, :held] = raw.view(torch.bfloat16).reshape(n, held, d).double()
        return x.float()

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in ("mu", "turn", "back", "sigma", "laplace", "base", "row_bytes",
                                                        "block_size", "first_row_bytes")}

    @classmethod
    def from_dict(cls, d: dict) -> SideCode:
        return cls(**d)


def block_bytes(rows: torch.Tensor, row_bytes: torch.Tensor | float) -> torch.Tensor:
    """Bytes of blocks of ``rows`` rows at ``row_bytes`` a row (a head's share, a fraction where heads share one
    step): rounded down, so a head never takes more than its share."""
    return torch.floor(torch.as_tensor(rows).double() * torch.as_tensor(row_bytes, dtype=torch.float64)
                       + 1e-9).long()

