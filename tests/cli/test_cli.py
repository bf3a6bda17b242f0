"""The `kvledger` command line: the seed's acceptance numbers, plan's JSON, and one-line errors.

The CLI runs in-process through `kvledger.cli.main.main(argv)`; one test runs the installed entry point
in a subprocess to prove the console script and `python -m kvledger` are wired up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvledger.cli.main import main

SEED = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--kv-dtype", "bf16", "--block-size", "16"]
# The seed's worked example, exactly as README.md quotes it.
LAB = ["--pool", "512MiB", "--requests", "8", "--prompt", "2048", "--shared-prefix", "2048",
       "--max-new", "257", "--groups", "1", "--json"]
SEED_ADMIT = ["admit", *SEED, *LAB]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc, out, err = run_cli(capsys, *argv)
    assert (rc, err) == (0, "")
    return json.loads(out)


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced."""
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


# ---- admit: the seed's fixed point ---------------------------------------------------------------

def test_seed_admission_acceptance_numbers(capsys):
    data = run_json(capsys, *SEED_ADMIT)
    expected = {
        "kv_bytes_per_token": 131072,
        "block_bytes": 2 * 2**20,
        "pool_bytes": 512 * 2**20,
        "pool_blocks": 256,
        "block_size": 16,
        "requests": 8,
        "groups": 1,
        "blocks_per_request": 145,
        "shared_prefix_blocks": 128,
        "private_blocks_per_request": 17,
        "blocks_needed_all": 264,
        "blocks_needed_unshared": 1160,
        "admitted": 7,
        "admitted_blocks": 247,
        "free_blocks_after": 9,
    }
    assert {key: data[key] for key in expected} == expected
    decisions = data["decisions"]
    assert len(decisions) == 8
    assert [d["outcome"] for d in decisions] == ["admitted"] * 7 + ["not_now"]
    assert [d["request"] for d in decisions] == [f"req-{i}" for i in range(8)]
    # the first request allocates the prefix; the others share it and promise only their suffix
    assert (decisions[0]["blocks_shared"], decisions[0]["blocks_new"], decisions[0]["blocks_promised"]) == (
        0, 128, 17)
    for d in decisions[1:]:
        assert (d["blocks_total"], d["blocks_shared"], d["blocks_new"], d["blocks_promised"]) == (
            145, 128, 0, 17)
    assert "only 9 can be promised" in decisions[7]["reason"]
    # live blocks and promises are separate ledgers: 128 prompt blocks + 7 x 17 promised
    usage = {"total": 256, "free": 128, "active": 128, "retained": 0, "evictable": 0, "promised": 119,
             "available": 9, "sequences": 7}
    assert {key: data["usage"][key] for key in usage} == usage


def test_every_request_its_own_trust_group_admits_one(capsys):
    data = run_json(capsys, *with_flag(SEED_ADMIT, "--groups", "8"))
    assert (data["admitted"], data["admitted_blocks"], data["free_blocks_after"]) == (1, 145, 111)
    assert data["blocks_needed_all"] == data["blocks_needed_unshared"] == 1160
    assert [d["outcome"] for d in data["decisions"]] == ["admitted"] + ["not_now"] * 7
    assert [d["group"] for d in data["decisions"]] == [f"group-{i}" for i in range(8)]
    assert all(d["blocks_shared"] == 0 for d in data["decisions"])


def test_no_prefix_cache_is_the_unshared_case(capsys):
    data = run_json(capsys, *SEED_ADMIT, "--no-prefix-cache")
    assert data["prefix_caching"] is False
    assert (data["shared_prefix_blocks"], data["blocks_needed_all"], data["admitted"]) == (0, 1160, 1)


