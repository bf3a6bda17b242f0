"""The web lab's JSON endpoints, called directly: the seed's numbers, parity with `kvledger admit --json`, the
block map's conservation law, the scored prediction, the written decision, the quiz, the small views, and
one clear error (never a traceback) for bad input."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.cli.main import main
from kvledger.weblab import create_app, lesson
from kvledger.weblab.inputs import LabInput

SEED_FLAGS = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--kv-dtype", "bf16", "--block-size", "16",
              "--pool", "512MiB", "--requests", "8", "--prompt", "2048", "--shared-prefix", "2048"]


def _panel(lab: dict, groups: int) -> dict:
    return next(p for p in lab["panels"] if p["groups"] == groups)


# ---- parity with the CLI ---------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, flags", [
    ({}, ["--max-new", "257", "--groups", "1"]),
    ({"groups": 8}, ["--max-new", "257", "--groups", "8"]),
    ({"max_new": 129}, ["--max-new", "129", "--groups", "1"]),
    ({"max_new": 256, "groups": 2}, ["--max-new", "256", "--groups", "2"]),
    ({"policy": "incremental"}, ["--max-new", "257", "--policy", "incremental"]),
    ({"branches": 2, "prompt": 2000, "shared_prefix": 1000}, ["--max-new", "257", "--branches", "2",
                                                             "--prompt", "2000", "--shared-prefix", "1000"]),
    ({"prefix_cache": False}, ["--max-new", "257", "--no-prefix-cache"]),
])
def test_admit_endpoint_is_kvledger_admit_json(client, seed, capsys, changes, flags):
    seed.update(changes)
    got = client.post("/api/admit", json=seed)
    assert got.status_code == 200
    capsys.readouterr()
    assert main(["admit", *SEED_FLAGS, *flags, "--json"]) == 0
    assert got.json() == json.loads(capsys.readouterr().out)


def test_admit_endpoint_takes_a_bundled_model(client, capsys):
    body = {"model": "llama-3.1-8b", "pool": "1GiB", "requests": 4, "prompt": 1000, "shared_prefix": 500,
            "max_new": 100, "groups": 2}
    got = client.post("/api/admit", json=body).json()
    assert main(["admit", "--model", "llama-3.1-8b", "--pool", "1GiB", "--requests", "4", "--prompt", "1000",
                 "--shared-prefix", "500", "--max-new", "100", "--groups", "2", "--json"]) == 0
    assert got == json.loads(capsys.readouterr().out)
    assert got["kv_bytes_per_token"] == 131072  # Llama 3.1 8B has the seed's KV geometry


# ---- the seed's exercise ---------------------------------------------------------------------------------
def test_seed_one_group_and_eight_groups(client, seed):
    lab = client.post("/api/lab", json=seed).json()
    assert lab["admit"]["blocks_per_request"] == 145
    one, eight = _panel(lab, 1), _panel(lab, 8)
    assert [p["groups"] for p in lab["panels"]] == [1, 8]
    assert (one["admitted"], one["admitted_blocks"], one["free_blocks_after"]) == (7, 247, 9)
    assert (one["blocks_needed_all"], one["blocks_needed_unshared"]) == (264, 1160)
    assert (one["shared_prefix_blocks"], one["private_blocks_per_request"]) == (128, 17)
    assert [d["outcome"] for d in one["decisions"]] == ["admitted"] * 7 + ["not_now"]
    refused = one["decisions"][7]["reason"]
    assert "needs 17 new blocks" in refused and "only 9 can be promised" in refused
    assert (eight["admitted"], eight["admitted_blocks"], eight["free_blocks_after"]) == (1, 145, 111)
    # The block map: one cell per block, by state.
    assert one["map"]["counts"] == {"shared": 128, "private": 0, "promised": 119, "retained": 0, "free": 9}
    assert eight["map"]["counts"] == {"shared": 0, "private": 128, "promised": 17, "retained": 0, "free": 111}
    cells = one["map"]["cells"]
    assert len(cells) == 256 and [c["block"] for c in cells] == list(range(256))
    assert all(c["owner"] == "7 requests of group-0" for c in cells[:128])
    # Tail slack: each admitted request's last page holds 1 of 16 tokens at its full reservation.
    slack = [c for c in cells if c.get("slack")]
    assert len(slack) == 7 and all(c["slack"] == 15 and c["state"] == "promised" for c in slack)
    assert {c["owner"].split()[0] for c in slack} == {f"req-{i}" for i in range(7)}
    # Owner colours: one per request for its promises, one for the shared prefix.
    assert len({c["tint"] for c in cells if c["state"] == "promised"}) == 7


def test_a_shorter_allowance_admits_all_eight(client, seed):
    lab = client.post("/api/lab", json=dict(seed, max_new=129)).json()
    one = _panel(lab, 1)
    assert (one["blocks_per_request"], one["admitted"], one["admitted_blocks"]) == (137, 8, 200)
    assert one["free_blocks_after"] == 56
    assert _panel(lab, 8)["admitted"] == 1


def test_the_controls_group_count_gets_its_own_panel(client, seed):
    lab = client.post("/api/lab", json=dict(seed, groups=2)).json()
    assert [p["groups"] for p in lab["panels"]] == [1, 2, 8]
    two = _panel(lab, 2)
    assert two["title"] == "2 trust groups (your controls)"
    assert two["map"]["counts"]["shared"] == 128  # group-0's prefix; group-1's copy is held by one request
    assert two["admitted"] == lab["admit"]["admitted"]


def test_block_map_partial_tails_and_private_prompt_blocks(client):
    body = {"layers": 2, "kv_heads": 1, "head_dim": 8, "block_size": 4, "pool": "4KiB", "requests": 3, "prompt": 10,
            "shared_prefix": 8, "max_new": 0, "groups": 1}
    lab = client.post("/api/lab", json=body).json()
    one = _panel(lab, 1)
    assert one["pool_blocks"] == 16 and one["admitted"] == 3  # 64 bytes per token, 256 per block
    # 2 shared blocks (8 tokens), then one private partial block per request holding 2 of 4 tokens.
    assert one["map"]["counts"] == {"shared": 2, "private": 3, "promised": 0, "retained": 0, "free": 11}
    live_slack = [c for c in one["map"]["cells"] if c.get("slack")]
    assert [(c["state"], c["slack"]) for c in live_slack] == [("private", 2)] * 3
    assert all("unused now" in c["slack_note"] for c in live_slack)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4, 16]), requests=st.integers(1, 6), prompt=st.integers(1, 64),
       shared=st.integers(0, 64), max_new=st.integers(0, 40), groups=st.integers(1, 6),
       pool_blocks=st.integers(1, 120), policy=st.sampled_from(["full", "incremental", "predicted"]),
       branches=st.integers(1, 3), prefix=st.booleans())
def test_block_map_conserves_the_pool(block_size, requests, prompt, shared, max_new, groups, pool_blocks, policy,
                                      branches, prefix):
    """Every cell is in exactly one state; the states add up to the pool; live cells are the ledger's active
    blocks and drawn promises its promises (while free blocks can carry them); the numbers are the lab's."""
    inp = LabInput(layers=1, kv_heads=1, head_dim=1, kv_dtype="fp8_e4m3", block_size=block_size,
                   pool=f"{2 * block_size * pool_blocks}B", requests=requests, prompt=prompt,
                   shared_prefix=min(shared, prompt), max_new=max_new, groups=min(groups, requests),
                   policy=policy, branches=branches, prefix_cache=prefix)
    _spec, _bytes, _lab, panels = lesson.panels(inp)
    for p in panels:
        m, u = p["map"], p["usage"]
        assert m["usage"] == u
        assert sum(m["counts"].values()) == len(m["cells"]) == p["pool_blocks"] == pool_blocks
        assert m["counts"]["shared"] + m["counts"]["private"] == u["active"]
        assert m["counts"]["promised"] == min(u["promised"], u["free"])
        assert m["counts"]["free"] == u["free"] - m["counts"]["promised"]
        assert p["admitted"] == sum(d["outcome"] == "admitted" for d in p["decisions"])
        assert p["admitted_blocks"] == u["active"] + u["promised"]


