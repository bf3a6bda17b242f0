"""The engine's command-line knobs, each declared once: its name, its vLLM name, its type, its default, its help.

Every command that builds an engine or a scheduler (``generate``, ``serve-trace``, ``serve``, ``fleet serve``,
``diagnose``, ``quality``, ``calibrate``, ``simulate``, ``plan``) takes a knob it shares from here, so a flag
is spelled, bounded and defaulted the same everywhere. Where vLLM has the knob, vLLM's flag name is
accepted too (``--kv-cache-dtype``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--num-gpu-blocks-override``, ``--tensor-parallel-size`` / ``-tp``, ``--gpu-memory-utilization``,
``--max-model-len``, ``--enable-prefix-caching``) and our earlier name stays as an alias; ``--dtype`` and
``--kv-cache-dtype`` take vLLM's spellings (``float32``, ``bfloat16``, ``half``, ``auto``) and meanings (``fp8`` is
vLLM's unscaled e4m3; kvledger's scaled one is ``fp8-scaled``) as well as ours.

Defaults: one per knob, stated here. The pool size is the exception: how many blocks a run needs
depends on its work, so each command states its own pool default in its help. As in vLLM, which sizes
some knobs by how the engine is used (its offline ``LLM`` class or its OpenAI server), a knob may have a
second default for the server, stated here too (:data:`SERVER_DEFAULTS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ..core.eviction import policy_names
from ..engine_config import COMPUTE_DTYPES, MAX_RUNTIME_BLOCKS
from .options import BLOCK_SIZE, MAX_COUNT, MAX_TOKENS, TP, UTILIZATION, Int


class DtypeName(click.ParamType):
    """A dtype by any of its names (ours or vLLM's: ``bf16`` / ``bfloat16``, ``fp16`` / ``half``), returned as
    ours; ``auto`` (where allowed) is the command's own choice, returned as None."""

    name = "dtype"

    def __init__(self, allowed: Callable[[], list[str]], auto: bool = False,
                 also: Callable[[], list[str]] | None = None) -> None:
        self._allowed, self.auto, self._also = allowed, auto, also

    def convert(self, value: Any, param: Any, ctx: Any) -> str | None:
        if value is None:
            return None
        from ..core.sizing.geometry import canonical_dtype
        from ..errors import ConfigError

        text = str(value).strip()
        allowed = self._allowed()
        shown = text if len(text) <= 24 else text[:20] + "..."
        if self.auto and text.lower() == "auto":
            return None
        try:
            name = canonical_dtype(text) if len(text) <= 24 else ""
        except ConfigError:
            name = ""
        if name not in allowed:
            self.fail(f"unknown dtype {shown!r}: give one of {', '.join(self._shown())}", param, ctx)
        return name

    def _shown(self) -> list[str]:
        """The names offered: ours, then vLLM's other spellings of them (``fp8``), then ``auto``."""
        allowed = self._allowed()
        from ..core.sizing.geometry import canonical_dtype

        extra = [n for n in (self._also() if self._also else []) if canonical_dtype(n) in allowed]
        return allowed + extra + (["auto"] if self.auto else [])

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return "[" + "|".join(self._shown()) + "]"


def _kv_formats() -> list[str]:
    from ..core.sizing.kv_formats import KV_FORMATS

    return list(KV_FORMATS)


def _vllm_kv_names() -> list[str]:
    from ..core.sizing.kv_formats import VLLM_NAMES

    return [name for name in VLLM_NAMES if name == "fp8"]  # the one vLLM name not spelled like ours


def _admission_policies() -> list[str]:
    from ..scheduler import ADMISSION_POLICIES

    return list(ADMISSION_POLICIES.names())


class _Registry(click.Choice):
    """A choice read from a registry when the option is parsed or shown, so a name registered later is
    offered too, and a registry that lives in the runtime (which imports torch) is loaded only by the
    commands that use it."""

    def __init__(self, names: Callable[[], list[str]]) -> None:
        self.case_sensitive = True
        self._names = names

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self._names())

    @choices.setter
    def choices(self, value: object) -> None:  # click never sets it after __init__
        pass


def _attention_backends() -> list[str]:
    from ..runtime.attention import attention_backends

    return list(attention_backends())


def _tier_codecs() -> list[str]:
    from ..runtime.host_store import CODECS

    return list(CODECS)


def _growth_actions() -> list[str]:
    from ..scheduler import GROWTH_ACTIONS

    return list(GROWTH_ACTIONS.names())


def _recovery_modes() -> list[str]:
    from ..scheduler import RECOVERY_MODES

    return list(RECOVERY_MODES.names())


def _eviction_policies() -> list[str]:
    return list(policy_names())