@pytest.mark.parametrize(
    ("max_new", "per_request", "private", "needed_all", "admitted", "admitted_blocks", "left"),
    [
        (257, 145, 17, 264, 7, 247, 9),
        (256, 144, 16, 256, 8, 256, 0),  # one token less: a whole block less each, and all eight fit
        (129, 137, 9, 200, 8, 200, 56),
        (0, 128, 0, 128, 8, 128, 128),
    ],
)
def test_shorter_output_allowance_admits_more(capsys, max_new, per_request, private, needed_all, admitted,
                                              admitted_blocks, left):
    data = run_json(capsys, *with_flag(SEED_ADMIT, "--max-new", str(max_new)))
    got = (data["blocks_per_request"], data["private_blocks_per_request"], data["blocks_needed_all"],
           data["admitted"], data["admitted_blocks"], data["free_blocks_after"])
    assert got == (per_request, private, needed_all, admitted, admitted_blocks, left)
    assert data["shared_prefix_blocks"] == 128


def test_shorter_allowance_barely_helps_isolated_requests(capsys):
    argv = with_flag(SEED_ADMIT, "--groups", "8")
    assert run_json(capsys, *with_flag(argv, "--max-new", "129"))["admitted"] == 1  # 2 x 137 > 256
    assert run_json(capsys, *with_flag(argv, "--max-new", "0"))["admitted"] == 2  # 2 x 128 == 256


def test_admit_tables_show_the_same_numbers(capsys):
    argv = [a for a in SEED_ADMIT if a != "--json"]
    rc, out, err = run_cli(capsys, *argv)
    assert (rc, err) == (0, "")
    text = " ".join(out.split())  # rich wraps long lines; compare whitespace-insensitively
    assert "131,072 (128 KiB)" in text
    assert "16 tokens = 2 MiB" in text
    assert out.count("admitted") >= 7 and "not_now" in out
    assert "blocks per request 145 = 128 shared-prefix + 17 private" in text
    assert "all 8 together need 264" in text and "1160 unshared" in text
    assert "admitted 7 using 247 blocks (128 live + 119 promised); 9 left to promise" in text


def test_request_larger_than_the_pool_is_never(capsys):
    data = run_json(capsys, *with_flag(SEED_ADMIT, "--pool", "64MiB"))  # 32 blocks < 145
    assert data["pool_blocks"] == 32
    assert data["admitted"] == 0
    assert {d["outcome"] for d in data["decisions"]} == {"never"}


# ---- plan --------------------------------------------------------------------------------------

PLAN_KEYS = {"kv_bytes_per_token", "kv_heads_per_rank", "kv_replication", "block_bytes", "pool_blocks",
             "parameters", "weights_bytes_per_rank"}


def test_plan_seed_geometry_with_a_pool(capsys):
    data = run_json(capsys, "plan", *SEED, "--pool", "512MiB", "--json")
    assert PLAN_KEYS <= data.keys()
    assert "blocks_per_request" not in data and "max_concurrent_requests" not in data
    assert (data["kv_bytes_per_token"], data["kv_heads_per_rank"], data["kv_replication"]) == (131072, 8, 1)
    assert (data["block_bytes"], data["pool_blocks"], data["pool_bytes"]) == (2 * 2**20, 256, 512 * 2**20)
    # explicit geometry has no weights to count
    assert (data["parameters"], data["weights_bytes_per_rank"], data["model"]) == (0, 0, None)


def test_plan_request_shape(capsys):
    data = run_json(capsys, "plan", *SEED, "--pool", "512MiB", "--prompt", "2048", "--max-new", "257",
                    "--json")
    assert PLAN_KEYS | {"blocks_per_request", "max_concurrent_requests"} <= data.keys()
    assert (data["blocks_per_request"], data["max_concurrent_requests"]) == (145, 1)
    assert (data["prompt"], data["max_new"]) == (2048, 257)


def test_plan_bundled_model_on_a_named_gpu(capsys):
    data = run_json(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--prompt", "2048",
                    "--max-new", "257", "--json")
    assert PLAN_KEYS | {"blocks_per_request", "max_concurrent_requests"} <= data.keys()
    assert data["model"] == "llama-3.1-8b" and data["engine"] == "vllm"
    assert data["kv_bytes_per_token"] == 131072  # Llama 3.1 8B has the seed's KV geometry
    assert data["parameters"] == 8_030_261_248
    assert data["device_bytes"] == int(79.18 * 2**30)  # what the driver reports, not the datasheet's 80 GiB
    budget = int(0.9 * data["device_bytes"])
    spent = sum(t["bytes"] for t in data["terms"] if t["in_budget"])
    assert data["pool_blocks"] == (budget - spent) // data["block_bytes"] == 26301
    assert data["blocks_per_request"] == 145
    assert data["max_concurrent_requests"] == 26301 // 145 == 181