# ---- prediction, decision, model answer --------------------------------------------------------------------
def test_prediction_is_scored_against_the_ledger(client, seed):
    right = {"blocks_per_request": 145, "one_group_needed": 264, "one_group_admitted": 7, "isolated_needed": 1160,
             "isolated_admitted": 1}
    got = client.post("/api/score", json={"controls": seed, "prediction": right}).json()
    assert (got["correct"], got["total"]) == (5, 5)
    wrong = client.post("/api/score", json={"controls": seed, "prediction": {"blocks_per_request": 144,
                                                                             "one_group_admitted": 8}}).json()
    verdicts = {i["key"]: i["correct"] for i in wrong["items"]}
    assert verdicts == {"blocks_per_request": False, "one_group_needed": None, "one_group_admitted": False,
                        "isolated_needed": None, "isolated_admitted": None}
    steps = {s["name"]: s for s in got["arithmetic"]}
    assert steps["KV bytes per token"]["formula"] == "32 layers x 8 KV heads x 128 x 2 K/V x 2 bytes"
    assert steps["KV bytes per token"]["result"] == "131,072 bytes = 128 KiB"
    assert steps["Page bytes"]["result"] == "2,097,152 bytes = 2 MiB"
    assert steps["Pool pages"]["result"] == "256 pages"
    assert steps["Request pages"]["formula"] == "ceil((2,048 + 257) / 16)"
    assert steps["Request pages"]["result"].startswith("145 pages (the last page holds 1 of 16 tokens")
    assert steps["Shared + private (one trust group)"]["formula"] == "128 shared + 8 x 17 private"
    assert steps["Shared + private (one trust group)"]["result"].startswith("264 pages for all 8")
    assert steps["Admitted (one trust group)"]["formula"] == "128 + 7 x 17"