# name -> (flag names, click keyword arguments). The first flag name is the one help shows first.
FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "dtype": (("--dtype",), dict(
        type=DtypeName(lambda: list(COMPUTE_DTYPES)), default="fp32", show_default=True,
        help="Compute dtype of the weights (and of the KV cache unless --kv-cache-dtype says otherwise): fp32, "
             "bf16, fp16 (vLLM's float32, bfloat16, float16 / half too).")),
    "kv_dtype": (("--kv-cache-dtype", "--kv-dtype", "kv_dtype"), dict(
        type=DtypeName(_kv_formats, auto=True, also=_vllm_kv_names), default=None,
        help="KV cache format [auto: the compute dtype]. fp8 is vLLM's (= fp8_e4m3: an unscaled e4m3 cast, 1 byte "
             "per value); fp8-scaled is kvledger's e4m3 with a scale per token and head; int8 scales keys per channel "
             "(int8-token per token). fp8*, int8* and int4* are quantised and need a passing `kvledger quality` "
             "record for the model (docs/kv_formats.md).")),
    "allow_untested_kv": (("--allow-untested-kv",), dict(
        is_flag=True, help="Serve a quantised KV format that has no passing quality record for the model.")),
    "block_size": (("--block-size",), dict(
        type=BLOCK_SIZE, default=16, show_default=True, help="Tokens per KV block.")),
    "policy": (("--policy",), dict(
        type=_Registry(_admission_policies), default="incremental", show_default=True,
        help="Admission policy: what a request reserves when it is admitted (full: prompt + max_tokens as "
             "one decision, never preempted; incremental: the prompt, growing as it goes, as vLLM does).")),
    "on_growth_failure": (("--on-growth-failure",), dict(
        type=_Registry(_growth_actions), default="preempt", show_default=True,
        help="What happens when a running request cannot grow.")),
    "recovery": (("--recovery",), dict(
        type=_Registry(_recovery_modes), default="recompute", show_default=True,
        help="How a preempted request comes back (swap needs a host tier).")),
    "eviction": (("--eviction",), dict(
        type=_Registry(_eviction_policies), default=policy_names()[0], show_default=True,
        help="Eviction policy for cached prefix blocks.")),
    "max_num_seqs": (("--max-num-seqs", "--max-running", "max_num_seqs"), dict(
        type=Int(1, MAX_COUNT), default=256, show_default=True, help="Most sequences running at once.")),
    "max_num_batched_tokens": (("--max-num-batched-tokens", "--token-budget", "max_num_batched_tokens"), dict(
        type=Int(1, MAX_COUNT * 16), default=8192, show_default=True,
        help="Tokens per engine step (prefill chunks + decodes).")),
    "attention_backend": (("--attention-backend",), dict(
        type=_Registry(_attention_backends), default="auto", show_default=True,
        help="Attention implementation (auto: the native CPU kernels when built, else torch).")),
    "host_blocks": (("--host-blocks",), dict(
        type=Int(0, MAX_RUNTIME_BLOCKS), default=0, show_default=True,
        help="Host-memory tier below the KV pool, in blocks (swapped requests, offloaded prefixes).")),
    "disk_blocks": (("--disk-blocks",), dict(
        type=Int(0, MAX_RUNTIME_BLOCKS), default=0, show_default=True,
        help="Disk tier below the host tier, in blocks (a file in --disk-dir).")),
    "disk_dir": (("--disk-dir",), dict(default=None, help="Folder of the disk tier's file [the system temp dir].")),
    "tier_compression": (("--tier-compression",), dict(
        type=_Registry(_tier_codecs), default="none", show_default=True,
        help="Lossless compression of disk-tier blocks (exact bytes back).")),
    "max_model_len": (("--max-model-len", "--context", "max_model_len"), dict(
        type=Int(2, MAX_TOKENS), default=None,
        help="Prompt + output tokens of one sequence [the model's context].")),
    "tensor_parallel_size": (("--tensor-parallel-size", "-tp", "--tp", "tensor_parallel_size"), dict(
        type=TP, default=1, show_default=True,
        help="Tensor-parallel degree: GPUs one replica's weights and KV heads are split over.")),
    "gpu_memory_utilization": (("--gpu-memory-utilization", "--utilization", "gpu_memory_utilization"), dict(
        type=UTILIZATION, default=0.9, show_default=True,
        help="Fraction of device memory the engine may use.")),
    "enable_prefix_caching": (("--enable-prefix-caching/--no-enable-prefix-caching",
                               "--prefix-cache/--no-prefix-cache", "enable_prefix_caching"), dict(
        default=True, show_default=True, help="Share identical prefixes within a trust group.")),
}