def test_plan_tp_splits_and_replicates_kv_heads(capsys):
    tp4 = run_json(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "4", "--json")
    assert (tp4["kv_heads_per_rank"], tp4["kv_replication"], tp4["kv_bytes_per_token"]) == (2, 1, 80 * 2**10)
    tp16 = run_json(capsys, "plan", "--model", "llama-3.1-70b", "--pool", "1GiB", "--tp", "16", "--json")
    assert (tp16["kv_heads_per_rank"], tp16["kv_replication"]) == (1, 2)  # 8 KV heads over 16 ranks
    assert tp16["kv_bytes_per_token"] == 40 * 2**10


def test_plan_tables_name_the_config_source(capsys):
    rc, out, err = run_cli(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb")
    assert (rc, err) == (0, "")
    assert "26,301 blocks" in out
    assert "config source: meta-llama/Llama-3.1-8B" in out


def test_plan_accepts_a_config_json_path(capsys, tmp_path):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for where in (tmp_path, tmp_path / "config.json"):
        data = run_json(capsys, "plan", "--model", str(where), "--pool", "512MiB", "--json")
        assert (data["kv_bytes_per_token"], data["pool_blocks"]) == (131072, 256)
        assert data["parameters"] > 0  # plan counts the weights of any config it is given
        data = run_json(capsys, "admit", "--model", str(where), *LAB)
        assert (data["admitted"], data["admitted_blocks"]) == (7, 247)


# ---- catalogues --------------------------------------------------------------------------------

def test_models_and_gpus_catalogues(capsys):
    models = run_json(capsys, "models", "--json")
    assert models["llama-3.1-8b"]["source"] == "meta-llama/Llama-3.1-8B config.json"
    assert models["mixtral-8x7b"]["parameters"] == 46_702_792_704
    assert len(models) >= 10 and all(m["source"] for m in models.values())
    assert models["llama-3.1-8b"]["hf_id"] == "meta-llama/Llama-3.1-8B"
    gpus = run_json(capsys, "gpus", "--json")
    assert gpus["h100-80gb"]["memory_bytes"] == int(79.18 * 2**30)
    assert gpus["h100-80gb"]["datasheet_memory"] == "80GiB" and gpus["l4"]["nvidia_smi_total_mib"] == 23034
    assert {"a100-80gb", "h100-80gb", "h200-141gb", "l4"} <= gpus.keys()
    rc, out, err = run_cli(capsys, "gpus")
    assert rc == 0 and "79.18 GiB" in out and "driver figure from" in out


def test_models_shows_each_hugging_face_id_in_its_own_column_and_plan_takes_it(capsys, monkeypatch):
    """`kvledger models` lists the HF id a user would type (was buried in a 'source' column as
    'meta-llama/Llama-3.1-8B config.json'); every id it shows is accepted by --model, and the table fits 100
    columns."""
    monkeypatch.setenv("COLUMNS", "100")
    rc, out, err = run_cli(capsys, "models")
    assert rc == 0, err
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "│ llama-3.1-8b  │ meta-llama/Llama-3.1-8B " in out and "config.json │" not in out
    models = run_json(capsys, "models", "--json")
    for name, row in models.items():
        assert row["hf_id"] and f" {row['hf_id']} " in out, name
        plan = run_json(capsys, "plan", "--model", row["hf_id"], "--json")
        assert plan["model"] == name and plan["kv_bytes_per_token"] > 0  # the id resolves to the bundled config


# ---- errors: one line on stderr, exit code 2, never a traceback ----------------------------------

PLAN_SEED = ["plan", *SEED]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan", "--model", "no-such-model", "--pool", "1GiB"], "unknown model 'no-such-model'"),
        (["plan", "--model", "llama-3.1-70b", "--tp", "3", "--gpu", "h100-80gb"], "tp=3 must divide"),
        (["admit", "--model", "llama-3.1-70b", "--tp", "3", "--pool", "1GiB"], "tp=3 must divide"),
        ([*PLAN_SEED, "--pool", "0"], "byte size must be positive"),
        ([*PLAN_SEED, "--pool", "-5"], "not a byte size"),
        ([*PLAN_SEED, "--pool", "banana"], "not a byte size"),
        ([*PLAN_SEED, "--pool", "1MiB"], "smaller than one KV block"),
        (with_flag(SEED_ADMIT, "--pool", "1MiB"), "smaller than one KV block"),
        (["plan", "--layers", "0", "--kv-heads", "8", "--head-dim", "128", "--pool", "1GiB"],
         "'--layers': 0 is not in [1, 10,000]"),
        (["plan", "--layers", "32", "--kv-heads", "-8", "--head-dim", "128", "--pool", "1GiB"],
         "'--kv-heads': -8 is not in [1,"),
        (with_flag([*PLAN_SEED, "--pool", "1GiB"], "--block-size", "0"), "'--block-size': 0 is not in [1, 4,096]"),
        ([*PLAN_SEED, "--pool", "1GiB", "--tp", "0"], "'--tp': 0 is not in [1, 1,024]"),
        (with_flag(SEED_ADMIT, "--requests", "0"), "'--requests': 0 is not in [1, 100,000]"),
        (with_flag(SEED_ADMIT, "--prompt", "-1"), "'--prompt': -1 is not in [1,"),
        (with_flag(SEED_ADMIT, "--max-new", "-1"), "'--max-new': -1 is not in [0,"),
        (with_flag(SEED_ADMIT, "--groups", "0"), "'--groups': 0 is not in [1,"),
        (with_flag(SEED_ADMIT, "--shared-prefix", "4096"), "cannot exceed prompt"),
        ([*PLAN_SEED, "--pool", "1GiB", "--prompt", "-1", "--max-new", "0"], "'--prompt': -1 is not in [0,"),
        ([*PLAN_SEED, "--pool", "1GiB", "--prompt", "0", "--max-new", "0"], "at least one token"),
        ([*PLAN_SEED, "--pool", "1GiB", "--prompt", "10"], "give both --prompt and --max-new"),
        (["plan", "--pool", "1GiB"], "give --model NAME, or all of --layers"),
        (["plan", "--layers", "32", "--kv-heads", "8", "--pool", "1GiB"], "give --model NAME, or all of"),
        (["admit", "--pool", "512MiB"], "give --model NAME, or all of"),
        ([*PLAN_SEED, "--gpu", "l4"], "geometry given by hand needs --params or --weights"),
        (["plan", "--model", "llama-3.1-8b", "--layers", "32", "--pool", "1GiB"],
         "either --model or --layers"),
        (["plan", "--layers", "abc", "--kv-heads", "8", "--head-dim", "128", "--pool", "1GiB"],
         "'abc' is not an integer"),
        ([*PLAN_SEED, "--pool", "1GiB", "--prompt", "2k", "--max-new", "1"], "'2k' is not an integer"),
        ([*PLAN_SEED, "--pool", "1GiB", "--kv-dtype", "fp7"], "unknown dtype 'fp7'"),
        ([*PLAN_SEED, "--gpu", "x100"], "unknown GPU 'x100'"),
        ([*PLAN_SEED, "--gpu", "h100-80gb", "--device-memory", "80GiB"], "give one of --pool, --gpu"),
        ([*PLAN_SEED, "--gpu", "l4", "--utilization", "1.5"], "'1.5' is not a number in (0, 1]"),
        (["plan", "--model", "llama-3.1-70b", "--gpu", "l4"], "model does not fit"),
        (["admit", *SEED], "give one of --pool, --gpu and --device-memory"),
        (["plan", "--bogus"], "No such option"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, fragment):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert err.startswith("kvledger: error: ")
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert fragment in err


def malformed_configs(tmp_path: Path) -> list[tuple[Path, str]]:
    cases = {
        "not-json": ("{ this is not json", "is not valid JSON"),
        "a-list": ("[1, 2, 3]", "must hold a JSON object"),
        "no-layers": (json.dumps({"num_attention_heads": 32, "hidden_size": 4096}),
                      "missing required key 'num_hidden_layers'"),
        "string-layers": (json.dumps({"num_hidden_layers": "32", "num_attention_heads": 32,
                                      "hidden_size": 4096}), "'num_hidden_layers' must be an integer"),
        "bad-head-split": (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100}),
                           "not divisible"),
    }
    out = []
    for name, (text, fragment) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        out.append((folder / "config.json", fragment))
    return out