def test_written_decision_is_checked_for_the_key_numbers(client, seed):
    good = ("Admit at most seven: 128 shared prefix pages plus 7 x 17 private = 247 of 256, 9 left. Each request "
            "needs 145 pages. With eight trust groups only 1 fits. A shorter output allowance (256 tokens) lets all "
            "eight in.")
    got = client.post("/api/decision", json={"controls": seed, "text": good}).json()
    assert (got["found"], got["total"]) == (6, 6)
    partial = client.post("/api/decision", json={"controls": seed, "text": "About 500 MiB, so eight fit."}).json()
    assert partial["found"] == 0
    assert [i["found"] for i in partial["items"]] == [False] * 6
    answer = partial["model_answer"]
    for needle in ("admit at most 7 of the 8", "and 1 when every request", "= 145 pages", "128 + 8 x 17 = 264",
                   "7 take 247, leaving 9", "with 256 output tokens or fewer", "all 8 fit in one group (256 pages)",
                   "only with no output allowance at all"):
        assert needle in answer


def test_model_answer_follows_the_controls(seed):
    answer = lesson.model_answer(LabInput(**dict(seed, max_new=129)))
    assert answer["threshold_allowance"] is None  # all eight already fit
    assert "admit at most 8 of the 8" in answer["text"]
    assert lesson.numbers_in("1,160 pages, seven requests, 9 left") >= {1160, 7, 9}


