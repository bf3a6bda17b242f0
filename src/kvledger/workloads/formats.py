"""The trace-format registry and the one sniffer: which registered format a file is (from its suffix and
first line), whether it carries its own arrival times, and `load_trace`, which reads any of them. Every
trace reader (the simulator, serve-trace, diagnose, the load client) asks these questions here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.registry import Registry
from ..errors import ConfigError
from .readers import (
    AZURE_COLUMNS,
    KVLEDGER_REQUIRED,
    LENGTH_COLUMNS,
    _head,
    load_azure,
    load_kvledger,
    load_lengths,
    load_mooncake,
)
from .requests import SimRequest

# ---- the trace-format registry -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """A trace format: how to recognise it from its first line and how to load it.

    `columns` are the CSV header columns (or JSON keys) that identify it; `needs_arrivals` formats carry no
    arrival times, so `load_trace` asks for an arrival process (`arrivals=`).
    """

    name: str
    description: str
    suffix: str  # ".jsonl" or ".csv"
    columns: tuple[str, ...]
    loader: Any
    needs_arrivals: bool = False

    def matches(self, suffix: str, first: str) -> bool:
        if self.suffix == ".jsonl":
            if suffix != ".jsonl":
                return False
            try:
                rec = json.loads(first)
            except (ValueError, RecursionError):
                return False
            return isinstance(rec, dict) and set(self.columns) <= set(rec)
        if suffix == ".jsonl":
            return False
        header = [h.strip() for h in first.split(",")]
        return set(self.columns) <= set(header)


TRACE_FORMATS: Registry[TraceFormat] = Registry("trace format")


def register_trace_format(fmt: TraceFormat, *, replace: bool = False) -> TraceFormat:
    """Add a format to the registry (the CLI's --trace-format choices come from it)."""
    return TRACE_FORMATS.register(fmt.name, fmt, fmt.description, replace=replace)


for _fmt in (
    TraceFormat("mooncake", "Mooncake FAST'25 JSONL: timestamp (ms), input_length, output_length, hash_ids",
                ".jsonl", ("timestamp", "input_length", "output_length", "hash_ids"), load_mooncake),
    TraceFormat("azure", "Azure LLM inference 2023 CSV: TIMESTAMP,ContextTokens,GeneratedTokens", ".csv",
                AZURE_COLUMNS, load_azure),
    TraceFormat("lengths", "length table CSV (ShareGPT, arXiv): num_prefill_tokens,num_decode_tokens; "
                "arrivals from --rate", ".csv", LENGTH_COLUMNS, load_lengths, needs_arrivals=True),
    TraceFormat("kvledger-jsonl", "kvledger JSONL: arrival_s, prompt_len, output_len [, group, prefix, prefix_len, "
                "n, priority, id]", ".jsonl", KVLEDGER_REQUIRED, load_kvledger),
    TraceFormat("kvledger-csv", "kvledger CSV: arrival_s,prompt_len,output_len[,group,prefix,prefix_len,n,priority,"
                "id]", ".csv", KVLEDGER_REQUIRED, load_kvledger),
):
    register_trace_format(_fmt)


def accepted_formats() -> str:
    """One line naming every registered format and its identifying columns."""
    return "; ".join(f"{f.name} ({','.join(f.columns)})" for f in TRACE_FORMATS.values())


def sniff_trace_format(path: str | Path) -> TraceFormat:
    """The registered format of a trace file, from its suffix and first non-blank line."""
    path = Path(path)
    head = _head(path)
    first = next((line for line in head.splitlines() if line.strip()), "")
    if not first:
        raise ConfigError(f"{path}: empty trace (accepted formats: {accepted_formats()})")
    suffix = ".jsonl" if path.suffix == ".jsonl" else ".csv"
    for fmt in TRACE_FORMATS.values():
        if fmt.matches(suffix, first.lstrip("\ufeff")):
            return fmt
    shown = first.strip()[:80]
    kind = "JSON keys of the first line" if suffix == ".jsonl" else "CSV header"
    raise ConfigError(f"{path}: unknown trace format ({kind} {shown!r}); accepted: {accepted_formats()}")


def trace_has_arrivals(path: str | Path) -> bool:
    """Whether a trace file carries its own arrival times: its sniffed format needs no arrival process
    (``TraceFormat.needs_arrivals``). The one answer every trace reader asks (the load client, diagnose);
    a file that cannot be read or sniffed counts as timed, so that loading it says what is wrong."""
    try:
        return not sniff_trace_format(path).needs_arrivals
    except (ConfigError, OSError):
        return True


AUTO_FORMAT = "auto"  # the --trace-format choice that asks the sniffer


def trace_format_choices() -> list[str]:
    """The --trace-format choices of every command that reads a trace: "auto", then each registered format."""
    return [AUTO_FORMAT, *TRACE_FORMATS]


def trace_format(path: str | Path, name: str | None = None) -> TraceFormat:
    """The registered format ``name``, or, for None or "auto", the one the sniffer recognises in the file."""
    if name is None or name == AUTO_FORMAT:
        return sniff_trace_format(path)
    fmt = TRACE_FORMATS.get(name)
    if fmt is None:
        raise ConfigError(f"unknown trace format {name!r}; known: {', '.join(TRACE_FORMATS)}")
    return fmt


def load_trace(path: str | Path, format: str | None = None, **kwargs: Any) -> list[SimRequest]:  # noqa: A002
    """Load a trace of any registered format (`TRACE_FORMATS`), named or (None, "auto") sniffed from the file.

    Formats that carry no arrival times (`lengths`) need `arrivals=` (a Poisson/Gamma process or times).
    Keyword arguments a format's loader does not take are dropped, so one call fits every format.
    """
    path = Path(path)
    fmt = trace_format(path, format)
    import inspect

    known = {name for f in TRACE_FORMATS.values() for name in inspect.signature(f.loader).parameters}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ConfigError(f"load_trace got unknown argument(s) {', '.join(unknown)}")
    accepted = inspect.signature(fmt.loader).parameters
    args = {k: v for k, v in kwargs.items() if k in accepted}
    if fmt.needs_arrivals and "arrivals" not in args:
        raise ConfigError(f"{path}: a {fmt.name} trace has no arrival times; give an arrival rate")
    return fmt.loader(path, **args)


__all__ = [
    "AUTO_FORMAT", "TRACE_FORMATS", "TraceFormat", "accepted_formats", "load_trace", "register_trace_format",
    "sniff_trace_format", "trace_format", "trace_format_choices", "trace_has_arrivals",
]