def test_malformed_config_json_is_one_line_and_exit_code_2(capsys, tmp_path):
    for path, fragment in malformed_configs(tmp_path):
        for command in (["plan", "--pool", "1GiB"], ["admit", "--pool", "512MiB"]):
            rc, out, err = run_cli(capsys, *command, "--model", str(path))
            assert (rc, out) == (2, ""), path
            assert err.count("\n") == 1 and err.startswith("kvledger: error: "), err
            assert fragment in err, err
    missing = tmp_path / "missing" / "config.json"
    rc, _, err = run_cli(capsys, "plan", "--model", str(missing), "--pool", "1GiB")
    assert rc == 2 and "no model config at" in err and err.count("\n") == 1


def test_zero_reserve_is_accepted_in_any_spelling(capsys):
    """`--reserve 0` turns the runtime reserve off; `0B`/`0GiB` are the same size and must mean the same."""
    base = [*PLAN_SEED, "--gpu", "l4", "--params", "1B", "--engine", "kvledger", "--json"]
    plain = run_json(capsys, *base, "--reserve", "0")
    assert plain["reserve_bytes"] == 0
    for spelling in ("0B", "0GiB"):
        rc, out, err = run_cli(capsys, *base, "--reserve", spelling)
        assert (rc, err) == (0, ""), f"--reserve {spelling}: {err.strip()}"
        assert json.loads(out) == plain


