"""Hybrid KV cache groups: what a model whose layers keep different spans of tokens costs in a hybrid pool.

A uniform pool charges every layer for every token of a request (`KVSpec.pool_bytes_for_sequence`). Models
that interleave sliding-window layers with full-attention ones (Gemma 2/3, gpt-oss, Mistral variants) keep
only the last W tokens in a sliding layer, so a hybrid allocator gives each kind of layer its own block
table and frees a sliding layer's blocks as they leave the window. This module is that allocator's
arithmetic, as vLLM's v1 hybrid manager does it (``vllm/v1/core/kv_cache_utils.py``):

- layers are grouped by kind into groups of equal size (``_get_kv_cache_groups_uniform_page_size``): the
  group size is the smaller kind's layer count (the larger one's when it is under 1.5x the smaller), and the
  last group of a kind is padded, so every group's block has the same bytes (group size x one layer's page);
- all groups draw block ids from one shared pool of those blocks (``get_kv_cache_config_from_groups``);
- a full group takes ``ceil(L / block)`` blocks for a request of L tokens, a sliding group at most
  ``ceil(min(W - 1 + in-flight tokens, L) / block) + 1`` (``SlidingWindowSpec.max_memory_usage_bytes``:
  during a chunked prefill the window's W - 1 tokens stay beside the chunk being computed, and a window
  that does not start on a block boundary straddles one more block);
- a state group (Mamba-2 / gated-delta-net layers) holds one block per request whatever its length
  (``MambaSpec.max_memory_usage_bytes`` with no prefix caching and no speculation); its page is the layer's
  fixed state, so the attention block size is raised until an attention page holds it, a multiple of the
  kernel's block alignment, and the state page is padded up to the attention page
  (``Platform._align_hybrid_block_size``, ``unify_kv_cache_spec_page_size``);
- the concurrency for ``max_model_len`` tokens is the pool's blocks over the sum of every group's blocks
  (``get_max_concurrency_for_kv_cache_config``).

``benchmarks/vllm_hybrid_groups.py`` runs vLLM's own functions on the same layer kinds; the tests hold these
figures to it. Pure standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, InvariantError
from .. import checks
from .geometry import KVSpec, StateGeometry

# vLLM uses the larger kind's layer count as the group size when it is under this multiple of the smaller
# (gpt-oss-20b + an EAGLE drafter: 12 sliding + 13 full pad to 13 + 13, not 12 + 24).
GROUP_SIZE_SLACK = 1.5
# The attention kernel's block alignment vLLM rounds a hybrid attention/Mamba block size to (FlashAttention on
# CUDA: multiples of 16 tokens).
KERNEL_BLOCK_ALIGNMENT = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVGroupPlan:
    """One KV cache group of a hybrid pool: its layers, what one of its blocks really holds, and what a request
    of the planned length takes from the pool in it."""

    kind: str  # "full" | "sliding" | "state"
    layers: int  # real layers in the group (the rest of the group's block is padding)
    window: int | None
    layer_block_bytes: int  # one layer's page: what `KVFormat.parts` lays out (a state layer: its fixed state)
    blocks_per_request: int

    @property
    def bytes_per_block(self) -> int:
        """What this group's layers store in one block id (padding layers excluded)."""
        return self.layers * self.layer_block_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "layers": self.layers, "window": self.window,
                "bytes_per_block": self.bytes_per_block, "blocks_per_request": self.blocks_per_request}