# The server's default of a knob whose FLAGS default suits offline runs (vLLM's usage contexts:
# arg_utils.get_batch_defaults gives its OpenAI server smaller steps than its LLM class).
SERVER_DEFAULTS: dict[str, Any] = {
    # Half of vLLM's 2048 for its CPU server (its LLM class takes 4096). With 8192, sixteen 256-token prompts
    # arriving together were prefilled in one step and every first token waited for all of it; the smaller the
    # step, the sooner the median prompt's first token and the sooner later arrivals join a decode step. Measured
    # beside vLLM's server, quiet (docs/server.md): 2048 left TTFT p50 level with vLLM's at the unbounded rate
    # (x1.00-1.09), 1024 puts it below (x0.64-0.78) at a higher throughput (x1.25-1.40).
    "max_num_batched_tokens": 1024,
}


def engine_option(name: str, *, server: bool = False, **override: Any) -> Callable[[Any], Any]:
    """The click option of the engine knob ``name`` (a key of :data:`FLAGS`). ``override`` may narrow it
    for one command -- a stricter ``type``, ``required`` or a ``help`` saying what the command does with
    it -- but never changes its names or its default. ``server``: the command is the HTTP server, which
    takes the knob's :data:`SERVER_DEFAULTS` value where it has one."""
    if "default" in override:
        raise ValueError(f"{name}: an engine knob has one default, declared in FLAGS")
    names, kwargs = FLAGS[name]
    if server and name in SERVER_DEFAULTS:
        kwargs = {**kwargs, "default": SERVER_DEFAULTS[name]}
    return click.option(*names, **{**kwargs, **override})


class RefusedKnob(click.Option):
    """An engine knob a command answers to under all its names but cannot honour (a CPU engine has no GPU
    memory to take a fraction of, and runs on one device): given on the command line with a value other
    than what the command does anyway, it is refused in one line saying why -- not "No such option" to a
    vLLM user pasting a command line, and never accepted and dropped in silence. Its value reaches no
    function (``expose_value=False``)."""

    def __init__(self, *args: Any, why: str, accepts: Callable[[Any], bool] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.why, self.accepts = why, accepts

    def process_value(self, ctx: click.Context, value: Any) -> Any:
        value = super().process_value(ctx, value)
        source = ctx.get_parameter_source(self.name) if self.name else None
        given = source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")
        if given and not (self.accepts is not None and self.accepts(value)):
            shown = "" if isinstance(value, bool) else f" {value}"
            raise click.UsageError(f"{self.opts[0]}{shown}: {self.why}", ctx)
        return value


def refused_knob(name: str, why: str, accepts: Callable[[Any], bool] | None = None) -> Callable[[Any], Any]:
    """The engine knob ``name`` (a key of :data:`FLAGS`) for a command that cannot honour it: the same names
    and type, refused with ``why`` when given (unless ``accepts`` the value: ``-tp 1`` is what a one-device
    engine runs anyway). Help says so."""
    names, kwargs = FLAGS[name]
    fixed = {**kwargs, "show_default": False, "expose_value": False, "help": f"vLLM's knob, refused here: {why}"}
    return click.option(*names, cls=RefusedKnob, why=why, accepts=accepts, **fixed)


# Why the commands that run our CPU engine refuse vLLM's GPU knobs (one wording for every such command).
CPU_ENGINE_REFUSALS: dict[str, tuple[str, Callable[[Any], bool] | None]] = {
    "gpu_memory_utilization": ("the engine runs on the CPU, with no GPU memory to take a fraction of: give its "
                               "KV pool in blocks (--num-gpu-blocks-override N); kvledger plan sizes a GPU's",
                               None),
    "tensor_parallel_size": ("the engine runs on one device; tensor parallelism is planned (kvledger plan) and "
                             "simulated (kvledger simulate), not run", lambda tp: tp == 1),
}


def cpu_engine_refusals() -> Callable[[Any], Any]:
    """vLLM's GPU knobs on a command that runs the CPU engine, each refused with its reason."""

    def apply(fn: Any) -> Any:
        for name, (why, accepts) in reversed(CPU_ENGINE_REFUSALS.items()):
            fn = refused_knob(name, why, accepts)(fn)
        return fn

    return apply


def engine_options(*names: str, server: bool = False) -> Callable[[Any], Any]:
    """Several engine knobs, in the order given (help lists them in that order); ``server`` as for
    :func:`engine_option`."""

    def apply(fn: Any) -> Any:
        for name in reversed(names):
            fn = engine_option(name, server=server)(fn)
        return fn

    return apply


__all__ = ["COMPUTE_DTYPES", "CPU_ENGINE_REFUSALS", "FLAGS", "SERVER_DEFAULTS", "MAX_RUNTIME_BLOCKS", "DtypeName",
           "RefusedKnob", "cpu_engine_refusals", "engine_option", "engine_options", "refused_knob"]