# ---- the installed entry point -----------------------------------------------------------------

def test_entry_points_run_in_a_subprocess():
    exe = Path(sys.executable).with_name("kvledger")
    commands = [[sys.executable, "-m", "kvledger", *SEED_ADMIT]]
    if exe.exists():
        commands.append([str(exe), *SEED_ADMIT])
    for cmd in commands:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        data = json.loads(proc.stdout)
        assert (data["admitted"], data["admitted_blocks"], data["free_blocks_after"]) == (7, 247, 9)
    proc = subprocess.run([sys.executable, "-m", "kvledger", "plan", "--model", "nope", "--pool", "1GiB"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "unknown model 'nope'" in proc.stderr


def test_readme_quotes_the_acceptance_command():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert " ".join(["kvledger", *SEED_ADMIT]) in readme


def test_demo_script_runs_and_shows_the_seed_numbers():
    root = Path(__file__).resolve().parents[2]
    exe = Path(sys.executable).with_name("kvledger")
    if not exe.exists():
        pytest.fail(f"no kvledger console script beside {sys.executable}; run `make install`")
    demo = root / "scripts" / "demo.sh"
    proc = subprocess.run(["bash", str(demo), str(exe)], capture_output=True, text=True, timeout=120,
                          check=False, cwd=root)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "admitted 7 using 247 blocks (128 live + 119 promised); 9 left to promise" in out
    assert "admitted 1 using 145 blocks" in out
    assert "admitted 8 using 200 blocks" in out
    assert "max-new 256, 1 group(s): 144 blocks/request; admitted 8 of 8 using 256 of 256 blocks" in out
    assert "26,301 blocks" in out
    # The KV geometry table once for the seed (step 1) and once for Llama 3.1 8B (step 5), not before each admit.
    assert proc.stdout.count("KV geometry (per rank)") == 2
