"""A hybrid model's KV cache groups in the runtime: which layer reads which group's block table, and where its pages
live.

vLLM's layout (`core.sizing.hybrid.group_layout`): the layers are split into KV cache groups of one kind each (full
attention, or a sliding window), every group of at most ``size`` layers; a block id of the pool holds one group's
page of ``size`` layers. So the store keeps ``size`` layers of pages (`KVStore` over a spec of ``size`` layers), and
layer ``l`` of group ``g`` lives in storage layer ``slot[l]`` at the block ids of group ``g``'s table: a block id
belongs to one group at a time (the ledger's `core.windows.GroupTables`), so the groups never share a page.
`GroupedAttention` is the attention backend the model sees: one backend per group over a view of the store (the
group's storage layers), each planned with its group's tables; a layer's `forward` goes to its group's backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..core.groups import NULL_BLOCK, KVCacheGroup
from ..core.sizing.geometry import KVSpec
from ..core.sizing.hybrid import group_layout
from ..errors import ConfigError
from .attention import AttentionBackend, AttentionBatch, BackendFactory
from .kv_store import KVStore


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """The groups (full ones first: the ledger keeps the first in the sequence's own table), the storage layers one
    block holds (``size``), and per model layer its group and storage layer."""

    groups: tuple[KVCacheGroup, ...]
    size: int
    group_of: tuple[int, ...]
    slot_of: tuple[int, ...]


def layer_groups(windows: Sequence[int | None], layer_block_bytes: int = 0) -> LayerGroups:
    """vLLM's grouping of a model whose layers have ``windows`` (None: full attention). A kind's ``n`` layers go to
    ``ceil(n / size)`` groups taking every ``k``-th layer of that kind, in model order."""
    sizes = {w for w in windows if w is not None}
    full = [i for i, w in enumerate(windows) if w is None]
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not full or not sliding:
        raise ConfigError("KV cache groups need both full-attention and sliding-window layers "
                          f"({len(full)} full, {len(sliding)} sliding)")
    if len(sizes) != 1:
        raise ConfigError(f"KV cache groups take one sliding window, the model has {sorted(sizes)}")
    window = sizes.pop()
    size, _ = group_layout(len(full), len(sliding))
    groups: list[KVCacheGroup] = []
    group_of = [0] * len(windows)
    slot_of = [0] * len(windows)
    for kind, layers in (("full", full), ("sliding", sliding)):
        k = -(-len(layers) // size)
        for i in range(k):
            members = layers[i::k]
            for slot, layer in enumerate(members):
                group_of[layer], slot_of[layer] = len(groups), slot
            groups.append(KVCacheGroup(kind, len(members), window if kind == "sliding" else None, layer_block_bytes))
    return LayerGroups(tuple(groups), size, tuple(group_of), tuple(slot_of))


def group_store_spec(spec: KVSpec, size: int) -> KVSpec:
    """The store's geometry: a block holds one group's page of ``size`` layers (the groups' kinds are the
    ledger's business, not the store's)."""
    if spec.layers == size and spec.attention == "full":
        return spec
    return replace(spec, layers=size, attention="full", sliding_window=None, sliding_layers=0)


def group_view(store: KVStore, layers: int) -> KVStore:
    """The store seen by one group: its first ``layers`` storage layers (a view: the same pages)."""
    if store.residual_slots:
        raise ConfigError(f"KV cache groups do not take {store.format.name}'s residual pages yet")
    view = object.__new__(KVStore)
    for name, value in vars(store).items():
        setattr(view, name, value)
    view.kv = store.kv[:layers]
    return view


def readable(table: Sequence[int]) -> list[int]:
    """A group's table for a kernel: an entry whose block left the window (``NULL_BLOCK``) names a live block of the
    table instead. Attention never weighs those positions (they are outside every query's window), so any
    finite page will do; reading one keeps every backend's table a plain block-id table."""
    live = next((b for b in table if b != NULL_BLOCK), 0)
    return [live if b == NULL_BLOCK else b for b in table]


def group_batch(batch: AttentionBatch, tables: list[list[int]], block_size: int) -> AttentionBatch:
    """``batch`` through one group's tables: the same tokens and positions, that group's slots."""
    slots = [t[p // block_size] * block_size + p % block_size
             for t, s, n in zip(tables, batch.starts, batch.query_lens, strict=True) for p in range(s, s + n)]
    dev = batch.slot_mapping.device
    return AttentionBatch(starts=batch.starts, query_lens=batch.query_lens, block_tables=[readable(t) for t in tables],
                          slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev))


class GroupedAttention:
    """The attention backend of a model with KV cache groups: one backend per group over that group's view of the
    store, planned with the group's tables (``AttentionBatch.groups``); each layer attends through its own."""

    def __init__(self, factory: BackendFactory, store: KVStore, layout: LayerGroups) -> None:
        self.layout = layout
        self.backends: list[AttentionBackend] = [factory(group_view(store, g.layers)) for g in layout.groups]

    def plan(self, batch: AttentionBatch) -> None:
        if len(batch.groups) != len(self.backends):
            raise ConfigError(f"a step of a model with {len(self.backends)} KV cache groups came with "
                              f"{len(batch.groups)} group batches")
        for backend, group in zip(self.backends, batch.groups, strict=True):
            backend.plan(group)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                window: int | None = None) -> torch.Tensor:
        layout = self.layout
        return self.backends[layout.group_of[layer]].forward(layout.slot_of[layer], q, k, v, scale=scale,
                                                             window=window)


__all__ = ["GroupedAttention", "LayerGroups", "group_batch", "group_store_spec", "group_view", "layer_groups",
           "readable"]
