"""What a user reads off report folders and sweep tables: the best load under an SLO and a side-by-side compare.

`best_under_slo` answers "the highest rate this deployment serves within the TTFT/TPOT target"
(`kvledger sweep --slo-*`): it must name the highest qualifying row, not the first, the last or the highest
overall. `compare_reports` (`kvledger compare A B`) reads two folders' metrics.json as UTF-8 whatever the
machine's locale, and refuses a metrics.json over 64 MiB (characters) before parsing it.
"""

from __future__ import annotations

import json
import locale
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvledger.errors import ConfigError
from kvledger.sim.report import best_under_slo, compare_reports


def _row(rate: float, ttft: float, tpot: float, *, saturated: bool = False, served: float | None = None
         ) -> dict[str, Any]:
    """A sweep row at `rate` req/s offered, served at `served` (default: all of it)."""
    return {"rate": rate, "offered_req_s": rate, "served_req_s": rate if served is None else served,
            "saturated": saturated, "ttft_p50_s": ttft / 2, "ttft_p90_s": ttft, "ttft_p99_s": ttft * 2,
            "tpot_p50_s": tpot / 2, "tpot_p90_s": tpot, "tpot_p99_s": tpot * 2}


# Rates out of order: the answer is the highest rate meeting the target, wherever it sits in the table.
ROWS = [_row(4.0, 0.20, 0.02), _row(16.0, 0.90, 0.03), _row(8.0, 0.40, 0.02), _row(2.0, 0.10, 0.01),
        _row(12.0, 0.45, 0.09), _row(10.0, 0.30, 0.02, served=9.0), _row(32.0, 0.10, 0.01, saturated=True),
        {**_row(64.0, 0.10, 0.01), "rate": None}]


def test_the_best_load_under_an_slo_is_the_highest_rate_that_meets_it() -> None:
    """TTFT p90 <= 0.5 s: 16 (too slow), 32 (saturated), 10 (served 90% < 95%) and the row without a rate are
    out; of 2, 4, 8 and 12 the highest is 12 -- unless TPOT p90 <= 0.05 s also holds, which leaves 8."""
    assert best_under_slo(ROWS, "rate", ttft_s=0.5)["rate"] == 12.0
    assert best_under_slo(ROWS, "rate", ttft_s=0.5, tpot_s=0.05)["rate"] == 8.0
    assert best_under_slo(ROWS, "rate", ttft_s=0.5, tpot_s=0.05) is ROWS[2]
    assert best_under_slo(ROWS, "rate", ttft_s=0.25, pct=90)["rate"] == 4.0
    assert best_under_slo(ROWS, "rate", ttft_s=0.25, pct=50)["rate"] == 12.0  # p50 = half of p90 here
    assert best_under_slo(ROWS, "rate")["rate"] == 16.0  # no target: the highest that keeps up
    assert best_under_slo(ROWS, "ttft_p90_s", ttft_s=0.5)["rate"] == 12.0  # any numeric column ranks
    assert best_under_slo(ROWS, "rate", ttft_s=0.05) is None
    assert best_under_slo([], "rate") is None
    with pytest.raises(ConfigError, match="SLO percentile must be 50, 90 or 99"):
        best_under_slo(ROWS, "rate", ttft_s=0.5, pct=95)


def _report(folder: Path, metrics: dict[str, Any]) -> Path:
    folder.mkdir()
    (folder / "metrics.json").write_text(json.dumps(metrics, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture
def ascii_locale() -> Iterator[None]:
    """The C locale's ASCII as the default text encoding (a server without a UTF-8 locale), restored after."""
    old = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, old)


def test_two_report_folders_compare_side_by_side_whatever_the_locale(tmp_path: Path, ascii_locale: None) -> None:
    """A hand-labelled metrics.json (UTF-8, non-ASCII) compares the same on a machine whose locale is ASCII."""
    if not sys.flags.utf8_mode:
        with (tmp_path / "probe").open("w") as fh:
            assert fh.encoding.lower() in ("ascii", "ansi_x3.4-1968", "us-ascii")  # the fixture took effect
    a = _report(tmp_path / "a", {
        "source": "simulator — h100", "requests": 40, "completed": 38, "throughput_tok_s": 812.5,
        "throughput_req_s": 3.2, "prefix_hit_rate": 0.25, "ttft_s": {"p50": 0.1, "p90": 0.3, "p99": 0.6},
        "tpot_s": {"p50": 0.01, "p90": 0.02, "p99": 0.04}, "e2e_s": {"p99": 2.5},
        "saturation": {"saturated": False}})
    b = _report(tmp_path / "b", {"source": "serve-trace · café", "requests": 40, "completed": 40,
                                 "ttft_s": None, "saturation": {"saturated": True}})
    assert compare_reports(a, b) == [
        ("source", "simulator — h100", "serve-trace · café"),
        ("requests", 40, 40), ("completed", 38, 40), ("throughput_tok_s", 812.5, None),
        ("throughput_req_s", 3.2, None), ("prefix_hit_rate", 0.25, None),
        ("ttft_p50_s", 0.1, None), ("ttft_p90_s", 0.3, None), ("ttft_p99_s", 0.6, None),
        ("tpot_p50_s", 0.01, None), ("tpot_p90_s", 0.02, None), ("tpot_p99_s", 0.04, None),
        ("e2e_p50_s", None, None), ("e2e_p90_s", None, None), ("e2e_p99_s", 2.5, None),
        ("saturated", False, True),
    ]


def test_a_metrics_file_over_64_mib_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """Exactly 64 MiB is still read; one byte more is refused before it is read, with a ConfigError naming
    the file and the limit, so `kvledger compare` never reads a file of any size. (The size error used to
    be raised inside the parse's ``try`` and reported as "not valid JSON".)"""
    small = _report(tmp_path / "small", {"source": "simulator", "requests": 1})
    big = tmp_path / "big"
    big.mkdir()
    head, tail = '{"source": "padded", "note": "', '"}'
    text = head + "x" * (64 * 2**20 - len(head) - len(tail)) + tail
    assert len(text) == 64 * 2**20
    try:
        (big / "metrics.json").write_text(text, encoding="utf-8")
        assert compare_reports(small, big)[0] == ("source", "simulator", "padded")
        (big / "metrics.json").write_text(text + " ", encoding="utf-8")  # valid JSON, one character over
        with pytest.raises(ConfigError, match=re.escape(f"{big / 'metrics.json'} is larger than 64 MiB")):
            compare_reports(small, big)
    finally:
        (big / "metrics.json").unlink()  # pytest keeps recent tmp folders: do not leave 64 MiB behind
    with pytest.raises(ConfigError, match="is not a kvledger report"):
        compare_reports(big.parent / "small", _report(tmp_path / "list", [1, 2]))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="metrics.json is missing"):
        compare_reports(small, tmp_path / "nowhere")