# ---- check yourself ------------------------------------------------------------------------------------------
def test_quiz_questions_carry_no_answers_until_checked(client, seed):
    questions = client.post("/api/quiz", json=seed).json()["questions"]
    ids = [q["id"] for q in questions]
    assert ids[:2] == ["seed-pages", "seed-why"]
    assert questions[0]["options"] == ["144", "145", "257"]
    assert len(ids) >= 6
    assert all(set(q) <= {"id", "kind", "source", "text", "options"} for q in questions)

    def check(qid, answer):
        return client.post("/api/quiz/check", json={"controls": seed, "id": qid, "answer": answer}).json()

    assert check("seed-pages", "145")["correct"] is True
    assert check("seed-pages", "144")["correct"] is False
    assert check("seed-pages", "144")["expected"] == 145
    why = check("seed-why", "Because 128 + 8 x 17 = 264 pages, more than 256.")
    assert why["correct"] is True and "264" in why["explanation"]
    assert check("seed-why", "It is too big")["correct"] is False
    assert check("kv-bytes", "131,072")["correct"] is True
    assert check("admitted", "7")["correct"] is True
    assert check("unshared", "1160")["correct"] is True
    assert check("left", "9")["correct"] is True
    assert check("private", "17")["correct"] is True
    changed = client.post("/api/quiz", json=dict(seed, max_new=129)).json()["questions"]
    assert "pages" in [q["id"] for q in changed]  # a page-count question for the new allowance
    got = client.post("/api/quiz/check", json={"controls": dict(seed, max_new=129), "id": "pages", "answer": "137"})
    assert got.json()["correct"] is True


# ---- the small views -----------------------------------------------------------------------------------------
def test_forks_copy_the_shared_tail_once_per_writer(client):
    got = client.post("/api/views/forks", json={"prompt": 40, "block_size": 16, "branches": 3, "tokens": 10}).json()
    steps = got["steps"]
    assert got["decision"]["outcome"] == "admitted"
    first = steps[0]
    assert first["copy_promises"] == 2
    assert all([b["block"] for b in s["blocks"]] == [0, 1, 2] for s in first["sequences"])
    assert all(b["ref"] == 3 for s in first["sequences"] for b in s["blocks"])
    round1 = steps[1]
    copies = [e for e in round1["events"] if "copied" in e]
    assert len(copies) == 2  # the first two writers copy; the last holder writes in place
    tails = [s["blocks"][-1] for s in round1["sequences"]]
    assert len({t["block"] for t in tails}) == 3 and all(t["ref"] == 1 for t in tails)
    assert round1["copy_promises"] == 0
    assert all(s["blocks"][0]["ref"] == 3 for s in round1["sequences"])  # full blocks stay shared
    last = steps[-1]
    assert "Release the pruned branch r/2" == last["title"]
    assert [s["id"] for s in last["sequences"]] == ["r", "r/1"]


def test_tail_slack_against_contiguous_holes(client):
    got = client.post("/api/views/fragmentation", json={}).json()
    c, p = got["contiguous"], got["paged"]
    assert (c["outcome"], c["free_total"], c["largest_hole"]) == ("hole_failure", 80, 50)
    assert p["outcome"] == "admitted"
    assert p["tail_slack"] == {"A": 8, "C": 8, "D": 4} and p["tail_slack_total"] == 20
    assert [x["owner"] for x in p["cells"]].count("D") == 4


# ---- bad input: one clear message, never a traceback ---------------------------------------------------------
BAD = [
    ({"requests": -1}, 422, "requests: must be >= 1"),
    ({"prompt": -5}, 422, "prompt: must be >= 1"),
    ({"max_new": -1}, 422, "max_new: must be >= 0"),
    ({"block_size": -16}, 422, "block_size: must be >= 1"),
    ({"pool": "-512MiB"}, 400, "not a byte size"),
    ({"pool": "0"}, 400, "byte size must be positive"),
    ({"pool": "512"}, 400, "size '512' has no unit: write 512GiB (binary), 512GB (decimal) or 512B (bytes)"),
    ({"pool": "536870912"}, 400, "has no unit"),  # was read as bytes, as the CLI's --pool no longer is
    ({"pool": "1KiB"}, 400, "pool of 1 KiB is smaller than one KV block (2 MiB)"),
    ({"pool": "1MiB"}, 400, "smaller than one KV block"),
    ({"requests": 10**9}, 422, "requests: must be <= 64"),
    ({"prompt": 10**12}, 422, "prompt: must be <= 65536"),
    ({"branches": 1000}, 422, "branches: must be <= 16"),
    ({"layers": 10**6}, 422, "layers: must be <= 1024"),
    ({"pool": "1000TiB"}, 400, "at most 65,536 blocks"),
    ({"requests": 64, "prompt": 65536}, 422, "the lab runs at most 262,144 tokens"),
    ({"requests": 64, "prompt": 100, "max_new": 1000}, 422, "decode steps"),
    ({"pool": "64GiB", "max_new": 2000}, 422, "use a smaller pool or a shorter output allowance"),
    ({"requests": "8"}, 422, "requests: must be a whole number"),
    ({"requests": 2.5}, 422, "requests: must be a whole number"),
    ({"prefix_cache": "yes"}, 422, "prefix_cache: must be true or false"),
    ({"shared_prefix": 4096}, 400, "shared-prefix (4096) cannot exceed prompt (2048)"),
    ({"groups": 9}, 400, "groups (9) cannot exceed requests (8)"),
    ({"bogus": 1}, 422, "bogus: is not a known field"),
    ({"model": "../../etc/passwd"}, 422, "unknown model"),
    ({"model": "llama-3.1-8b"}, 400, "give either a bundled model or layers / KV heads / head dim, not both"),
    ({"kv_dtype": "int3"}, 422, "unknown dtype 'int3'"),
    ({"policy": "yolo"}, 422, "policy must be one of full, incremental, predicted"),
    ({"tp": 3}, 400, "tp=3 must divide the 8 KV heads"),
]


