"""The torch runtime: a paged KV store, paged attention and a Llama-family model runner.

It executes what the ledger decided (block tables, slot mappings from :mod:`kvledger.core`); it never
allocates blocks itself. Needs torch and safetensors; GGUF loading also needs transformers and gguf.
"""

from __future__ import annotations

from . import native
from .attention import (
    AttentionBackend,
    AttentionBatch,
    NativePagedAttention,
    TorchPagedAttention,
    attention_backends,
    make_attention_backend,
    register_attention_backend,
)
from .config import SUPPORTED_MODEL_TYPES, DecoderConfig
from .engine import Engine, RequestHandle, RequestResult, TokenEvent
from .host_store import HostKVStore, TierStores
from .kv_store import KVStore, torch_dtype
from .loop import LoopStats, generate_greedy
from .model import BackendFactory, Decoder, ModelRunner, SeqStep
from .sampling import SamplingParams
from .transfer import TransferEngine
from .weights import CACHE_ENV, Checkpoint, cache_root, convert_gguf, resolve_checkpoint

__all__ = [
    "native", "Engine", "HostKVStore", "TierStores", "TransferEngine",
    "RequestHandle", "RequestResult", "SamplingParams", "TokenEvent",
    "CACHE_ENV", "SUPPORTED_MODEL_TYPES", "AttentionBackend", "AttentionBatch", "BackendFactory",
    "Checkpoint", "Decoder", "DecoderConfig", "KVStore", "LoopStats", "ModelRunner", "SeqStep",
    "NativePagedAttention", "TorchPagedAttention", "attention_backends", "make_attention_backend",
    "register_attention_backend", "cache_root", "convert_gguf", "generate_greedy", "resolve_checkpoint",
    "torch_dtype",
]