@dataclass(frozen=True, slots=True)
class HybridPlan:
    """A hybrid pool beside the uniform pool of the same KV budget, for requests of ``tokens`` tokens.

    ``block_bytes`` is the hybrid pool's block: ``group_size`` layer pages, shared by every group.
    ``kv_bytes_per_request`` is what one request takes from that pool (padding included, as vLLM charges it);
    ``exact_bytes_per_request`` is what its layers really hold at their largest (no padding).
    """

    tokens: int
    in_flight_tokens: int
    group_size: int
    padding_layers: int
    groups: tuple[KVGroupPlan, ...]
    block_bytes: int
    pool_blocks: int
    blocks_per_request: int
    uniform_block_bytes: int
    uniform_pool_blocks: int
    uniform_blocks_per_request: int
    block_size: int = 16  # tokens per block of the hybrid pool (raised so a page holds a state layer's state)

    @property
    def kv_bytes_per_request(self) -> int:
        return self.blocks_per_request * self.block_bytes

    @property
    def exact_bytes_per_request(self) -> int:
        return sum(g.blocks_per_request * g.bytes_per_block for g in self.groups)

    @property
    def uniform_bytes_per_request(self) -> int:
        return self.uniform_blocks_per_request * self.uniform_block_bytes

    @property
    def max_concurrency(self) -> float:
        """vLLM's 'Maximum concurrency for N tokens per request' in the hybrid pool."""
        return self.pool_blocks / self.blocks_per_request

    @property
    def uniform_max_concurrency(self) -> float:
        return self.uniform_pool_blocks / self.uniform_blocks_per_request

    def by_kind(self) -> dict[str, dict[str, int]]:
        """Per kind of layer: groups, layers, and the bytes one request holds in them (padding included)."""
        out: dict[str, dict[str, int]] = {}
        for g in self.groups:
            row = out.setdefault(g.kind, {"groups": 0, "layers": 0, "blocks_per_request": 0,
                                          "kv_bytes_per_request": 0})
            row["groups"] += 1
            row["layers"] += g.layers
            row["blocks_per_request"] += g.blocks_per_request
            row["kv_bytes_per_request"] += g.blocks_per_request * self.block_bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens, "in_flight_tokens": self.in_flight_tokens, "group_size": self.group_size,
            **({"block_size": self.block_size} if "state" in self.by_kind() else {}),
            "padding_layers": self.padding_layers, "block_bytes": self.block_bytes, "pool_blocks": self.pool_blocks,
            "blocks_per_request": self.blocks_per_request, "kv_bytes_per_request": self.kv_bytes_per_request,
            "exact_bytes_per_request": self.exact_bytes_per_request,
            "max_concurrency": round(self.max_concurrency, 2), "by_kind": self.by_kind(),
            "groups": [g.to_dict() for g in self.groups],
            "uniform": {"block_bytes": self.uniform_block_bytes, "pool_blocks": self.uniform_pool_blocks,
                        "blocks_per_request": self.uniform_blocks_per_request,
                        "kv_bytes_per_request": self.uniform_bytes_per_request,
                        "max_concurrency": round(self.uniform_max_concurrency, 2)},
            "concurrency_gain": round(self.max_concurrency / self.uniform_max_concurrency, 3),
        }


def is_hybrid(spec: KVSpec, state: StateGeometry | None = None) -> bool:
    """Whether a hybrid pool would charge this model differently: some of its layers slide or keep a state."""
    return state is not None or (spec.attention in ("sliding", "hybrid") and bool(spec.sliding_layers))


def sliding_blocks(window: int, block_size: int, tokens: int, in_flight_tokens: int) -> int:
    """Blocks one sliding layer's table holds at most for a request of ``tokens`` tokens: the window's
    ``W - 1`` earlier tokens beside the step's ``in_flight_tokens``, never more than the request, plus one for a
    window that does not start on a block boundary (vLLM's ``SlidingWindowSpec.max_admission_blocks_per_request``)."""
    return _cdiv(min(window - 1 + in_flight_tokens, tokens), block_size) + 1


def group_layout(full_layers: int, sliding_layers: int, state_layers: int = 0) -> tuple[int, list[tuple[str, int]]]:
    """vLLM's grouping: (group size, [(kind, real layers) per group]), full groups after sliding ones as vLLM
    lists them for a model whose first layer slides. A kind of ``n`` layers splits into ``ceil(n / size)``
    groups taking every ``k``-th layer, so their sizes differ by at most one."""
    counts = [(kind, n) for kind, n in (("sliding", sliding_layers), ("full", full_layers), ("state", state_layers))
              if n]
    if not counts:
        raise ConfigError("a hybrid pool needs at least one layer")
    small, large = min(n for _, n in counts), max(n for _, n in counts)
    size = large if large < small * GROUP_SIZE_SLACK else small
    groups: list[tuple[str, int]] = []
    for kind, n in counts:
        k = _cdiv(n, size)
        groups.extend((kind, len(range(i, n, k))) for i in range(k))
    return size, groups


