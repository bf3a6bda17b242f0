"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) that reads and writes a paged KV cache.

The runner executes what the ledger decided: each sequence in a step brings its new token ids, the
position of the first one, its block table and the slots of the new tokens (``SeqStep``, usually built
from a ledger :class:`SequenceState` with :meth:`SeqStep.from_sequence`). It never allocates blocks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core import KVLedger, KVSpec, SequenceState
from ..core.groups import KVCacheGroup
from ..errors import ConfigError
from .attention import AttentionBackend, AttentionBatch, BackendFactory, attention_backend_factory
from .config import DecoderConfig
from .cpu_features import bf16_path
from .kernels import LayerKernels, TorchKernels, default_kernels
from .kv_groups import GroupedAttention, LayerGroups, group_batch, group_store_spec, layer_groups
from .kv_store import KVStore
from .weights import Checkpoint, resolve_checkpoint

_TORCH_KERNELS = TorchKernels()


@dataclass(frozen=True, slots=True)
class SeqStep:
    """One sequence's part of a forward step: ``token_ids`` at positions ``start, start + 1, ...``."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    slot_mapping: Sequence[int]
    # A runner with KV cache groups: every group's table (the first is ``block_table``; see runtime/kv_groups.py).
    group_tables: Sequence[Sequence[int]] = ()

    @classmethod
    def from_sequence(cls, seq: SequenceState, start: int, end: int | None = None) -> SeqStep:
        """The step that computes tokens ``[start, end)`` of a ledger sequence (default: to its end)."""
        end = seq.num_tokens if end is None else end
        table = seq.table
        return cls(seq.tokens[start:end], start, list(table.blocks), table.slot_mapping(start, end))


# Products of at least this many rows (or against a weight at least WIDE_OUT wide) go through oneDNN
# with the weight packed once. A single row goes there too: on a 2-core EPYC, one thread, a lone
# sequence's decode step of SmolLM2 took 25 ms through oneDNN against 39 ms with its narrow products
# on the default GEMV path (medians of 40 alternating steps), and a lone decode was slower than four.
PACKED_MIN_ROWS = 1
WIDE_OUT = 8192
PACK_ENV = "KVLEDGER_PACK_WEIGHTS"  # "0" turns weight packing off
MLP_ROWS = 256  # row tile of the MLP on long steps (see MLP.forward)
_PACKABLE = (torch.float32, torch.bfloat16)
# On a CPU with AMX, bf16 products of at most this many rows against a narrow weight run on the calling
# thread alone: one core finishes them in about the time a second OpenMP thread takes to wake under
# OMP_WAIT_POLICY=PASSIVE (see cpu_features). 2-core Xeon with AMX, load ~2: 32 x 576 x 1728 took 130 us
# on one thread against 193 us on two, 128 x 576 x 3072 438 against 487 us.
AMX_ONE_THREAD_ROWS = 128
# Decode-sized bf16 products on a CPU with bf16 matrix instructions (AMX or AVX-512 BF16) go instead, where the
# native kernels are built, to a SplitLinear: the weight cut by output columns into packed pieces that the
# calling thread and one helper thread claim as they come (csrc/kvledger_helper_pool.h): both cores work
# with no OpenMP wake-up on the caller's path, and a helper that has no core costs the caller nothing but
# the pieces it would have done. KVLEDGER_SPLIT_PRODUCTS=0 keeps them on OpenMP (or one thread on AMX).
SPLIT_ENV = "KVLEDGER_SPLIT_PRODUCTS"
# Two pieces for a layer's weights: each claimed piece is one more oneDNN call (~10-20 us), and a helper
# that loses its core while holding a piece makes the caller wait. Peer workload, bf16 at 32 running, AMX,
# load 9-12: two pieces x1.09 the one-thread tok/s, four x0.80.
SPLIT_PIECES = int(os.environ.get("KVLEDGER_SPLIT_PIECES", "2"))
# The output projection (tied to SmolLM2's 49,152 x 576 embeddings: ~57 MB in bf16, read once a step) is
# cut finer: a piece is ~1-3 ms of work, so the call overhead is small and a late helper idles less. On OpenMP
# it woke a third thread beside the helper still spinning from the step's attention. Peer workload, bf16 at 32
# running, AVX-512 BF16 (2-core EPYC), load 8-10, alternating runs: split 96 and 107 tok/s against 90 and 87
# (see docs/runtime.md for the runs with the helper's sleep on a contended core).
WIDE_SPLIT_PIECES = int(os.environ.get("KVLEDGER_WIDE_SPLIT_PIECES", "8"))
SPLIT_ALIGN = 64  # piece widths in whole 64-column blocks (oneDNN's AMX tiles are 16 or 32 wide)
# Up to this many rows a piece's product is bit for bit the whole product's columns (at 128 rows oneDNN
# blocks a narrow piece differently on AMX: 1-2 outputs in 10^5 moved by one bf16 ulp), so the split changes
# no result.
SPLIT_MAX_ROWS = 64
# Where a layer's products split: AMX. On AVX-512 BF16 (2-core EPYC, load 10-12) they were slower split than on
# OpenMP (one decode step at 32 running, paired: x0.96), the output projection alone level (x0.99).
NARROW_SPLIT_PATHS = ("amx",)
WIDE_SPLIT_PATHS = ("amx", "avx512_bf16")


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU products can use a oneDNN copy of the weight, packed once.

    On CPU the default fp32 GEMM picks a slow kernel for a few rows against a wide weight (8 rows
    against SmolLM2's tied 49152 x 576 output projection: ~95 ms, against ~35 ms through oneDNN) and
    reaches about half of oneDNN's rate on batched rows. ``pack`` reorders the weight into oneDNN's
    blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, as torch's own CPU inductor does);
    ``forward`` then calls ``_linear_pointwise`` on plain dense inputs and outputs, with no per-call
    conversion. fp32 and bf16 weights on CPU; stale if the weights change afterwards (pack after
    loading). Results agree with ``F.linear`` to float rounding (a different summation order)."""

    _packed: torch.Tensor | None = None
    _one_thread_rows = 0  # products of at most this many rows run on the calling thread (AMX, bf16)
    _split: object | None = None  # native SplitLinear for those products: caller and helper thread share them

    def pack(self) -> bool:
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
            return False
        try:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 32)
                probe = torch.zeros(PACKED_MIN_ROWS, self.in_features, dtype=w.dtype)
                torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        except (RuntimeError, AttributeError):  # an op this torch build lacks: keep F.linear
            return False
        self._packed = packed
        path = bf16_path() if w.dtype == torch.bfloat16 else None
        wide = self.out_features >= WIDE_OUT
        self._one_thread_rows = AMX_ONE_THREAD_ROWS if path == "amx" and not wide else 0
        self._split = self._split_pieces(w, WIDE_SPLIT_PIECES if wide else SPLIT_PIECES) \
            if path in (WIDE_SPLIT_PATHS if wide else NARROW_SPLIT_PATHS) else None
        return True

    def _split_pieces(self, w: torch.Tensor, pieces: int) -> object | None:
        """The weight cut into ``pieces`` column ranges, each packed, as one native SplitLinear (or None:
        no native build, switched off, or too narrow to cut)."""
        if os.environ.get(SPLIT_ENV, "1") == "0":
            return None
        from . import native

        mod = native.load()
        if mod is None or not hasattr(mod, "SplitLinear"):
            return None
        blocks = self.out_features // SPLIT_ALIGN
        if blocks < 2:
            return None
        pieces = min(pieces, blocks)
        edges = [SPLIT_ALIGN * (blocks * i // pieces) for i in range(pieces)] + [self.out_features]
        with torch.no_grad():
            packed = [torch.ops.mkldnn._reorder_linear_weight(w.detach()[lo:hi].contiguous(), 32)
                      for lo, hi in zip(edges, edges[1:], strict=False)]
            bias = [None if self.bias is None else self.bias.detach()[lo:hi].contiguous()
                    for lo, hi in zip(edges, edges[1:], strict=False)]
        return mod.SplitLinear(packed, bias, edges)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed
        if (packed is not None and x.dim() == 2 and (x.shape[0] >= PACKED_MIN_ROWS or self.out_features >= WIDE_OUT)
                and x.dtype == packed.dtype and not (torch.is_grad_enabled() and x.requires_grad)):
            threads = torch.get_num_threads()
            if self._split is not None and 0 < x.shape[0] <= SPLIT_MAX_ROWS and threads > 1:
                return self._split.forward(x)
            if x.shape[0] > self._one_thread_rows or threads == 1:
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
            torch.set_num_threads(1)  # restored at once (~0.2 us for the pair)
            try:
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
            finally:
                torch.set_num_threads(threads)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: LayerKernels = _TORCH_KERNELS,
                add: torch.Tensor | None = None) -> torch.Tensor:
        """``rmsnorm(x)``; with ``add``, ``x += add`` first (in place: the residual stream)."""
        return kernels.rms_norm(x, self.weight, self.eps, add)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.windows[layer]
        self.scale = cfg.head_dim ** -0.5
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # q, k and v fused into one GEMM: one weight read per layer instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.split = (q, kv, kv)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                kernels: LayerKernels = _TORCH_KERNELS) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = kernels.rope_(q.view(t, self.heads, self.head_dim), cos, sin)
        k = kernels.rope_(k.view(t, self.kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.kv_heads, self.head_dim)
        out = backend.forward(self.layer, q, k, v, scale=self.scale, window=self.window)
        return self.o_proj(out.reshape(t, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, kernels: LayerKernels = _TORCH_KERNELS) -> torch.Tensor:
        t = x.shape[0]
        if t <= 2 * MLP_ROWS:
            return self.down_proj(kernels.silu_mul(self.gate_up_proj(x), self.inter))
        # Long prefills in row tiles: the [rows, 2 * intermediate] activation of a tile stays in cache
        # instead of a 4096-token step writing and re-reading ~50 MB of it.
        out = torch.empty(t, self.down_proj.out_features, dtype=x.dtype, device=x.device)
        for lo in range(0, t, MLP_ROWS):
            hi = min(t, lo + MLP_ROWS)
            out[lo:hi] = self.down_proj(kernels.silu_mul(self.gate_up_proj(x[lo:hi]), self.inter))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                kernels: LayerKernels = _TORCH_KERNELS, add: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream ``x``, updated in place. ``add`` is the previous layer's
        MLP output, still to be added (fused with this layer's first norm). Returns ``(x, mlp_out)``:
        the stream after attention and this layer's MLP output, for the next layer to add."""
        h = self.self_attn(self.input_layernorm(x, kernels, add), cos, sin, backend, kernels)
        return x, self.mlp(self.post_attention_layernorm(x, kernels, h), kernels)


class Decoder(nn.Module):
    """Parameters are named like the Hugging Face checkpoint, minus the q/k/v and gate/up fusion."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", cfg.inv_freq(), persistent=False)
        self.kept: torch.Tensor | None = None  # see forward_with's keep

    def forward(
        self, input_ids: torch.Tensor, batch: AttentionBatch, backend: AttentionBackend,
    ) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` (fp32) at the last new token of each sequence."""
        return self.forward_with(input_ids, batch, backend, _TORCH_KERNELS)

    def forward_with(
        self, input_ids: torch.Tensor, batch: AttentionBatch, backend: AttentionBackend, kernels: LayerKernels,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` with the given elementwise kernels (torch or native). ``keep`` (token rows of
        the batch): also set :attr:`kept`, the final-normed hidden states of those rows, for logits at
        every position of a prompt (:meth:`ModelRunner.forward`) without a second pass."""
        # Angles in fp32 even for 16-bit models: positions in the thousands lose whole radians in bf16.
        angles = batch.positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)  # [T, head_dim]
        x = self.embed_tokens(input_ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        backend.plan(batch)
        # The residual stream x is updated in place; each layer's MLP output is added by the next
        # layer's first norm (one pass), the last one only on the rows that produce logits.
        pending: torch.Tensor | None = None
        for layer in self.layers:
            x, pending = layer(x, cos, sin, backend, kernels, pending)
        last = torch.tensor(batch.offsets[1:], device=x.device) - 1
        h = x[last] if pending is None else x[last] + pending[last]
        if keep is not None:
            k = x[keep] if pending is None else x[keep] + pending[keep]
            self.kept = self.norm(k, kernels)
        return self.lm_head(self.norm(h, kernels)).float()

    def pack_weights(self) -> int:
        """Give every projection a oneDNN copy of its weight (CPU fp32 only; see :class:`Linear`).
        Call after the weights are final. Returns how many projections were packed."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def load_hf_state(
        self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: str | torch.device = "cpu",
    ) -> None:
        """Take Hugging Face named tensors (fusing q/k/v and gate/up) as this model's parameters, in
        ``dtype`` on ``device``; a missing tensor is an error. Works on a meta-device model."""
        def take(name: str) -> torch.Tensor:
            try:
                return tensors[name]
            except KeyError:
                raise ConfigError(f"checkpoint has no tensor {name!r}") from None

        cfg = self.cfg
        state: dict[str, torch.Tensor] = {
            "embed_tokens.weight": take("model.embed_tokens.weight"),
            "norm.weight": take("model.norm.weight"),
        }
        if not cfg.tie_word_embeddings:
            state["lm_head.weight"] = take("lm_head.weight")
        for i in range(cfg.num_layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            for suffix in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                state[me + f"self_attn.qkv_proj.{suffix}"] = torch.cat(
                    [take(hf + f"self_attn.{p}_proj.{suffix}") for p in "qkv"])
            for suffix in ("weight", "bias") if cfg.o_bias else ("weight",):
                state[me + f"self_attn.o_proj.{suffix}"] = take(hf + f"self_attn.o_proj.{suffix}")
            for suffix in ("weight", "bias") if cfg.mlp_bias else ("weight",):
                state[me + f"mlp.gate_up_proj.{suffix}"] = torch.cat(
                    [take(hf + f"mlp.{p}_proj.{suffix}") for p in ("gate", "up")])
                state[me + f"mlp.down_proj.{suffix}"] = take(hf + f"mlp.down_proj.{suffix}")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                state[me + f"{norm}.weight"] = take(hf + f"{norm}.weight")
        shapes = {k: tuple(v.shape) for k, v in self.state_dict().items()}
        for name, t in state.items():
            if tuple(t.shape) != shapes[name]:
                raise ConfigError(f"checkpoint tensor for {name!r} has shape {tuple(t.shape)}, "
                                  f"config implies {shapes[name]}")
            state[name] = t.to(device, dtype)
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        # assign=True adopts the tensors instead of copying into the current parameters: no second
        # copy of the weights, and a meta-device model needs no throwaway allocation at all.
        self.load_state_dict(state, strict=True, assign=True)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.inv_freq = self.cfg.inv_freq().to(device)  # computed, not stored in checkpoints


class _FirstRows:
    """An attention backend for one token at position 0 (:meth:`ModelRunner.first_rows`): keeps each layer's K and
    V and answers with V, which is what attention over that one position returns."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.rows: list[torch.Tensor] = []

    def plan(self, batch: AttentionBatch) -> None:
        pass

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                window: int | None = None) -> torch.Tensor:
        self.rows.append(torch.stack((k[0], v[0])).float())
        return v.repeat_interleave(self.groups, dim=1)


class ModelRunner:
    """A decoder bound to one KV store: ``forward(steps)`` runs one batched step of the engine."""

    def __init__(self, model: Decoder, spec: KVSpec, num_blocks: int, *,
                 backend: BackendFactory | str | None = None, pack_weights: bool | None = None,
                 kernels: LayerKernels | None = None, residual_slots: int | None = None,
                 kv_groups: bool = False) -> None:
        """``backend``: an attention backend factory or a registered name (default ``"auto"``: the
        native CPU kernels when built, else the torch reference). ``kernels``: the elementwise layer
        kernels (default: native on CPU when built, else torch). ``residual_slots``: unquantised residual
        pages of a format that keeps them (int4; one per sequence running at once). ``kv_groups``: a model
        with sliding-window and full-attention layers keeps its KV in KV cache groups (runtime/kv_groups.py):
        a block is one group's page (``spec`` is then the store's: ``size`` layers), every step comes with
        each group's tables (`SeqStep.group_tables`), and the ledger releases the window groups' old blocks."""
        if pack_weights is None:
            pack_weights = os.environ.get(PACK_ENV, "1") != "0"
        if pack_weights and not getattr(model, "_kvledger_packed", False):
            model.pack_weights()
            model._kvledger_packed = True  # a decoder shared by several runners is packed once
        self.model = model
        self.config = model.cfg
        self.spec = spec
        device = model.embed_tokens.weight.device
        self.layout: LayerGroups | None = None
        if kv_groups:
            self.layout = layer_groups(model.cfg.windows, spec.layer_block_bytes)
            spec = self.spec = group_store_spec(spec, self.layout.size)
        smoothing = None
        if spec.format.smooth:
            from .kv_smoothing import for_model

            smoothing = for_model(model)
        transform = None
        if spec.format.scales == "coded":
            from .kv_transform_pages import for_model as transform_for

            transform = transform_for(model)
        self.store = KVStore(spec, num_blocks, device, residual_slots=residual_slots, smoothing=smoothing,
                             transform=transform, rope_inv_freq=model.inv_freq if transform is not None else None)
        factory = attention_backend_factory(backend or "auto") if backend is None or isinstance(backend, str) \
            else backend
        self.backend: AttentionBackend = factory(self.store) if self.layout is None else \
            GroupedAttention(factory, self.store, self.layout)
        self.kernels: LayerKernels = kernels if kernels is not None else default_kernels(device)
        coded = getattr(self.store, "coded", None)
        if coded is not None:
            coded.recompute = self.first_rows

    @torch.inference_mode()
    def first_rows(self, token: int) -> torch.Tensor:
        """K and V at position 0 of a sequence whose first token is ``token``, every layer: ``[layers, 2,
        kv_heads, head_dim]`` (kvtc's sink rows, recomputed where its cache lost them). Attention at position 0
        sees only itself, so each layer's output is its own V: the model's forward on one token, no store."""
        rec = _FirstRows(self.config.num_heads // self.config.num_kv_heads)
        dev = self.model.embed_tokens.weight.device
        batch = AttentionBatch(starts=[0], query_lens=[1], block_tables=[[0]],
                               slot_mapping=torch.zeros(1, dtype=torch.long, device=dev))
        self.model.forward_with(torch.tensor([token], dtype=torch.long, device=dev), batch, rec, self.kernels)
        return torch.stack(rec.rows)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str] | Checkpoint,
        *,
        num_blocks: int | None = None,
        pool_bytes: int | str | None = None,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        kv_dtype: str | None = None,
        device: str | torch.device = "cpu",
        backend: BackendFactory | str | None = None,
        kernels: LayerKernels | None = None,
        residual_slots: int | None = None,
    ) -> ModelRunner:
        """Load a HF folder or GGUF file (a decoder of its own, not the engines' shared one). Give the pool
        as ``num_blocks`` or ``pool_bytes`` (whole blocks that fit); the KV format defaults to the compute
        ``dtype`` (a quantised format's residual pages, if it keeps any, are in the compute dtype). The
        loader's narrow door: :func:`kvledger.runtime.loading.load_runner` decides everything."""
        from .loading import load_runner

        ckpt = path if isinstance(path, Checkpoint) else resolve_checkpoint(path)
        return load_runner(ckpt, num_blocks=num_blocks, pool_bytes=pool_bytes, block_size=block_size, dtype=dtype,
                           device=device, backend=backend, kv_dtype=kv_dtype, residual_slots=residual_slots,
                           kernels=kernels, cached=False)

    @property
    def kv_groups(self) -> tuple[KVCacheGroup, ...] | None:
        """The KV cache groups this runner's store keeps (None: one uniform group)."""
        return None if self.layout is None else self.layout.groups

    def new_ledger(self, *, prefix_caching: bool = True, step_tokens: int = 8192) -> KVLedger:
        """A ledger whose block ids address exactly this runner's KV store (with KV cache groups: the hybrid
        ledger, without prefix caching, for works of at most ``step_tokens`` tokens)."""
        if self.layout is not None:
            return KVLedger(self.store.num_blocks, self.spec.block_size, prefix_caching=False,
                            kv_groups=self.layout.groups, step_tokens=step_tokens)
        return KVLedger(self.store.num_blocks, self.spec.block_size, prefix_caching=prefix_caching)

    def _check(self, i: int, step: SeqStep) -> None:
        n = len(step.token_ids)
        if n == 0 or len(step.slot_mapping) != n:
            raise ConfigError(f"step {i}: {n} tokens but {len(step.slot_mapping)} slots")
        bs, table = self.spec.block_size, step.block_table
        if table and not 0 <= min(table) <= max(table) < self.store.num_blocks:
            n = self.store.num_blocks
            raise ConfigError(f"step {i}: block table names blocks outside the {n}-block store")
        for j, slot in enumerate(step.slot_mapping):
            pos = step.start + j
            # The slot must be the table's own slot for this position, or attention would read K/V
            # from a different place than it was written to.
            if pos // bs >= len(table) or slot != table[pos // bs] * bs + pos % bs:
                raise ConfigError(f"step {i}: slot {slot} for position {pos} disagrees with its block table")

    @torch.inference_mode()
    def forward(self, steps: Sequence[SeqStep], every_position: Sequence[int] = ()) -> torch.Tensor:
        """Write each step's K/V through its slots, attend through its table, and return the logits
        ``[len(steps), vocab]`` (fp32) of each sequence's last new token. ``every_position``: steps whose
        every position's final hidden state is kept too (:meth:`position_logits` turns them into logits),
        for prompt log-probabilities."""
        if not steps:
            raise ConfigError("forward needs at least one sequence")
        for i, step in enumerate(steps):
            self._check(i, step)
        dev = self.store.device
        ids = torch.tensor([t for s in steps for t in s.token_ids], dtype=torch.long, device=dev)
        slots = torch.tensor([x for s in steps for x in s.slot_mapping], dtype=torch.long, device=dev)
        batch = AttentionBatch(
            starts=[s.start for s in steps],
            query_lens=[len(s.token_ids) for s in steps],
            block_tables=[list(s.block_table) for s in steps],
            slot_mapping=slots,
        )
        if self.layout is not None:
            groups = len(self.layout.groups)
            if any(len(s.group_tables) != groups for s in steps):
                raise ConfigError(f"every step of a model with {groups} KV cache groups needs {groups} group tables")
            bs = self.spec.block_size
            first = AttentionBatch(batch.starts, batch.query_lens, batch.block_tables, slots)
            batch.groups = [first] + [group_batch(batch, [list(s.group_tables[g]) for s in steps], bs)
                                      for g in range(1, groups)]
        keep = None
        if every_position:
            starts = [0]
            for s in steps:
                starts.append(starts[-1] + len(s.token_ids))
            keep = torch.tensor([r for i in every_position for r in range(starts[i], starts[i + 1])],
                                dtype=torch.long, device=dev)
        self.model.kept = None
        self.store.note_first_tokens((s.slot_mapping[0], s.token_ids[0]) for s in steps if s.start == 0)
        return self.model.forward_with(ids, batch, self.backend, self.kernels, keep)

    def position_logits(self, lo: int, hi: int) -> torch.Tensor:
        """The logits (fp32) of rows ``[lo, hi)`` of the hidden states the last :meth:`forward` kept
        (a slice at a time: a long prompt's every logit at once would be rows x vocab floats)."""
        kept = self.model.kept
        if kept is None:
            raise ConfigError("the last forward pass kept no positions")
        return self.model.lm_head(kept[lo:hi]).float()


__all__ = ["BackendFactory", "Decoder", "ModelRunner", "SeqStep"]
