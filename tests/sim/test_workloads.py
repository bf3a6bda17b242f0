"""Simulator workloads: trace loaders, prefix sharing, bad lines, transforms and the generator."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.errors import ConfigError
from kvledger.workloads import (
    Choice,
    Fixed,
    Gamma,
    LogNormal,
    Poisson,
    Prompt,
    SimRequest,
    Uniform,
    assign_trust_groups,
    load_azure,
    load_lengths,
    load_mooncake,
    load_trace,
    scale_time,
    slice_requests,
    synthetic,
)

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "tests" / "data" / "traces"  # leading slices of the public traces, committed (see README there)

CONV = "mooncake_conversation_head300.jsonl"
SYNTH = "mooncake_synthetic_head60.jsonl"
AZ_CODE = "azure_code_head500.csv"
AZ_CONV = "azure_conv_head500.csv"
SHAREGPT = "sharegpt_lengths_head1000.csv"
ARXIV = "arxiv_lengths_head500.csv"


@pytest.fixture(scope="module")
def conv_timed():
    start = time.process_time()
    reqs = load_mooncake(TRACES / CONV)
    return reqs, time.process_time() - start


@pytest.fixture(scope="module")
def conv(conv_timed):
    return conv_timed[0]


@pytest.fixture(scope="module")
def conv_raw():
    with open(TRACES / CONV, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def az_code():
    return load_azure(TRACES / AZ_CODE)


# ---- Prompt ----------------------------------------------------------------------------------


def test_prompt_runs_are_canonical_and_behave_like_a_sequence():
    p = Prompt([(100, 3), (103, 2), (7, 2), (50, 0)])
    assert p.runs == ((100, 5), (7, 2))
    assert len(p) == 7
    assert p.tolist() == [100, 101, 102, 103, 104, 7, 8]
    assert p == [100, 101, 102, 103, 104, 7, 8]
    assert p == Prompt.from_tokens([100, 101, 102, 103, 104, 7, 8])
    assert hash(p) == hash(Prompt.from_tokens(p.tolist()))
    assert p[0] == 100 and p[4] == 104 and p[5] == 7 and p[-1] == 8
    assert p[3:6] == [103, 104, 7] and isinstance(p[3:6], Prompt)
    assert p[::2] == [100, 102, 104, 8]
    assert list(reversed(p)) == [8, 7, 104, 103, 102, 101, 100]
    assert 102 in p and 8 in p and 9 not in p and "x" not in p
    assert (Prompt([(0, 2)]) + Prompt([(2, 2)])).runs == ((0, 4),)
    with pytest.raises(IndexError):
        p[7]
    with pytest.raises(ConfigError):
        Prompt([(-1, 3)])
    with pytest.raises(ConfigError):
        Prompt.from_tokens([1, 2**32])
    with pytest.raises(ConfigError):
        Prompt.from_tokens([1, True])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60), st.lists(st.integers(0, 40), max_size=60),
       st.integers(-70, 70), st.integers(-70, 70))
def test_prompt_matches_list_semantics(a, b, i, j):
    pa, pb = Prompt.from_tokens(a), Prompt.from_tokens(b)
    assert pa.tolist() == a and list(pa) == a and len(pa) == len(a)
    assert pa[i:j].tolist() == a[i:j]
    if -len(a) <= i < len(a):
        assert pa[i] == a[i]
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert pa.common_prefix_len(pb) == naive == pb.common_prefix_len(a)
    assert (pa == pb) == (a == b)


def test_simrequest_validates_and_accepts_plain_lists():
    r = SimRequest("r", 1, [5, 6, 7], 4)
    assert isinstance(r.prompt_tokens, Prompt) and r.prompt_tokens == [5, 6, 7]
    assert r.prompt_len == 3 and r.arrival_s == 1.0 and type(r.arrival_s) is float
    assert (r.trust_group, r.n, r.priority) == ("default", 1, 0)
    for bad in (dict(prompt_tokens=[]), dict(arrival_s=-1.0), dict(arrival_s=math.nan), dict(output_len=-1),
                dict(n=0), dict(priority=1.5), dict(trust_group="")):
        kwargs = dict(request_id="r", arrival_s=0.0, prompt_tokens=[1], output_len=1) | bad
        with pytest.raises(ConfigError):
            SimRequest(**kwargs)


# ---- Mooncake ----------------------------------------------------------------------------------


def test_mooncake_conversation_rows_and_exact_values(conv, conv_raw):
    assert len(conv) == len(conv_raw) == 300
    first, second, last = conv[0], conv[1], conv[-1]
    assert (first.arrival_s, first.prompt_len, first.output_len) == (0.0, 6758, 500)
    assert first.prompt_tokens == list(range(6758))  # hash ids 0..13 are consecutive blocks
    assert first.request_id == "mooncake_conversation_head300-0"
    # second line: hash ids [0, 14, 15, ..., 27], 7322 tokens
    expected = list(range(512)) + list(range(14 * 512, 28 * 512))[: 7322 - 512]
    assert second.prompt_tokens.tolist() == expected
    assert (last.arrival_s, last.prompt_len, last.output_len) == (102.0, 979, 140)
    assert last.prompt_tokens[:512] == list(range(512)) and last.prompt_tokens[512] == 7813 * 512
    assert all(r.trust_group == "default" and r.n == 1 for r in conv)
    assert [r.arrival_s for r in conv] == sorted(r.arrival_s for r in conv)


def test_mooncake_tokens_follow_the_block_mapping(conv, conv_raw):
    for req, raw in zip(conv[::97], conv_raw[::97], strict=True):
        ids, n = raw["hash_ids"], raw["input_length"]
        assert req.prompt_len == n and req.output_len == raw["output_length"]
        for pos in (0, 511, 512, n // 2, n - 1):
            assert req.prompt_tokens[pos] == ids[pos // 512] * 512 + pos % 512


def test_mooncake_sharing_is_exactly_the_hash_id_prefix(conv, conv_raw):
    # Lines 1 and 2 share their first hash id only: exactly 512 tokens.
    a, b = conv[0].prompt_tokens.tolist(), conv[1].prompt_tokens.tolist()
    assert a[:512] == b[:512] and a[512] != b[512]
    # Lines 2 and 138 share 14 of their 15/16 blocks.
    assert conv_raw[1]["hash_ids"][:14] == conv_raw[137]["hash_ids"][:14]
    assert conv_raw[1]["hash_ids"][14] != conv_raw[137]["hash_ids"][14]
    a, b = conv[1].prompt_tokens.tolist(), conv[137].prompt_tokens.tolist()
    assert a[: 14 * 512] == b[: 14 * 512] and a[14 * 512] != b[14 * 512]
    # Every pair among the first 150 requests: common token prefix == common hash-id prefix x 512.
    head = conv_raw[:150]
    pairs = 0
    for i in range(len(head)):
        for j in range(i + 1, len(head)):
            ids_a, ids_b = head[i]["hash_ids"], head[j]["hash_ids"]
            k = 0
            while k < min(len(ids_a), len(ids_b)) and ids_a[k] == ids_b[k]:
                k += 1
            want = min(k * 512, head[i]["input_length"], head[j]["input_length"])
            assert conv[i].prompt_tokens.common_prefix_len(conv[j].prompt_tokens) == want
            pairs += k > 0
    assert pairs > 1000  # the trace really shares (the common system prompt block 0 at least)


def test_mooncake_synthetic_rows_and_exact_values():
    reqs = load_mooncake(TRACES / SYNTH, id_prefix="s")
    assert len(reqs) == 60
    first = reqs[0]
    assert (first.request_id, first.arrival_s, first.prompt_len, first.output_len) == ("s0", 0.0, 40160, 6)
    assert reqs[0].prompt_tokens == list(range(40160))
    last = reqs[-1]
    assert (last.request_id, last.arrival_s, last.prompt_len, last.output_len) == ("s59", 17.245, 35, 177)
    assert last.prompt_tokens.tolist() == list(range(1470 * 512, 1470 * 512 + 35))  # one partial block


def test_mooncake_loads_fast(conv_timed):
    reqs, cpu_s = conv_timed
    assert len(reqs) == 300
    assert cpu_s < 0.5  # CPU time, so a busy machine does not fail it


# ---- Azure and length tables -------------------------------------------------------------------


def test_azure_code_rows_and_exact_values(az_code):
    reqs = az_code
    assert len(reqs) == 500
    assert (reqs[0].arrival_s, reqs[0].prompt_len, reqs[0].output_len) == (0.0, 4808, 10)
    assert (reqs[1].arrival_s, reqs[1].prompt_len, reqs[1].output_len) == (pytest.approx(0.052), 3180, 8)
    # 18:20:56.7810470 - 18:17:03.9799600 = 3 min 52.801087 s
    assert reqs[-1].arrival_s == pytest.approx(232.801087, abs=1e-9)
    assert (reqs[-1].prompt_len, reqs[-1].output_len) == (866, 14)
    # No prefix information: prompts are pairwise disjoint token ranges.
    runs = sorted(r.prompt_tokens.runs[0] for r in reqs)
    assert all(len(r.prompt_tokens.runs) == 1 for r in reqs)
    assert all(s0 + n0 <= s1 for (s0, n0), (s1, _) in zip(runs, runs[1:], strict=False))


def test_azure_conv_rows_and_exact_values():
    reqs = load_azure(TRACES / AZ_CONV, trust_group="conv")
    assert len(reqs) == 500
    assert (reqs[0].arrival_s, reqs[0].prompt_len, reqs[0].output_len) == (0.0, 374, 44)
    assert reqs[-1].arrival_s == pytest.approx(129.012474, abs=1e-9)  # 2 min 9.012474 s
    assert (reqs[-1].prompt_len, reqs[-1].output_len) == (1033, 420)
    assert {r.trust_group for r in reqs} == {"conv"}


@pytest.fixture(scope="module")
def arxiv():
    return load_lengths(TRACES / ARXIV, arrivals=Poisson(20.0), seed=3)


def test_sharegpt_rows_and_exact_values():
    reqs = load_lengths(TRACES / SHAREGPT, arrivals=Poisson(20.0), seed=3)
    assert len(reqs) == 1000
    assert (reqs[0].arrival_s, reqs[0].prompt_len, reqs[0].output_len) == (0.0, 74, 918)
    assert (reqs[-1].prompt_len, reqs[-1].output_len) == (780, 765)
    assert reqs[-1].request_id == "sharegpt_lengths_head1000-999"


def test_arxiv_rows_values_and_poisson_arrivals(arxiv):
    reqs = arxiv
    assert len(reqs) == 500
    assert (reqs[0].arrival_s, reqs[0].prompt_len, reqs[0].output_len) == (0.0, 3772, 54)
    assert (reqs[1].prompt_len, reqs[1].output_len) == (2015, 156)
    assert (reqs[-1].prompt_len, reqs[-1].output_len) == (2625, 240)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)]
    assert min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.15)  # 499 exponential gaps (seed 3)


def test_gamma_arrivals_have_the_asked_rate_and_cv(tmp_path):
    times = Gamma(5.0, cv=2.0).arrival_times(30_000, random.Random(1))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(2.0, rel=0.1)
    path = _lengths_file(tmp_path)
    reqs = load_lengths(path, arrivals=Gamma(5.0, cv=2.0), seed=1)
    assert reqs == load_lengths(path, arrivals=Gamma(5.0, cv=2.0), seed=1)
    poisson = load_lengths(path, arrivals=Poisson(5.0), seed=1)
    assert [r.arrival_s for r in reqs] != [r.arrival_s for r in poisson]


def _lengths_file(tmp_path, rows=40):
    path = tmp_path / "lengths.csv"
    body = "".join(f"{10 + i},{i},{10 + 2 * i},{(10 + i) / max(i, 1)}\n" for i in range(rows))
    path.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n" + body)
    return path


def test_length_loader_is_seeded_and_limits_and_shuffles(tmp_path):
    path = _lengths_file(tmp_path)
    base = load_lengths(path, arrivals=Poisson(2.0), seed=3)
    assert [(r.prompt_len, r.output_len) for r in base[:3]] == [(10, 0), (11, 1), (12, 2)]
    assert load_lengths(path, arrivals=Poisson(2.0), seed=3) == base
    # a limit keeps a prefix of the rows and of the arrival times; another seed gives other times
    assert load_lengths(path, arrivals=Poisson(2.0), seed=3, limit=5) == base[:5]
    assert [r.arrival_s for r in load_lengths(path, arrivals=Poisson(2.0), seed=4)] != \
        [r.arrival_s for r in base]
    head = load_lengths(path, arrivals=[0.0, 1.0, 2.5], limit=3)
    assert [(r.arrival_s, r.prompt_len) for r in head] == [(0.0, 10), (1.0, 11), (2.5, 12)]
    mixed = load_lengths(path, arrivals=Poisson(1.0), shuffle=True, seed=9)
    assert sorted(r.prompt_len for r in mixed) == list(range(10, 50))
    assert [r.prompt_len for r in mixed] != list(range(10, 50))
    assert mixed == load_lengths(path, arrivals=Poisson(1.0), shuffle=True, seed=9)
    with pytest.raises(ConfigError, match="arrival times"):
        load_lengths(path, arrivals=[0.0, 1.0], limit=3)
    with pytest.raises(ConfigError, match="arrivals must be"):
        load_lengths(path, arrivals=5.0)


def test_load_trace_dispatches_on_format(tmp_path):
    assert load_trace(_lengths_file(tmp_path, 4), arrivals=Poisson(1.0))[3].prompt_len == 13
    (tmp_path / "t.jsonl").write_text(GOOD_JSON + "\n")
    assert load_trace(tmp_path / "t.jsonl")[0].prompt_len == 600
    (tmp_path / "a.csv").write_text(AZ_HEADER + "2023-11-16 18:17:03.9799600,10,2")
    assert load_trace(tmp_path / "a.csv")[0].output_len == 2
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="unknown trace format"):
        load_trace(tmp_path / "x.csv")


# ---- bad lines ---------------------------------------------------------------------------------

GOOD_JSON = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}'


@pytest.mark.parametrize(("second_line", "match"), [
    ('{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, ', "not valid JSON"),
    ('{"timestamp": 3000, "input_length": 600, "hash_ids": [0, 2]}', "missing key 'output_length'"),
    ('{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0]}', "block ids"),
    ('{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, true]}', "block ids"),
    ('{"timestamp": "3000", "input_length": 600, "output_length": 5, "hash_ids": [0, 2]}', "timestamp"),
    ('{"timestamp": 3000, "input_length": 0, "output_length": 5, "hash_ids": []}', "input_length"),
    ("[1, 2, 3]", "JSON object"),
    ('{"timestamp": 3000, "input_length": 600, "output_length": 5, "hash_ids": [0, 2], "x": "\xff"}',
     "UTF-8"),
])
def test_mooncake_bad_lines_name_file_and_line(tmp_path, second_line, match):
    path = tmp_path / "bad.jsonl"
    data = (GOOD_JSON + "\n\n" + second_line).encode("latin-1")  # \xff is not UTF-8
    path.write_bytes(data)  # blank line 2 is skipped; the bad one is line 3
    with pytest.raises(ConfigError, match=match) as info:
        load_mooncake(path)
    assert f"{path}:3:" in str(info.value)


def test_mooncake_small_file_and_block_size(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": [0, 1]}\n'
                    '{"timestamp": 1500, "input_length": 40, "output_length": 1, "hash_ids": [0, 9, 3], '
                    '"extra": 1}\n')
    reqs = load_mooncake(path, block_tokens=16, token_base=1000, trust_group="t")
    assert [r.arrival_s for r in reqs] == [0.0, 1.5]
    assert reqs[1].prompt_tokens == [*range(1000, 1016), *range(1144, 1160), *range(1048, 1056)]
    assert reqs[0].prompt_tokens.common_prefix_len(reqs[1].prompt_tokens) == 16
    with pytest.raises(ConfigError, match="no trace file"):
        load_mooncake(tmp_path / "absent.jsonl")


AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(("body", "line", "match"), [
    ("2023-11-16 18:17:03.9799600,10,2\n2023-11-16 18:17:04.0,abc,3\n", 3, "ContextTokens must be an int"),
    ("2023-11-16 18:17:03.9799600,10,2\n2023-11-16 18:17:04.0,12", 3, "expected 3 fields"),
    ("2023-11-16 18:17:03.9799600,10,-2\n", 2, r"GeneratedTokens must be in \[0, "),
    ("2023-11-16 25:17:03.9799600,10,2\n", 2, "TIMESTAMP"),
    ("16/11/2023 18:17:03,10,2\n", 2, "TIMESTAMP"),
])
def test_azure_bad_rows_name_file_and_line(tmp_path, body, line, match):
    path = tmp_path / "bad.csv"
    path.write_text(AZ_HEADER + body)
    with pytest.raises(ConfigError, match=match) as info:
        load_azure(path)
    assert f"{path}:{line}:" in str(info.value)


def test_csv_missing_column_and_empty_file(tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,10\n")
    with pytest.raises(ConfigError, match=r"cols.csv:1: missing column\(s\) GeneratedTokens"):
        load_azure(path)
    path.write_text("num_prefill_tokens,pd_ratio\n5,0.5\n")
    with pytest.raises(ConfigError, match="missing column.*num_decode_tokens"):
        load_lengths(path, arrivals=Poisson(1.0))
    path.write_text("num_prefill_tokens,num_decode_tokens\n5,1\n1.5,2\n")
    with pytest.raises(ConfigError, match=r"cols.csv:3: column num_prefill_tokens must be an integer"):
        load_lengths(path, arrivals=Poisson(1.0))
    path.write_text("")
    with pytest.raises(ConfigError, match="empty file"):
        load_azure(path)


def test_azure_timestamps_no_trailing_newline(tmp_path):
    path = tmp_path / "az.csv"
    path.write_text(AZ_HEADER + "2023-11-16 23:59:59.9999999,10,2\n2023-11-17 00:00:00.0000001,5,1\n"
                    "2023-11-16 23:59:59.5,7,3")
    reqs = load_azure(path, id_prefix="a")
    assert [(r.request_id, r.prompt_len) for r in reqs] == [("a2", 7), ("a0", 10), ("a1", 5)]
    assert [r.arrival_s for r in reqs] == [0.0, pytest.approx(0.4999999), pytest.approx(0.5000001)]


# ---- transforms ----------------------------------------------------------------------------------


def test_scale_time_and_slice(az_code):
    fast = scale_time(az_code, 2.0)
    assert [r.request_id for r in fast] == [r.request_id for r in az_code]
    assert fast[-1].arrival_s == pytest.approx(232.801087 / 2)
    assert scale_time(az_code, 0.5)[-1].arrival_s == pytest.approx(232.801087 * 2)
    with pytest.raises(ConfigError):
        scale_time(az_code, 0)

    window = slice_requests(az_code, start_s=180.0, end_s=210.0)
    inside = [r for r in az_code if 180.0 <= r.arrival_s < 210.0]
    assert [r.request_id for r in window] == [r.request_id for r in inside] and len(window) > 100
    assert all(0.0 <= r.arrival_s < 30.0 for r in window)
    assert window[0].arrival_s == pytest.approx(inside[0].arrival_s - 180.0)
    raw = slice_requests(az_code, start_s=180.0, end_s=210.0, rebase=False)
    assert [r.arrival_s for r in raw] == [r.arrival_s for r in inside]
    first = slice_requests(az_code, first_n=5)
    assert [r.request_id for r in first] == [f"azure_code_head500-{i}" for i in range(5)]
    both = slice_requests(az_code, start_s=180.0, first_n=3)
    assert [r.request_id for r in both] == [r.request_id for r in inside[:3]]
    assert slice_requests(az_code, end_s=0.0) == []
    with pytest.raises(ConfigError):
        slice_requests(az_code, start_s=5.0, end_s=1.0)


def test_assign_trust_groups_is_seeded():
    reqs = [SimRequest(f"r{i}", float(i), [i], 1) for i in range(200)]
    a = assign_trust_groups(reqs, 3, seed=1)
    assert a == assign_trust_groups(reqs, 3, seed=1) != assign_trust_groups(reqs, 3, seed=2)
    assert {r.trust_group for r in a} == {"group-0", "group-1", "group-2"}
    assert [r.prompt_tokens for r in a] == [r.prompt_tokens for r in reqs]


# ---- synthetic -----------------------------------------------------------------------------------


def _gen(**overrides):
    kwargs = dict(arrivals=Poisson(4.0), prompt_len=LogNormal(800, 1.0, high=4000),
                  output_len=Uniform(10, 200), system_prompts=3, system_prompt_len=256, shared_fraction=0.6,
                  trust_groups=2,
                  n=Choice((1, 4), (0.8, 0.2)), priority=Choice((0, 1)), seed=7)
    return synthetic(1000, **(kwargs | overrides))


def test_synthetic_is_deterministic_for_a_seed():
    a, b = _gen(), _gen()
    assert a == b
    assert _gen(seed=8) != a
    # Each aspect has its own random stream: changing n leaves prompts and arrivals alone.
    c = _gen(n=1)
    assert [(r.arrival_s, r.prompt_tokens, r.output_len, r.trust_group) for r in c] == \
        [(r.arrival_s, r.prompt_tokens, r.output_len, r.trust_group) for r in a]
    assert {r.n for r in c} == {1} and {r.n for r in a} == {1, 4}


def test_synthetic_shares_exactly_the_system_prompts():
    reqs = _gen()
    # System prompt k is tokens [256k, 256k + 256); every request's own part comes after 3 x 256.
    shared = [r for r in reqs if r.prompt_tokens[0] < 768]
    shared_ids = {r.request_id for r in shared}
    assert len(shared) / len(reqs) == pytest.approx(0.6, abs=0.05)
    by_system: dict[int, list[SimRequest]] = {}
    for r in shared:
        start = r.prompt_tokens[0]
        assert start % 256 == 0 and r.prompt_tokens[:256] == list(range(start, start + 256))
        by_system.setdefault(start, []).append(r)
    assert sorted(by_system) == [0, 256, 512]
    x, y = by_system[0][:2]
    assert x.prompt_tokens.common_prefix_len(y.prompt_tokens) == 256
    assert x.prompt_tokens.common_prefix_len(by_system[256][0].prompt_tokens) == 0
    # Own parts: unique, disjoint, after the system prompts, so nothing else is ever shared.
    skip = {r.request_id: 256 if r.request_id in shared_ids else 0 for r in reqs}
    own = sorted((r.prompt_tokens[skip[r.request_id]], r.prompt_len - skip[r.request_id]) for r in reqs)
    assert own[0][0] >= 768
    assert all(s0 + n0 <= s1 for (s0, n0), (s1, _) in zip(own, own[1:], strict=False))
    unshared = [r for r in reqs if r.prompt_tokens[0] >= 768]
    assert all(a.prompt_tokens.common_prefix_len(b.prompt_tokens) == 0
               for a, b in zip(unshared, unshared[1:], strict=False))
    assert {r.trust_group for r in reqs} == {"group-0", "group-1"}
    assert {r.priority for r in reqs} == {0, 1}
    assert all(10 <= r.output_len <= 200 for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


def test_synthetic_distributions_and_errors():
    reqs = synthetic(4000, arrivals=Gamma(10.0, 0.5), prompt_len=LogNormal(1000, 0.5), output_len=Fixed(64),
                     seed=1)
    lens = [r.prompt_len for r in reqs]
    assert statistics.fmean(lens) == pytest.approx(1000, rel=0.05)
    assert statistics.pstdev(lens) / statistics.fmean(lens) == pytest.approx(0.5, rel=0.1)
    assert {r.output_len for r in reqs} == {64} and {r.trust_group for r in reqs} == {"default"}
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(0.5, rel=0.1)
    named = synthetic(5, arrivals=[0, 1, 2, 3, 4], prompt_len=10, output_len=1, trust_groups=["a"])
    assert [r.arrival_s for r in named] == [0.0, 1.0, 2.0, 3.0, 4.0] and named[0].trust_group == "a"
    assert synthetic(0, arrivals=Poisson(1.0), prompt_len=1, output_len=1) == []
    with pytest.raises(ConfigError, match="shared_fraction"):
        synthetic(5, arrivals=Poisson(1.0), prompt_len=10, output_len=1, shared_fraction=0.5)
    with pytest.raises(ConfigError):
        synthetic(5, arrivals=Poisson(1.0), prompt_len=0, output_len=1)
    for bad in (lambda: Poisson(0), lambda: Gamma(1.0, 0), lambda: Uniform(5, 2), lambda: LogNormal(-1, 1),
                lambda: Choice(()), lambda: Choice((1, 2), (1.0,))):
        with pytest.raises(ConfigError):
            bad()


# ---- the trace-format registry and kvledger's own schema --------------------------------------------


def test_registry_names_every_format_and_sniffs_each_slice():
    from kvledger.workloads import TRACE_FORMATS, sniff_trace_format

    assert list(TRACE_FORMATS) == ["mooncake", "azure", "lengths", "kvledger-jsonl", "kvledger-csv"]
    expected = {CONV: "mooncake", SYNTH: "mooncake", AZ_CODE: "azure", AZ_CONV: "azure", SHAREGPT: "lengths",
                ARXIV: "lengths"}
    for name, fmt in expected.items():
        assert sniff_trace_format(TRACES / name).name == fmt
    assert len(load_trace(TRACES / CONV)) == 300
    assert len(load_trace(TRACES / SHAREGPT, arrivals=Poisson(2.0))) == 1000
    with pytest.raises(ConfigError, match="no arrival times"):
        load_trace(TRACES / SHAREGPT)
    with pytest.raises(ConfigError, match="unknown trace format 'parquet'"):
        load_trace(TRACES / CONV, format="parquet")
    with pytest.raises(ConfigError, match="unknown argument"):
        load_trace(TRACES / CONV, colour="red")
    assert len(load_trace(TRACES / AZ_CODE, block_tokens=512)) == 500  # another format's option is ignored


def test_an_unknown_csv_header_lists_the_accepted_ones(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("when,tokens_in,tokens_out\n0,1,2\n")
    with pytest.raises(ConfigError) as info:
        load_trace(path)
    msg = str(info.value)
    assert "unknown trace format (CSV header 'when,tokens_in,tokens_out')" in msg
    for fragment in ("azure (TIMESTAMP,ContextTokens,GeneratedTokens)",
                     "lengths (num_prefill_tokens,num_decode_tokens)",
                     "kvledger-csv (arrival_s,prompt_len,output_len)", "mooncake (timestamp,input_length"):
        assert fragment in msg
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"t": 1}\n')
    with pytest.raises(ConfigError, match="JSON keys of the first line"):
        load_trace(jsonl)


def test_kvledger_schema_in_jsonl_and_csv_gives_the_same_requests(tmp_path):
    from kvledger.workloads import load_kvledger

    rows = [{"arrival_s": 0.5, "prompt_len": 100, "output_len": 8, "group": "a", "prefix": "sys", "prefix_len": 64},
            {"arrival_s": 0.0, "prompt_len": 80, "output_len": 4, "group": "a", "prefix": "sys", "prefix_len": 64,
             "n": 2, "priority": 3, "id": "first"},
            {"arrival_s": 1.25, "prompt_len": 10, "output_len": 0}]
    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    csv_path = tmp_path / "w.csv"
    cols = ["arrival_s", "prompt_len", "output_len", "group", "prefix", "prefix_len", "n", "priority", "id"]
    csv_path.write_text(",".join(cols) + "\n" + "\n".join(",".join(str(r.get(c, "")) for c in cols) for r in rows))
    a, b = load_trace(jsonl), load_trace(csv_path)
    assert [r.request_id for r in a] == ["first", "w-0", "w-2"]
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.trust_group, r.n, r.priority) for r in a] == \
        [(r.arrival_s, r.prompt_len, r.output_len, r.trust_group, r.n, r.priority) for r in b]
    assert a[0].prompt_tokens.common_prefix_len(a[1].prompt_tokens) == 64  # the named prefix, nothing more
    assert a[2].trust_group == "default"
    assert load_kvledger(jsonl)[0].prompt_tokens == a[0].prompt_tokens


@pytest.mark.parametrize(("line", "match"), [
    ('{"arrival_s": 0, "prompt_len": 5}', "missing output_len"),
    ('{"arrival_s": 0, "prompt_len": 5, "output_len": 1, "colour": 1}', "unknown field"),
    ('{"arrival_s": -1, "prompt_len": 5, "output_len": 1}', "arrival_s must be"),
    ('{"arrival_s": "nan", "prompt_len": 5, "output_len": 1}', "arrival_s must be"),
    ('{"arrival_s": 0, "prompt_len": 1e400, "output_len": 1}', "prompt_len must be an integer"),
    ('{"arrival_s": 0, "prompt_len": ' + "9" * 5000 + ', "output_len": 1}', "not usable JSON"),
    ('{"arrival_s": 0, "prompt_len": 5, "output_len": 1, "prefix_len": 3}', "prefix_len without a prefix"),
    ('{"arrival_s": 0, "prompt_len": 5, "output_len": 1, "prefix": "p", "prefix_len": 9}', "exceeds prompt_len"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
])
def test_kvledger_schema_errors_name_the_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_len": 5, "output_len": 1}\n' + line + "\n")
    with pytest.raises(ConfigError, match=match) as info:
        from kvledger.workloads import load_kvledger

        load_kvledger(path)
    assert f"{path}:2" in str(info.value)


def test_hostile_traces_are_one_config_error(tmp_path):
    """Binary and non-UTF-8 CSVs, deep JSON and 5,000-digit integers in Mooncake traces: a ConfigError each
    (they used to raise UnicodeDecodeError, RecursionError or ValueError)."""
    cases = {
        "bin.csv": b"\x00\x01\x02binary\xff\xfe",
        "latin1.csv": b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,5,1\n" + b"\xe9t\xe9\n",
        "header-latin1.csv": b"TIMESTAMP,Context\xe9,GeneratedTokens\n",
        "deep.jsonl": b'{"timestamp": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n",
        "huge.jsonl": b'{"timestamp": 1, "input_length": ' + b"7" * 5000 + b', "output_length": 1, "hash_ids": [1]}\n',
        "big-int.jsonl": b'{"timestamp": 1, "input_length": ' + b"7" * 400
        + b', "output_length": 1, "hash_ids": [1]}\n',
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ConfigError):
            load_trace(path, arrivals=Poisson(1.0))


def test_at_rate_rescales_arrivals_to_the_offered_rate():
    from kvledger.workloads import at_rate, offered_rate, transform_workload

    reqs = synthetic(200, arrivals=Poisson(3.0), prompt_len=10, output_len=2, seed=4)
    for rate in (0.5, 2.0, 64.0):
        out = at_rate(reqs, rate)
        assert offered_rate(out) == pytest.approx(rate)
        # One factor for every gap: the workload's burstiness is kept, only the clock runs faster or slower.
        factor = out[-1].arrival_s / reqs[-1].arrival_s
        assert [r.arrival_s for r in out] == pytest.approx([factor * r.arrival_s for r in reqs])
        assert [r.request_id for r in out] == [r.request_id for r in reqs]
    assert transform_workload(reqs, "speedup", 2.0)[-1].arrival_s == pytest.approx(reqs[-1].arrival_s / 2)
    with pytest.raises(ConfigError):
        at_rate(reqs, 0)
    with pytest.raises(ConfigError, match="same instant"):
        at_rate([SimRequest("a", 0.0, [1], 1), SimRequest("b", 0.0, [2], 1)], 1.0)
    with pytest.raises(ConfigError, match="unknown workload transform"):
        transform_workload(reqs, "colour", 1.0)


def test_scaled_prefixes_are_whole_blocks():
    """A shared 512-token trace block becomes whole 16-token KV blocks at any scale, so sharing stays exact."""
    from kvledger.workloads import scale_lengths

    reqs = load_mooncake(TRACES / CONV)[:150]
    for scale in (0.01, 1 / 64, 0.05, 0.3):
        scaled = scale_lengths(reqs, scale, block_size=16)
        chunk = max(1, round(512 * scale / 16)) * 16
        for a, b in ((0, 1), (1, 137), (0, 5)):
            shared_blocks = reqs[a].prompt_tokens.common_prefix_len(reqs[b].prompt_tokens) // 512
            common = scaled[a].prompt_tokens.common_prefix_len(scaled[b].prompt_tokens)
            assert common == min(shared_blocks * chunk, scaled[a].prompt_len, scaled[b].prompt_len)
        assert all(r.output_len >= 1 for r in scaled)
        assert [r.prompt_len for r in scaled] == [max(1, round(r.prompt_len * chunk / 512)) for r in reqs]
    with pytest.raises(ConfigError):
        scale_lengths(reqs, 0)