def hybrid_plan(spec: KVSpec, kv_budget_bytes: int, tokens: int, in_flight_tokens: int,
                state: StateGeometry | None = None) -> HybridPlan:
    """The hybrid pool a KV budget of ``kv_budget_bytes`` makes for ``spec``, against the uniform pool of the
    same budget, for requests of ``tokens`` tokens (vLLM's ``max_model_len``) with ``in_flight_tokens`` tokens
    scheduled per step (vLLM: ``max_num_batched_tokens`` times the concurrent batches, one without async
    scheduling). ``state`` (`geometry.state_geometry`) names the state layers among ``spec.layers``."""
    checks.positive(kv_budget_bytes, "kv_budget_bytes")
    checks.positive(tokens, "tokens")
    checks.positive(in_flight_tokens, "in_flight_tokens")
    page = spec.layer_block_bytes
    bs = spec.block_size
    state_layers = state.layers if state is not None else 0
    if state is not None:
        if state_layers + spec.sliding_layers >= spec.layers:
            raise ConfigError("a hybrid pool with state layers needs at least one full-attention layer")
        bs = hybrid_block_size(spec, state)
        page = spec.layer_block_bytes * bs // spec.block_size
    size, layout = group_layout(spec.layers - spec.sliding_layers - state_layers, spec.sliding_layers, state_layers)
    full_blocks = _cdiv(tokens, bs)
    groups = []
    for kind, n in layout:
        if kind == "state":
            if state is None:  # layout has a state kind only for a spec with state layers
                raise InvariantError("a state group was laid out for a spec without state layers")
            groups.append(KVGroupPlan(kind, n, None, state.layer_state_bytes, 1))
            continue
        if kind == "sliding":
            window = spec.sliding_window
            if window is None:  # KVSpec gives every sliding layer a window
                raise ConfigError("sliding layers without a sliding window")
            blocks = sliding_blocks(window, bs, tokens, in_flight_tokens)
        else:
            window, blocks = None, full_blocks
        groups.append(KVGroupPlan(kind, n, window, page, blocks))
    block_bytes = size * page
    return HybridPlan(
        tokens=tokens, in_flight_tokens=in_flight_tokens, group_size=size,
        padding_layers=len(layout) * size - spec.layers, groups=tuple(groups), block_bytes=block_bytes,
        pool_blocks=kv_budget_bytes // block_bytes, blocks_per_request=sum(g.blocks_per_request for g in groups),
        uniform_block_bytes=spec.block_bytes, uniform_pool_blocks=kv_budget_bytes // spec.block_bytes,
        uniform_blocks_per_request=_cdiv(tokens, spec.block_size), block_size=bs,
    )


def hybrid_block_size(spec: KVSpec, state: StateGeometry | None, alignment: int = KERNEL_BLOCK_ALIGNMENT) -> int:
    """Tokens per block of a hybrid attention/state pool: the smallest multiple of the kernel's block alignment
    (at least the configured block size) whose attention page holds one state layer's state (vLLM's
    ``Platform._align_hybrid_block_size``); the configured block size when that already holds it."""
    if state is None:
        return spec.block_size
    per_token = spec.layer_block_bytes // spec.block_size
    if per_token * spec.block_size != spec.layer_block_bytes:
        raise ConfigError("a KV format whose page is not whole bytes per token cannot share a pool with states")
    align = max(alignment, spec.block_size)
    return max(spec.block_size, align * _cdiv(state.layer_state_bytes, align * per_token))


__all__ = ["HybridPlan", "KVGroupPlan", "group_layout", "hybrid_block_size", "hybrid_plan", "is_hybrid",
           "sliding_blocks"]
