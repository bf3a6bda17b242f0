"""Static key smoothing for ``int4-smooth``: per layer, KV head and channel, a mean ``mu`` and a scale ``s``.

Keys are stored as ``(k - mu) / s`` (then turned by the Walsh-Hadamard matrix and quantised per token). Both
constants are exact for attention: ``q . (k - mu) = q . k - q . mu`` shifts every score of one query by the
same amount (softmax unchanged), and ``(q * s) . (k / s) = q . k``; readers either undo them on the dequantised
key (``KVStore.read``) or score ``q * s`` against the stored key (the native kernels). They are model metadata,
calibrated once from the keys and queries of a few texts (:func:`calibrate`), never per token, so they cost
no bytes per token. Keys are post-RoPE (the attention backend's input), so a channel whose RoPE pair turns
quickly has a mean near 0 there; the slow pairs, where SmolLM2's large steady key offsets live, keep theirs.

``s = (sigma_k / rms_q) ** ALPHA`` per channel (``sigma_k`` the centred key's spread, ``rms_q`` the query's
over the KV head's query group), normalised to a geometric mean of 1 per head: with a turned key the error of
a score is about ``|q * s| |(k - mu) / s|``, which this balances (SmoothQuant's rule). ``ALPHA`` was chosen on
tuning texts apart from every reported one (0.25, 0.5, 0.75 and no scale were tried; docs/kv_formats.md).

Constants ship for the bundled model under ``kvledger/data/kv_smoothing/<weights revision>.json``; make them
with ``python -m kvledger.runtime.kv_smoothing --model NAME`` (the calibration texts are fixed: see
:func:`calibration_ids`).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

ALPHA = 0.5
RECIPE = "v1"  # what the format identity's ``calib=v1`` names: ALPHA, the texts and their lengths below
SMOOTHING_DIR = Path(__file__).resolve().parents[1] / "data" / "kv_smoothing"
# Calibration texts: none is a text the quality contract or its held-out prompts use.
CALIB_FILES = ("/usr/share/common-licenses/GPL-3", "dataclasses.py")  # prose; a stdlib module (not argparse.py)
CALIB_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class KVSmoothing:
    """``mean`` and ``scale`` ``[layers, kv_heads, head_dim]`` (fp32 holding fp16-exact values, so every
    dtype reads the same constants); ``revision`` the weights they were calibrated for."""

    mean: torch.Tensor
    scale: torch.Tensor
    revision: str = ""

    def __post_init__(self) -> None:
        if self.mean.shape != self.scale.shape or self.mean.dim() != 3:
            raise ConfigError(f"key smoothing needs mean and scale of one shape [layers, heads, dim], got "
                              f"{tuple(self.mean.shape)} and {tuple(self.scale.shape)}")
        if not bool(torch.isfinite(self.mean).all()) or not bool((self.scale > 0).all()) or \
                not bool(torch.isfinite(self.scale).all()):
            raise ConfigError("key smoothing constants must be finite, with positive scales")

    def check(self, layers: int, heads: int, head_dim: int) -> None:
        if tuple(self.mean.shape) != (layers, heads, head_dim):
            raise ConfigError(f"key smoothing constants are {tuple(self.mean.shape)}, the KV cache is "
                              f"[{layers}, {heads}, {head_dim}] (layers, KV heads, head dim): calibrated for "
                              "another model")

    def smooth(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Keys ``[..., H, D]`` as stored before turning: ``(k - mu) / s`` in fp32."""
        return (k.float() - self.mean[layer].to(k.device)) / self.scale[layer].to(k.device)

    def unsmooth(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`smooth`: ``k * s + mu``."""
        return k.float() * self.scale[layer].to(k.device) + self.mean[layer].to(k.device)

    def query(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Queries ``[T, heads, D]`` times their KV head's ``s`` (query heads grouped per KV head, as GQA
        groups them): scored against smoothed keys they give ``q . (k - mu)``, softmax-equal to ``q . k``."""
        s = self.scale[layer].to(q.device)
        group = q.shape[-2] // s.shape[0]
        return (q.float() * s.repeat_interleave(group, dim=0)).to(q.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": RECIPE, "alpha": ALPHA, "revision": self.revision, "shape": list(self.mean.shape),
                "mean": self.mean.flatten().tolist(), "scale": self.scale.flatten().tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> KVSmoothing:
        try:
            shape = tuple(int(x) for x in data["shape"])
            mean = torch.tensor(data["mean"], dtype=torch.float32).view(shape)
            scale = torch.tensor(data["scale"], dtype=torch.float32).view(shape)
            if data.get("recipe") != RECIPE:
                raise ConfigError(f"key smoothing {source} is recipe {data.get('recipe')!r}, this kvledger "
                                  f"reads {RECIPE!r}")
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"key smoothing {source} is malformed: {str(exc)[:120]}") from None
        return cls(mean, scale, str(data.get("revision", "")))


def _fp16_exact(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).float()


def constants_from_stats(k_sum: torch.Tensor, k_sq: torch.Tensor, q_sq: torch.Tensor, n: int,
                         revision: str = "") -> KVSmoothing:
    """Constants from sums over ``n`` tokens: keys' sum and sum of squares ``[L, H, D]``, queries' mean square
    per KV head's group ``q_sq`` (summed over tokens, averaged over the group) ``[L, H, D]``."""
    mean = k_sum.double() / n
    sigma = (k_sq.double() / n - mean ** 2).clamp_min(1e-12).sqrt()
    rms_q = (q_sq.double() / n).sqrt().clamp_min(1e-6)
    s = (sigma / rms_q) ** ALPHA
    s = s / s.log().mean(-1, keepdim=True).exp()
    return KVSmoothing(_fp16_exact(mean.float()), _fp16_exact(s.float()).clamp_min(2 ** -14), revision)


class _Collect:
    """Wraps an attention backend and sums the keys and queries it sees (an uncompressed store)."""

    def __init__(self, inner: Any, layers: int) -> None:
        self.inner = inner
        self.n = [0] * layers
        self.k_sum: list[Any] = [0] * layers
        self.k_sq: list[Any] = [0] * layers
        self.q_sq: list[Any] = [0] * layers

    def plan(self, batch: Any) -> None:
        self.inner.plan(batch)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                window: int | None = None) -> torch.Tensor:
        kd = k.double()
        heads = k.shape[1]
        qg = q.double().view(q.shape[0], heads, q.shape[1] // heads, q.shape[2])
        self.n[layer] += k.shape[0]
        self.k_sum[layer] = self.k_sum[layer] + kd.sum(0)
        self.k_sq[layer] = self.k_sq[layer] + (kd ** 2).sum(0)
        self.q_sq[layer] = self.q_sq[layer] + (qg ** 2).mean(2).sum(0)
        return self.inner.forward(layer, q, k, v, scale=scale, window=window)


@torch.inference_mode()
def calibrate(model: Any, texts: Sequence[Sequence[int]], revision: str = "") -> KVSmoothing:
    """Constants for ``model`` (a Decoder) from one uncompressed prefill of each token list."""
    from ..core.sizing.geometry import KVSpec  # noqa: F401  (the runner below builds its own)
    from .model import ModelRunner, SeqStep

    cfg = model.cfg
    layers = cfg.num_layers
    spec = _plain_spec(model)
    longest = max(len(t) for t in texts)
    blocks = -(-longest // spec.block_size)
    runner = ModelRunner(model, spec, blocks, backend="torch")
    collect = _Collect(runner.backend, layers)
    runner.backend = collect  # type: ignore[assignment]
    table = list(range(blocks))
    for ids in texts:
        runner.forward([SeqStep(list(ids), 0, table,
                                [table[p // spec.block_size] * spec.block_size + p % spec.block_size
                                 for p in range(len(ids))])])
    n = collect.n[0]
    return constants_from_stats(torch.stack(collect.k_sum), torch.stack(collect.k_sq), torch.stack(collect.q_sq), n,
                                revision)


def _plain_spec(model: Any) -> Any:
    from ..core.sizing.geometry import KVSpec

    cfg = model.cfg
    return KVSpec(layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, kv_dtype="fp32",
                  block_size=16)


def calibration_ids(tokenizer: Any) -> list[list[int]]:
    """The fixed calibration texts, tokenised: each file's first :data:`CALIB_TOKENS` tokens."""
    out = []
    for name in CALIB_FILES:
        path = Path(name) if name.startswith("/") else Path(sysconfig.get_paths()["stdlib"]) / name
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"calibration text {path} is unreadable: {exc.strerror or exc}") from None
        out.append(tokenizer(text, add_special_tokens=False).input_ids[:CALIB_TOKENS])
    return out


def path_for(revision: str) -> Path:
    return SMOOTHING_DIR / f"{revision.split(':')[-1]}.json"


def load_for(revision: str) -> KVSmoothing:
    """The shipped constants for weights ``revision``, or one ConfigError line saying how to make them."""
    p = path_for(revision)
    if not p.is_file():
        raise ConfigError(f"int4-smooth needs key smoothing constants calibrated for these weights ({revision}); "
                          "none ship: make them with `python -m kvledger.runtime.kv_smoothing --model <model>`")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"key smoothing {p} is unreadable: {str(exc)[:120]}") from None
    return KVSmoothing.from_dict(data, str(p))


def calibrated_for(model: Any, attr: str, load: Callable[[str], Any], need: str) -> Any:
    """A decoder's calibrated artefact (``model.<attr>``, else ``load(weights revision)`` once, kept there) for a
    decoder that :func:`~kvledger.runtime.loading.load_decoder` loaded (it records the checkpoint), or one
    ConfigError line. ``need`` says who needs what (int4-smooth's constants, kvtc's tables)."""
    found = getattr(model, attr, None)
    if found is not None:
        return found
    ckpt = getattr(model, "checkpoint", None)
    if ckpt is None:
        raise ConfigError(f"{need}; this decoder has none (set model.{attr}, or load it through kvledger so its "
                          "weights are known)")
    from .measure.quality_records import weights_revision

    found = load(weights_revision(ckpt))
    setattr(model, attr, found)
    return found


def for_model(model: Any) -> KVSmoothing:
    """The constants of a decoder that :func:`~kvledger.runtime.loading.load_decoder` loaded, or one ConfigError
    line."""
    return calibrated_for(model, "kv_smoothing", load_for, "int4-smooth needs the model's key smoothing constants")


def _main(argv: Sequence[str] | None = None) -> None:  # pragma: no cover - a developer's command
    ap = argparse.ArgumentParser(description="calibrate int4-smooth's key constants for a model")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help=f"file to write (default {SMOOTHING_DIR}/<revision>.json)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from .loading import load_decoder, resolve_model
    from .measure.quality_records import weights_revision

    ckpt = resolve_model(args.model)
    model = load_decoder(ckpt, torch.float32, cached=False)
    revision = weights_revision(ckpt)
    sm = calibrate(model, calibration_ids(AutoTokenizer.from_pretrained(str(ckpt.path))), revision)
    out = Path(args.out) if args.out else path_for(revision)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(sm.to_dict()) + "\n")
    print(f"wrote {out}: {tuple(sm.mean.shape)}, scale {float(sm.scale.min()):.3g}..{float(sm.scale.max()):.3g}")


if __name__ == "__main__":  # pragma: no cover
    _main()


__all__ = ["ALPHA", "KVSmoothing", "calibrate", "calibrated_for", "calibration_ids", "constants_from_stats",
           "for_model", "load_for"]