@pytest.mark.parametrize("changes, status, message", BAD)
def test_bad_input_gets_one_clear_message(client, seed, changes, status, message):
    got = client.post("/api/admit", json=dict(seed, **changes))
    assert got.status_code == status
    assert got.headers["content-type"] == "application/json"
    body = got.json()
    assert list(body) == ["error"] and message in body["error"]
    assert "\n" not in body["error"] and "Traceback" not in got.text
    # Every endpoint that takes the controls answers the same way.
    for path, wrap in (("/api/lab", None), ("/api/quiz", None), ("/api/score", "prediction"),
                       ("/api/decision", "text")):
        payload = dict(seed, **changes)
        if wrap == "prediction":
            payload = {"controls": payload, "prediction": {}}
        elif wrap == "text":
            payload = {"controls": payload, "text": "seven"}
        again = client.post(path, json=payload)
        assert again.status_code == status, path
        assert message in again.json()["error"]


def test_explicit_geometry_without_a_model_is_one_message(client, seed):
    seed.pop("layers")
    got = client.post("/api/admit", json=seed)
    assert got.status_code == 400
    assert got.json() == {"error": "give a bundled model, or all of layers, KV heads and head dim"}


@pytest.mark.parametrize("raw, message", [
    (b"{not json", "the request body is not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"", "the request needs a JSON object body"),
])
def test_malformed_bodies(client, raw, message):
    got = client.post("/api/admit", content=raw, headers={"content-type": "application/json"})
    assert got.status_code == 422
    assert message in got.json()["error"]


def test_nested_and_view_inputs_are_bounded(client, seed):
    got = client.post("/api/score", json={"controls": seed, "prediction": {"one_group_admitted": -3}})
    assert got.status_code == 422 and got.json()["error"].startswith("prediction.one_group_admitted: must be >= 0")
    got = client.post("/api/quiz/check", json={"controls": seed, "id": "nope", "answer": "1"})
    assert got.status_code == 400 and got.json() == {"error": "unknown question 'nope'"}
    got = client.post("/api/views/forks", json={"branches": 100})
    assert got.status_code == 422 and got.json()["error"].startswith("branches: must be <= 8")
    got = client.post("/api/views/forks", json={"tokens": 20, "max_new": 10})
    assert got.status_code == 422 and "cannot exceed the output allowance" in got.json()["error"]
    got = client.post("/api/views/fragmentation", json={"lengths": [10] * 100})
    assert got.status_code == 422 and got.json()["error"].startswith("lengths: has more than 16 items")
    got = client.post("/api/views/fragmentation", json={"finish": [7]})
    assert got.status_code == 422 and "finish names request 7" in got.json()["error"]
    got = client.post("/api/views/fragmentation", json={"capacity_tokens": 8, "block_size": 16})
    assert got.status_code == 400 and got.json() == {"error": "capacity 8 tokens holds no block of 16"}
    got = client.post("/api/decision", json={"controls": seed, "text": "x" * 9000})
    assert got.status_code == 422 and "longer than 8000 characters" in got.json()["error"]


def test_a_kvledger_bug_is_a_500_without_a_traceback(seed, monkeypatch):
    def broken(_inp):
        raise RuntimeError("boom\nwith a second line")

    monkeypatch.setattr(lesson, "admit_payload", broken)
    got = TestClient(create_app(), raise_server_exceptions=False).post("/api/admit", json=seed)
    assert got.status_code == 500
    assert got.json() == {"error": "internal error (RuntimeError); this is a kvledger bug"}
    assert "Traceback" not in got.text and "boom" not in got.text


# ---- the page and its assets ---------------------------------------------------------------------------------
def test_page_and_assets_are_served_from_the_package_only(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset in ("/static/lab.js", "/static/lab.css"):
        assert client.get(asset).status_code == 200
    assert client.head("/").status_code == 200
    meta = client.get("/api/meta").json()
    assert meta["policies"] == ["full", "incremental", "predicted"]
    assert "llama-3.1-8b" in meta["models"] and "bf16" in meta["kv_dtypes"]
    assert meta["seed"]["max_new"] == 257
    static = resources.files("kvledger.weblab").joinpath("static")
    for f in static.iterdir():
        text = f.read_text(encoding="utf-8")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, f.name


def test_eviction_takes_idle_cache_and_preemption_takes_a_running_request(client):
    got = client.post("/api/views/eviction", json={}).json()
    steps = {s["title"]: s for s in got["steps"]}
    assert all(sum(s["counts"].values()) == 12 for s in got["steps"])
    first = steps["A finished; its prompt stays cached"]
    assert first["counts"]["retained"] == 4 and first["usage"]["sequences"] == 0
    evicting = steps["D arrives: eviction"]
    assert evicting["counts"]["retained"] == 3  # one of A's cached blocks went straight to D
    assert "evicted 1 of A's cached blocks (deepest first: [3])" in evicting["events"][1]
    assert evicting["usage"]["sequences"] == 3  # B and C still run: eviction took nothing from them
    stuck = steps["B needs one more block: none is left"]
    assert (stuck["usage"]["free"], stuck["usage"]["evictable"], stuck["usage"]["promised"]) == (0, 0, 0)
    preempted = steps["Preempt D (the newest request)"]
    assert "returned its 13 tokens" in preempted["events"][0]
    assert preempted["usage"]["sequences"] == 2 and preempted["counts"]["retained"] == 3
    assert "recompute 13 tokens" in preempted["cost"] and "swap 4 blocks" in preempted["cost"]
    last = steps["B grows; D waits to come back"]
    assert "3 of its 4 blocks would be cache hits" in last["events"][1]
    assert client.post("/api/views/eviction", json={"x": 1}).status_code == 422


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                 st.text(max_size=12), st.lists(st.integers(-5, 5), max_size=3))
_FIELDS = ["model", "layers", "kv_heads", "head_dim", "kv_dtype", "tp", "block_size", "pool", "requests", "prompt",
           "shared_prefix", "max_new", "groups", "prefix_cache", "policy", "branches"]


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=4),
       path=st.sampled_from(["/api/admit", "/api/lab", "/api/quiz"]))
def test_no_input_reaches_a_traceback(changes, path):
    """Whatever a page (or anyone) posts, the answer is a result or one clear error, never a 500."""
    body = {"layers": 32, "kv_heads": 8, "head_dim": 128, "pool": "512MiB", "shared_prefix": 2048, **changes}
    raw = json.dumps(body).encode()  # NaN and Infinity too, as a careless client would send them
    got = _FUZZ_CLIENT.post(path, content=raw, headers={"content-type": "application/json"})
    assert got.status_code in (200, 400, 422), (body, got.text)
    if got.status_code != 200:
        error = got.json()["error"]
        assert isinstance(error, str) and error and "\n" not in error and "Traceback" not in error


_FUZZ_CLIENT = TestClient(create_app(), raise_server_exceptions=False)
