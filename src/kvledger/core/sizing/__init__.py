"""The core's sizing half: how many bytes a deployment needs, decided before any block is handed out.

KV formats and geometry (bytes per token and per block), weights and their formats, what an engine spends
before its KV cache, the GPU and model catalogues, the memory inventory and the capacity plan, and the
contiguous allocator the fragmentation views compare the paged pool with. Pure Python like the rest of the
core; of the ledger half it reads only the generic `Registry` (the KV formats' registry) and `CacheContext`
(a spec's cache identity). The ledger half imports nothing from here.
"""
