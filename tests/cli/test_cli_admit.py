"""`kvledger admit` sized like `plan` (--model/--gpu) and fed a requests file of mixed lengths and groups."""

from __future__ import annotations

import json

import pytest

from cli_run import run  # tests/cli_run.py (pytest's pythonpath)

SEED = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--kv-dtype", "bf16", "--block-size", "16"]


def run_json(capsys, *argv):
    rc, out, err = run(capsys, *argv)
    assert (rc, err) == (0, ""), err
    return json.loads(out)


def test_admit_sizes_the_pool_like_plan(capsys):
    plan = run_json(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "l4", "--json")
    data = run_json(capsys, "admit", "--model", "llama-3.1-8b", "--gpu", "l4", "--requests", "64", "--prompt",
                    "1024", "--max-new", "256", "--groups", "4", "--json")
    assert data["pool_blocks"] == plan["pool_blocks"] and data["pool_sized_by"] == "kvledger plan (vllm engine)"
    per_request = -(-(1024 + 256) // 16)
    assert data["blocks_per_request"] == per_request
    assert data["admitted"] == min(64, plan["pool_blocks"] // per_request)
    other = run_json(capsys, "admit", "--model", "llama-3.1-8b", "--device-memory", "22.03GiB", "--requests", "2",
                     "--json")
    assert other["pool_blocks"] == plan["pool_blocks"]  # the catalogue's L4 is what its driver reports


def test_requests_file_with_mixed_lengths_and_groups(capsys, tmp_path):
    rows = [
        {"id": "sys-a1", "prompt": 2048, "max_new": 257, "group": "a", "prefix": "system", "prefix_len": 2048},
        {"id": "sys-a2", "prompt": 2100, "max_new": 100, "group": "a", "prefix": "system", "prefix_len": 2048},
        {"id": "sys-b1", "prompt": 2048, "max_new": 10, "group": "b", "prefix": "system", "prefix_len": 2048},
        {"id": "short", "prompt": 50, "max_new": 14},
        {"id": "huge", "prompt": 5000, "max_new": 1000},
        {"id": "pair", "prompt": 100, "max_new": 28, "branches": 2},
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = run_json(capsys, "admit", *SEED, "--pool", "512MiB", "--requests-file", str(path), "--json")
    d = {x["request"]: x for x in data["decisions"]}
    assert data["requests"] == 6 and data["groups"] == 3 and data["pool_blocks"] == 256
    assert (d["sys-a1"]["outcome"], d["sys-a1"]["blocks_new"], d["sys-a1"]["blocks_promised"]) == ("admitted", 128, 17)
    # Same group, same named prefix: the 128 prefix blocks are shared, only the tail is new.
    assert (d["sys-a2"]["outcome"], d["sys-a2"]["blocks_shared"]) == ("admitted", 128)
    assert d["sys-a2"]["blocks_new"] + d["sys-a2"]["blocks_promised"] == -(-(2100 + 100) // 16) - 128
    # Another trust group never shares, even with identical tokens: its 129 blocks no longer fit.
    assert (d["sys-b1"]["outcome"], d["sys-b1"]["blocks_shared"]) == ("not_now", 0)
    assert d["short"]["outcome"] == "admitted"  # a refused request does not block later ones
    assert d["huge"]["outcome"] == "never"  # 375 blocks: larger than the whole pool
    assert d["pair"]["branches"] == 2
    assert sum(data["outcomes"].values()) == 6
    assert data["admitted_blocks"] + data["free_blocks_after"] <= 256
    csv_path = tmp_path / "requests.csv"
    csv_path.write_text("id,prompt,max_new,group,prefix,prefix_len,branches\n" + "\n".join(
        ",".join(str(r.get(k, "")) for k in ("id", "prompt", "max_new", "group", "prefix", "prefix_len", "branches"))
        for r in rows) + "\n")
    same = run_json(capsys, "admit", *SEED, "--pool", "512MiB", "--requests-file", str(csv_path), "--json")
    assert [x["outcome"] for x in same["decisions"]] == [x["outcome"] for x in data["decisions"]]
    rc, out, err = run(capsys, "admit", *SEED, "--pool", "512MiB", "--requests-file", str(path))
    assert rc == 0 and "sys-a2" in out and "outcomes:" in out


@pytest.mark.parametrize(("body", "fragment"), [
    ('{"prompt": 10}\n', "missing 'max_new'"),
    ('{"prompt": 10, "max_new": 1, "colour": "red"}\n', "unknown field(s) colour"),
    ('{"prompt": 10, "max_new": 1, "prefix_len": 4}\n', "prefix_len without a prefix name"),
    ('{"prompt": 10, "max_new": 1, "prefix": "p", "prefix_len": 40}\n', "exceeds prompt"),
    ('{"id": "x", "prompt": 1, "max_new": 1}\n{"id": "x", "prompt": 1, "max_new": 1}\n', "appears twice"),
    ("\n", "holds no requests"),
])
def test_bad_requests_files_are_one_line(capsys, tmp_path, body, fragment):
    path = tmp_path / "r.jsonl"
    path.write_text(body)
    rc, out, err = run(capsys, "admit", *SEED, "--pool", "512MiB", "--requests-file", str(path))
    assert (rc, out) == (2, "") and err.count("\n") == 1 and fragment in err, err


def test_requests_file_honours_policy(capsys, tmp_path):
    """`--policy` used to be dropped with a requests file: every policy reserved the whole allowance and the
    table said "full reservation"."""
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt": 160, "max_new": 800}) for i in range(8)) + "\n")
    full = run_json(capsys, "admit", *SEED, "--pool", "256MiB", "--requests-file", str(path), "--json")
    inc = run_json(capsys, "admit", *SEED, "--pool", "256MiB", "--requests-file", str(path), "--policy",
                   "incremental", "--json")
    assert (full["policy"], inc["policy"]) == ("full", "incremental")
    assert full["decisions"][0]["blocks_promised"] == 50  # 800 tokens of output reserved up front
    assert inc["decisions"][0]["blocks_promised"] <= 1  # the next token only
    assert inc["admitted"] > full["admitted"]
    rc, out, err = run(capsys, "admit", *SEED, "--pool", "256MiB", "--requests-file", str(path), "--policy",
                       "incremental")
    assert rc == 0 and "Admission (incremental)" in out and "full reservation" not in out
