"""The quality records shipped in ``kvledger/data/quality/records/``: each one lets the engine serve a
quantised KV format for the bundled weights without ``--allow-untested-kv``, so each must still say what
it vouches for. Checked from the records alone (no model run): the format's shipped contract holds on the
record's own cases and on its held-out prompts (every held-out clause scored), the protocol was the complete
one, and the record names the format as it is defined now
-- a format whose definition changed has another identity, and a record of the old one must not pass for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvledger.core.sizing.geometry import KVSpec
from kvledger.core.sizing.kv_formats import get_kv_format
from kvledger.runtime.measure import quality_records as qr


def shipped() -> list[tuple[Path, dict]]:
    return [(p, json.loads(p.read_text())) for p in sorted(qr.SHIPPED_RECORDS.glob("*.json"))]


def test_the_int8_record_ships_for_the_bundled_weights() -> None:
    formats = {rec["format"]: rec for _, rec in shipped()}
    assert "int8" in formats
    assert formats["int8"]["model"] == "smollm2-135m"
    assert formats["int8"]["kv_format"].startswith("int8:k=asym/channel/")  # int8 is the per-channel-key format


def test_the_kvtc_record_ships_with_the_4bit_target_met() -> None:
    formats = {rec["format"]: rec for _, rec in shipped()}
    rec = formats["kvtc"]
    assert rec["model"] == "smollm2-135m" and "sink=exact/first-token" in rec["kv_format"]
    smollm2 = KVSpec(layers=30, kv_heads=3, head_dim=64, block_size=16, kv_dtype="kvtc")
    assert 23040 / smollm2.bytes_per_token >= 3.5  # 3.5x fewer bytes than bf16, everything in the page counted
    assert max(c["ppl_rel_change"] for c in rec["cases"]) <= 0.03  # every text within 3%
    assert rec["held_out"]["summary"]["ppl_rel_change_pooled"] <= 0.01  # held out, pooled within 1%


@pytest.mark.parametrize(("path", "record"), shipped(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_a_shipped_record_meets_its_formats_shipped_contract_on_the_complete_protocol(path: Path, record: dict) -> None:
    assert record["passed"] is True
    protocol = record["protocol"]
    assert protocol["complete"] is True and protocol["new_tokens"] >= 128
    assert set(protocol["kinds"]) == {"prose", "code", "chat"} and max(protocol["contexts"]) >= 2048
    assert {(c["kind"], c["context"]) for c in record["cases"]} == {
        (k, n) for k in protocol["kinds"] for n in protocol["contexts"]}
    contract = qr.load_contract(record["format"])
    verdict = qr.evaluate(contract, record["cases"])
    assert verdict and all(v["ok"] for v in verdict), [v for v in verdict if not v["ok"]]


@pytest.mark.parametrize(("path", "record"), shipped(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_a_shipped_record_meets_its_formats_shipped_contract_on_held_out_prompts(path: Path, record: dict) -> None:
    assert qr.record_blocker(record) is None
    contract, held = qr.load_contract(record["format"]), record["held_out"]
    assert contract.held_out and held["prompts"] == len(held["cases"]) >= 4
    verdict = qr.evaluate(contract, held["cases"])
    assert verdict and all(v["ok"] for v in verdict), [v for v in verdict if not v["ok"]]
    for t in contract.held_out:
        assert t.check(held["summary"][t.metric]), (t.describe(), held["summary"][t.metric])


@pytest.mark.parametrize(("path", "record"), shipped(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_a_shipped_record_names_its_format_as_defined_now(path: Path, record: dict) -> None:
    fmt = get_kv_format(record["format"])
    assert record["format"] == fmt.name  # recorded under the format's name now, not a former one
    residual = record["kv_format"].rsplit("residual=", 1)[-1].split("/")[0] if "residual=" in record["kv_format"] \
        else None
    assert record["kv_format"] == fmt.identity(16, residual), (
        f"{path.name} vouches for {record['kv_format']!r}, but {record['format']} is now "
        f"{fmt.identity(16, residual)!r}: measure it again")
    assert record["weights_revision"].startswith("sha256:")


@pytest.mark.parametrize(("path", "record"), shipped(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_a_shipped_record_names_the_calibrated_file_shipped_now(path: Path, record: dict) -> None:
    # kvtc's tables (int4-smooth's constants) are part of what a record vouches for: fitted again, they need a new one
    now = qr.calibration_digest(record["format"], record["weights_revision"])
    assert record.get("calibration") == now, f"{path.name} was measured with other tables: measure it again"
    assert (now is None) == (record["format"] == "int8")


def test_a_record_serves_only_the_calibrated_file_it_was_measured_with(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path))
    fid = get_kv_format("kvtc").identity(16, "fp32")
    report = {"model": "m", "weights_revision": "sha256:0123456789abcdef", "format": "kvtc", "kv_format": fid,
              "calibration": "aaaaaaaaaaaaaaaa", "passed": True, "cases": [], "contract": {},
              "protocol": {"complete": True}, "held_out": {"cases": [{"prompt": 0}]}, "verdict": []}
    saved = qr.save_record(report)
    assert json.loads(saved.read_text())["calibration"] == "aaaaaaaaaaaaaaaa"
    assert qr.find_record("sha256:0123456789abcdef", fid, "aaaaaaaaaaaaaaaa")[0] == saved
    assert qr.find_record("sha256:0123456789abcdef", fid, "bbbbbbbbbbbbbbbb") is None  # tables fitted again
    assert qr.find_record("sha256:0123456789abcdef", fid) is None

