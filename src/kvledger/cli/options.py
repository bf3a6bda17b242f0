"""Bounded option types shared by every command: no number reaches the library unbounded.

`Int(lo, hi)` and `Float(lo, hi)` reject anything outside the range (and NaN, infinities, 4,300-digit
integers) as a usage error, which `main()` prints as one line with exit code 2. `Size` parses byte sizes
(`79.18GiB`) through `kvledger.units`. Keep the top level light: this module imports only click.
"""

from __future__ import annotations

import math
from typing import Any

import click

MAX_TOKENS = 10**8  # any single length (prompt, output, context) on the command line
MAX_COUNT = 10**6  # request counts, sequences, blocks per step


class Int(click.ParamType):
    """An integer in [lo, hi]; huge or malformed integers are one clear usage error."""

    name = "integer"

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip().replace("_", "")
            if len(text) > 24 or not text.lstrip("+-").isdigit():
                shown = text if len(text) <= 24 else text[:20] + "..."
                self.fail(f"{shown!r} is not an integer in [{self.lo:,}, {self.hi:,}]", param, ctx)
            number = int(text)
        if not self.lo <= number <= self.hi:
            self.fail(f"{number} is not in [{self.lo:,}, {self.hi:,}]", param, ctx)
        return number

    def get_metavar(self, param: Any, ctx: Any = None) -> str:  # click 8.2+ passes ctx
        return "INT"


class Float(click.ParamType):
    """A finite number in [lo, hi] (`lo_open` excludes lo)."""

    name = "number"

    def __init__(self, lo: float, hi: float, *, lo_open: bool = False) -> None:
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        else:
            text = str(value).strip()
            try:
                number = float(text) if len(text) <= 32 else math.nan
            except ValueError:
                number = math.nan
        low_ok = number > self.lo if self.lo_open else number >= self.lo
        if not (math.isfinite(number) and low_ok and number <= self.hi):
            bracket = "(" if self.lo_open else "["
            shown = str(value) if len(str(value)) <= 24 else str(value)[:20] + "..."
            self.fail(f"{shown!r} is not a number in {bracket}{self.lo:g}, {self.hi:g}]", param, ctx)
        return number

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return "NUMBER"


class Size(click.ParamType):
    """A byte size with its unit, such as 512MiB, 79.18GiB, 80GB or 4096B (zero allowed with `allow_zero`);
    a bare number is refused, naming the units."""

    name = "size"

    def __init__(self, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        from ..errors import ConfigError
        from ..units import parse_bytes

        try:
            return parse_bytes(value if isinstance(value, int) else str(value), allow_zero=self.allow_zero,
                               unit_required=True)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return "SIZE"


TOKENS = Int(0, MAX_TOKENS)
POSITIVE_TOKENS = Int(1, MAX_TOKENS)
BLOCK_SIZE = Int(1, 4096)
TP = Int(1, 1024)
SEED = Int(0, 2**32 - 1)
UTILIZATION = Float(0.0, 1.0, lo_open=True)


def epilog(*examples: str) -> str:
    """An epilog of examples that click prints verbatim (\\b keeps the line breaks)."""
    return "\b\nExamples:\n" + "\n".join(f"  {e}" for e in examples)


__all__ = ["BLOCK_SIZE", "MAX_COUNT", "MAX_TOKENS", "POSITIVE_TOKENS", "SEED", "TOKENS", "TP", "UTILIZATION",
           "Float", "Int", "Size", "epilog"]


# ---- options every command that builds an engine shares: one name, type, default and help each ----
def threads_option(default: int | None = None) -> Any:
    """``--threads``: torch CPU threads (``prepare_torch`` applies it)."""
    return click.option("--threads", type=Int(1, 1024), default=default, show_default=default is not None,
                        help="torch CPU threads.")


def bundled_model_name(ctx: Any, param: Any, value: str | None) -> str | None:
    """``--model``'s callback: a Hugging Face id of a bundled config (``meta-llama/Llama-3.1-8B``, any case,
    with or without ``-Instruct``) becomes its bundled name, so every later line names it one way; an
    existing path or an unknown name passes through to the loader's own error."""
    if value is None:
        return None
    from pathlib import Path

    from ..core.sizing.models import resolve_model_name

    if len(value) > 200 or Path(value).expanduser().exists():
        return value
    return resolve_model_name(value) or value


def catalogue_gpu_name(ctx: Any, param: Any, value: str | None) -> str | None:
    """``--gpu``'s callback: a usual short form (``h100``, ``H100``, ``a100-80g``) becomes the catalogue's name,
    so every later line and suggestion names it one way; an ambiguous or unknown name is one usage line.
    ``cpu-local`` (the calibrated profile ``simulate`` takes) passes through."""
    if value is None or value.strip().lower() == "cpu-local":
        return value
    from ..core.sizing.gpus import resolve_gpu_name
    from ..errors import ConfigError

    try:
        return resolve_gpu_name(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def device_profile_name(ctx: Any, param: Any, value: str | None) -> str | None:
    """``simulate --gpu``'s callback: as :func:`catalogue_gpu_name`, but a name that is no catalogue GPU goes
    on to the simulator, whose one error lists its device profiles (``cpu-local`` among them)."""
    try:
        return catalogue_gpu_name(ctx, param, value)
    except click.BadParameter as exc:
        if "ambiguous" in str(exc.message):
            raise
        return value


def model_option(default: str = "smollm2-135m") -> Any:
    """``--model`` of the commands that run the torch engine."""
    return click.option("--model", default=default, show_default=True, callback=bundled_model_name,
                        help="Bundled model name (smollm2-135m) or its Hugging Face id, a Hugging Face folder or "
                             "a .gguf file.")


def flag_name(command: click.Command, param: str) -> str:
    """The flag a user types for ``command``'s parameter ``param``: its first name, which is vLLM's where
    vLLM has the knob (``tensor_parallel_size`` -> ``--tensor-parallel-size``). A suggestion built from it
    names a flag the command takes, under the name its help shows first."""
    for p in command.params:
        if p.name == param and p.opts:
            return p.opts[0]
    raise LookupError(f"{command.name} has no option {param!r}")
