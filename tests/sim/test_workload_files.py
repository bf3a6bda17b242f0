"""Workload files as a user writes them: every trace format's fields, and every refusal's message.

Each case is a small file (or a call) and its whole answer: the requests it loads (id, arrival, prompt
runs, output length, trust group, n, priority) or the refusal's type and message, with the file's path
shown as ``<trace>`` -- so a message that loses its file, its line number, its bounds or its wording is a
difference. The answers live in ``known_answers/workload-files.json``; the first tests below also spell
out the line numbers and bounds by hand, so the stored answer is not the only witness.

Regenerate after a deliberate change (and review the diff):

    KVLEDGER_UPDATE_KNOWN_ANSWERS=1 .venv/bin/python -m pytest -p no:cacheprovider tests/sim/test_workload_files.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

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
    accepted_formats,
    assign_trust_groups,
    at_rate,
    load_azure,
    load_kvledger,
    load_lengths,
    load_mooncake,
    load_trace,
    offered_rate,
    scale_lengths,
    scale_time,
    slice_requests,
    sniff_trace_format,
    synthetic,
    transform_workload,
)

sys.path.insert(0, str(Path(__file__).resolve().parent / "known_answers"))
from known import check  # noqa: E402


def as_rows(requests: list[SimRequest]) -> list[list[Any]]:
    return [[r.request_id, r.arrival_s, [list(x) for x in r.prompt_tokens.runs], r.output_len, r.trust_group, r.n,
             r.priority] for r in requests]


def outcome(fn: Callable[[], Any], folder: Path) -> Any:
    """What a call answers: its requests (or value), or its refusal with the folder shown as <trace>."""
    try:
        value = fn()
    except ConfigError as exc:
        return {"error": type(exc).__name__, "message": str(exc).replace(str(folder), "<trace>")}
    if isinstance(value, list) and value and isinstance(value[0], SimRequest):
        return as_rows(value)
    return value


MOON = '{"timestamp": %s, "input_length": %s, "output_length": %s, "hash_ids": %s}'
GOOD_MOON = MOON % (0, 5, 2, "[0]")

# (file name, bytes) -> loaded by the named loader with these keyword arguments.
FILES: dict[str, tuple[str, bytes, str, dict[str, Any]]] = {
    # Mooncake JSONL: timestamps in ms, hash ids expanded to block_tokens tokens each, the last block cut.
    "moon_good": ("t.jsonl", "\n".join([
        MOON % (2500, 10, 3, "[0, 1, 2]"), "", MOON % (0, 4, 0, "[0]"), MOON % (1200, 9, 5, "[0, 1, 7]"),
        MOON % (1200, 12, 1, "[5, 6, 3]")]).encode() + b"\n", "mooncake", {"block_tokens": 4}),
    "moon_base_prefix_group": ("t.jsonl", (MOON % (10, 5, 1, "[2, 3]")).encode(), "mooncake",
                               {"block_tokens": 3, "token_base": 100, "id_prefix": "m/", "trust_group": "acme"}),
    "moon_default_blocks": ("t.jsonl", (MOON % (1, 600, 1, "[4, 9]")).encode(), "mooncake", {}),
    "moon_not_json": ("t.jsonl", (GOOD_MOON + "\n{\"timestamp\": 1,\n").encode(), "mooncake", {}),
    "moon_not_utf8": ("t.jsonl", (GOOD_MOON + "\n").encode() + b'{"timestamp": "\xff"}\n', "mooncake", {}),
    "moon_deep": ("t.jsonl", b"[" * 100_000 + b"]" * 100_000, "mooncake", {}),
    "moon_huge_int": ("t.jsonl", b'{"timestamp": ' + b"9" * 5000 + b"}", "mooncake", {}),
    "moon_array": ("t.jsonl", b"[1, 2]\n", "mooncake", {}),
    "moon_missing": ("t.jsonl", b'{"timestamp": 0, "input_length": 5, "hash_ids": [0]}', "mooncake", {}),
    "moon_ts_negative": ("t.jsonl", (MOON % (-1, 5, 1, "[0]")).encode(), "mooncake", {}),
    "moon_ts_float": ("t.jsonl", (MOON % (1.5, 5, 1, "[0]")).encode(), "mooncake", {}),
    "moon_ts_bool": ("t.jsonl", (MOON % ("true", 5, 1, "[0]")).encode(), "mooncake", {}),
    "moon_ts_max": ("t.jsonl", (MOON % (10**13, 5, 1, "[0]")).encode(), "mooncake", {}),
    "moon_ts_past_max": ("t.jsonl", (MOON % (10**13 + 1, 5, 1, "[0]")).encode(), "mooncake", {}),
    "moon_in_zero": ("t.jsonl", (MOON % (0, 0, 1, "[]")).encode(), "mooncake", {}),
    "moon_in_max": ("t.jsonl", (MOON % (0, 10**8 + 1, 1, "[0]")).encode(), "mooncake", {}),
    "moon_in_long_int": ("t.jsonl", (MOON % (0, 2**200, 1, "[0]")).encode(), "mooncake", {}),
    "moon_in_long_text": ("t.jsonl", (MOON % (0, '"' + "x" * 60 + '"', 1, "[0]")).encode(), "mooncake", {}),
    "moon_out_negative": ("t.jsonl", (MOON % (0, 5, -1, "[0]")).encode(), "mooncake", {}),
    "moon_out_max": ("t.jsonl", (MOON % (0, 5, 10**8, "[0]")).encode() + b"\n"
                     + (MOON % (0, 5, 10**8 + 1, "[0]")).encode(), "mooncake", {}),
    "moon_ids_not_list": ("t.jsonl", (MOON % (0, 5, 1, '"0"')).encode(), "mooncake", {}),
    "moon_ids_count": ("t.jsonl", (MOON % (0, 600, 1, "[0]")).encode(), "mooncake", {}),
    "moon_ids_negative": ("t.jsonl", (MOON % (0, 600, 1, "[0, -3]")).encode(), "mooncake", {}),
    "moon_ids_bool": ("t.jsonl", (MOON % (0, 600, 1, "[0, true]")).encode(), "mooncake", {}),
    "moon_ids_past_token_space": ("t.jsonl", (MOON % (0, 5, 1, "[8388608]")).encode(), "mooncake", {}),
    # Azure CSV: arrivals from the earliest timestamp, fresh token ids for every prompt.
    "azure_good": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   b"2023-11-16 18:17:03.9799600,100,20\n2023-11-16 18:17:01.5,7,0\n\n"
                   b"2023-11-17 00:00:00,3,+4\n", "azure", {"token_base": 50, "trust_group": "az"}),
    "azure_columns_reordered": ("a.csv", b" GeneratedTokens ,x, TIMESTAMP ,ContextTokens\n"
                                b"5,q,2023-01-01 00:00:00.123456789,8\n", "azure", {}),
    "azure_empty": ("a.csv", b"", "azure", {}),
    "azure_missing_column": ("a.csv", b"TIMESTAMP,ContextTokens\n", "azure", {}),
    "azure_short_row": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,5,1\n"
                        b"2023-11-16 18:17:04,5\n", "azure", {}),
    "azure_bad_quote": ("a.csv", b'TIMESTAMP,ContextTokens,GeneratedTokens\n"2023-11-16 18:17:03"x,5,1\n', "azure", {}),
    "azure_ts_fraction_10": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.0123456789,5,1\n",
                             "azure", {}),
    "azure_ts_hour_24": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 24:00:00,5,1\n", "azure", {}),
    "azure_ts_minute_60": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 23:60:00,5,1\n", "azure",
                           {}),
    "azure_ts_second_61": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 23:59:61,5,1\n", "azure",
                           {}),
    "azure_ts_leap_second": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2016-12-31 23:59:60,5,1\n"
                             b"2016-12-31 23:59:59,5,1\n", "azure", {}),
    "azure_ts_no_time": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16,5,1\n", "azure", {}),
    "azure_ts_bad_day": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-02-30 00:00:00,5,1\n", "azure", {}),
    "azure_context_zero": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,0,1\n", "azure",
                           {}),
    "azure_context_text": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,1.5,1\n", "azure",
                           {}),
    "azure_context_21_digits": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,"
                                + b"1" * 21 + b",1\n", "azure", {}),
    "azure_context_max": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,100000000,1\n"
                          b"2023-11-16 00:00:00,100000001,1\n", "azure", {}),
    "azure_generated_negative": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,4,-1\n",
                                 "azure", {}),
    "azure_header_not_utf8": ("a.csv", b"TIMESTAMP,Context\xc3Tokens,GeneratedTokens\n", "azure", {}),
    "azure_cut_character": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n\n2023-11-16 00:00:00,4,1\xe2\x82",
                            "azure", {}),
    "azure_token_space": ("a.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00,10,1\n", "azure",
                          {"token_base": 2**32 - 5}),
    # Length tables: arrivals from a seeded process, shuffle before limit.
    "lengths_poisson": ("l.csv", b"num_prefill_tokens,num_decode_tokens,extra\n10,2,a\n20,0,b\n30,5,c\n40,1,d\n",
                        "lengths", {"arrivals": Poisson(2.0), "seed": 3}),
    "lengths_shuffle_limit": ("l.csv", b"num_prefill_tokens,num_decode_tokens\n10,2\n20,0\n30,5\n40,1\n50,3\n",
                              "lengths", {"arrivals": [0.5, 0.1, 0.3], "shuffle": True, "limit": 3, "seed": 1}),
    "lengths_gamma": ("l.csv", b"num_prefill_tokens,num_decode_tokens\n10,2\n20,0\n30,5\n", "lengths",
                      {"arrivals": Gamma(4.0, 0.5), "seed": 2, "token_base": 7}),
    "lengths_few_times": ("l.csv", b"num_prefill_tokens,num_decode_tokens\n10,2\n20,0\n", "lengths",
                          {"arrivals": [0.0]}),
    "lengths_bad_arrivals": ("l.csv", b"num_prefill_tokens,num_decode_tokens\n10,2\n", "lengths", {"arrivals": "x"}),
    "lengths_bad_limit": ("l.csv", b"num_prefill_tokens,num_decode_tokens\n10,2\n", "lengths",
                          {"arrivals": [0.0], "limit": -1}),
    "lengths_prefill_zero": ("l.csv", b"num_prefill_tokens,num_decode_tokens\n0,2\n", "lengths", {"arrivals": [0.0]}),
    "lengths_decode_text": ("l.csv", b"num_prefill_tokens,num_decode_tokens\n3,two\n", "lengths", {"arrivals": [0.0]}),
    # kvledger's own schema, JSONL and CSV.
    "kv_jsonl_good": ("k.jsonl", b'{"arrival_s": 0.5, "prompt_len": 40, "output_len": 3, "group": "g1", '
                      b'"prefix": "sys", "prefix_len": 16, "n": 2, "priority": -4, "id": "first"}\n\n'
                      b'{"arrival_s": "0.25", "prompt_len": "12", "output_len": 0}\n'
                      b'{"arrival_s": 1, "prompt_len": 16, "output_len": 1, "prefix": "sys", "prefix_len": 16}\n'
                      b'{"arrival_s": 2, "prompt_len": 20, "output_len": 1, "prefix": "other", "prefix_len": 8, '
                      b'"priority": "+9"}\n', "kvledger", {}),
    "kv_csv_good": ("k.csv", b"arrival_s, prompt_len ,output_len,group,prefix,prefix_len,n,priority,id\n"
                    b"0.5,40,3,g1,sys,16,2,-4,first\n0.25,12,0,,,,,,\n\n1,16,1,,sys,16,,,\n", "kvledger",
                    {"id_prefix": "row-"}),
    "kv_unknown_field": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "tenant": "x", "zz": 1}',
                         "kvledger", {}),
    "kv_missing": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": ""}', "kvledger", {}),
    "kv_arrival_text": ("k.jsonl", b'{"arrival_s": "soon", "prompt_len": 4, "output_len": 1}', "kvledger", {}),
    "kv_arrival_bool": ("k.jsonl", b'{"arrival_s": true, "prompt_len": 4, "output_len": 1}', "kvledger", {}),
    "kv_arrival_nan": ("k.jsonl", b'{"arrival_s": "nan", "prompt_len": 4, "output_len": 1}', "kvledger", {}),
    "kv_arrival_max": ("k.jsonl", b'{"arrival_s": 1e10, "prompt_len": 4, "output_len": 1}\n'
                       b'{"arrival_s": 1.0001e10, "prompt_len": 4, "output_len": 1}', "kvledger", {}),
    "kv_arrival_negative": ("k.jsonl", b'{"arrival_s": -0.5, "prompt_len": 4, "output_len": 1}', "kvledger", {}),
    "kv_arrival_long": ("k.jsonl", b'{"arrival_s": "' + b"1" * 33 + b'", "prompt_len": 4, "output_len": 1}',
                        "kvledger", {}),
    "kv_prompt_zero": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 0, "output_len": 1}', "kvledger", {}),
    "kv_prompt_float": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4.0, "output_len": 1}', "kvledger", {}),
    "kv_output_max": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 100000001}', "kvledger", {}),
    "kv_prefix_len_alone": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "prefix_len": 2}',
                            "kvledger", {}),
    "kv_prefix_len_past_prompt": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "prefix": "p", '
                                  b'"prefix_len": 5}', "kvledger", {}),
    "kv_prefix_len_max": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 9000000, "output_len": 1, "prefix": "p", '
                          b'"prefix_len": 4194305}', "kvledger", {}),
    "kv_group_not_text": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "group": 7}', "kvledger", {}),
    "kv_id_too_long": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "id": "' + b"i" * 129 + b'"}',
                       "kvledger", {}),
    "kv_n_bounds": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "n": 1024}\n'
                    b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "n": 1025}', "kvledger", {}),
    "kv_n_zero": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "n": 0}', "kvledger", {}),
    "kv_priority_bounds": ("k.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "priority": -1000000}\n'
                           b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1, "priority": 1000001}', "kvledger", {}),
    "kv_not_object": ("k.jsonl", b'"text"\n', "kvledger", {}),
    "kv_csv_extra_field": ("k.csv", b"arrival_s,prompt_len,output_len\n0,4,1\n0,4,1,9\n", "kvledger", {}),
    "kv_csv_bad_header": ("k.csv", b"arrival_s,prompt_len,output\n0,4,1\n", "kvledger", {}),
    "kv_csv_bad_quote": ("k.csv", b'arrival_s,prompt_len,output_len\n0,"4"x,1\n', "kvledger", {}),
    "kv_csv_not_utf8": ("k.csv", b"arrival_s,prompt_len,output_len\n0,4,1\n0,\xff,1\n", "kvledger", {}),
    # Sniffing: the format from the suffix and the first non-blank line.
    "sniff_bom_csv": ("s.csv", "\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n".encode()
                      + b"2023-11-16 00:00:00,4,1\n", "auto", {}),
    "sniff_blank_then_moon": ("s.jsonl", b"\n\n" + GOOD_MOON.encode(), "auto", {}),
    "sniff_kv_jsonl": ("s.jsonl", b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1}', "auto", {}),
    "sniff_lengths_needs_arrivals": ("s.csv", b"num_prefill_tokens,num_decode_tokens\n4,1\n", "auto", {}),
    "sniff_empty": ("s.csv", b"\n\n", "auto", {}),
    "sniff_binary": ("s.csv", b"ab\x00cd", "auto", {}),
    "sniff_not_utf8": ("s.csv", b"a,b\nc,d\n\xff\xfe,x\n", "auto", {}),
    "sniff_unknown_csv": ("s.csv", b"when,tokens\n1,2\n", "auto", {}),
    "sniff_unknown_jsonl": ("s.jsonl", b'{"when": 1}\n', "auto", {}),
    "sniff_broken_jsonl": ("s.jsonl", b'{"when": \n', "auto", {}),
    "sniff_txt_is_csv": ("s.txt", b"arrival_s,prompt_len,output_len\n0,4,1\n", "auto", {}),
}

LOADERS = {"mooncake": load_mooncake, "azure": load_azure, "lengths": load_lengths, "kvledger": load_kvledger,
           "auto": load_trace}


def test_the_line_numbers_and_bounds_of_refusals_by_hand(tmp_path: Path) -> None:
    """Three refusals spelled out: the file, the line (blank lines counted), the bound."""
    path = tmp_path / "t.jsonl"
    path.write_bytes((GOOD_MOON + "\n\n" + MOON % (0, 5, -1, "[0]") + "\n").encode())
    with pytest.raises(ConfigError) as err:
        load_mooncake(path)
    assert str(err.value) == f"{path}:3: output_length must be an integer in [0, 100,000,000], got -1"
    path = tmp_path / "a.csv"
    path.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n\n2023-11-16 00:00:00,4,1\n2023-11-16 00:00:00,0,1\n")
    with pytest.raises(ConfigError) as err:
        load_azure(path)
    assert str(err.value) == f"{path}:4: column ContextTokens must be in [1, 100,000,000], got 0"
    path = tmp_path / "k.csv"
    path.write_bytes(b"arrival_s,prompt_len,output_len,priority\n0,4,1,-1000000\n0,4,1,-1000001\n")
    with pytest.raises(ConfigError) as err:
        load_kvledger(path)
    assert str(err.value) == f"{path}:3: priority must be an integer in [-1000000, 1,000,000], got -1000001"


def files_answer(tmp_path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, (name, data, loader, kwargs) in FILES.items():
        folder = tmp_path / case
        folder.mkdir(parents=True)
        path = folder / name
        path.write_bytes(data)
        out[case] = outcome(lambda p=path, f=LOADERS[loader], k=kwargs: f(p, **k), folder)
        if loader == "auto":
            out[case + "/format"] = outcome(lambda p=path: sniff_trace_format(p).name, folder)
    return out


def calls_answer(tmp_path: Path) -> dict[str, Any]:
    """The loaders' arguments, the transforms and the synthetic generator: answers and refusals."""
    trace = tmp_path / "k.jsonl"
    trace.write_bytes(b'{"arrival_s": 0, "prompt_len": 4, "output_len": 1}\n'
                      b'{"arrival_s": 2, "prompt_len": 40, "output_len": 3}\n'
                      b'{"arrival_s": 3, "prompt_len": 8, "output_len": 0}\n')
    reqs = load_kvledger(trace)
    moon = tmp_path / "m.jsonl"
    moon.write_bytes(b"\n".join((MOON % (t, n, 2, ids)).encode() for t, n, ids in
                                ((0, 1100, "[0, 1, 2]"), (500, 700, "[0, 1]"), (1500, 200, "[3]"))))
    mreqs = load_mooncake(moon)
    calls: dict[str, Callable[[], Any]] = {
        "load_trace_unknown_format": lambda: load_trace(trace, "parquet"),
        "load_trace_unknown_argument": lambda: load_trace(trace, colour="red"),
        "load_trace_named": lambda: load_trace(moon, "mooncake", block_tokens=512, arrivals=[0.0], seed=1),
        "load_trace_missing": lambda: load_trace(tmp_path / "nope.csv"),
        "mooncake_block_tokens_zero": lambda: load_mooncake(moon, 0),
        "mooncake_token_base_negative": lambda: load_mooncake(moon, token_base=-1),
        "azure_token_base_negative": lambda: load_azure(trace, token_base=-1),
        "accepted_formats": accepted_formats,
        "scale_time_2": lambda: scale_time(reqs, 2),
        "scale_time_zero": lambda: scale_time(reqs, 0),
        "scale_time_bool": lambda: scale_time(reqs, True),
        "scale_time_inf": lambda: scale_time(reqs, float("inf")),
        "offered_rate": lambda: offered_rate(reqs),
        "offered_rate_one": lambda: offered_rate(reqs[:1]),
        "offered_rate_same_instant": lambda: offered_rate([reqs[0], reqs[0]]),
        "at_rate_4": lambda: at_rate(reqs, 4),
        "at_rate_max": lambda: at_rate(reqs, 1e6),
        "at_rate_past_max": lambda: at_rate(reqs, 1e6 + 1),
        "at_rate_zero": lambda: at_rate(reqs, 0),
        "transform_rate": lambda: transform_workload(reqs, "rate", 2.0),
        "transform_speedup": lambda: transform_workload(reqs, "speedup", 4),
        "transform_unknown": lambda: transform_workload(reqs, "scale", 2),
        "slice_window": lambda: slice_requests(reqs, start_s=2.0, end_s=3.0),
        "slice_window_no_rebase": lambda: slice_requests(reqs, start_s=2.0, end_s=3.5, rebase=False),
        "slice_end_only": lambda: slice_requests(reqs, end_s=3.0),
        "slice_first_n": lambda: slice_requests(reqs, start_s=0.0, first_n=2),
        "slice_first_zero": lambda: slice_requests(reqs, first_n=0),
        "slice_backwards": lambda: slice_requests(reqs, start_s=3.0, end_s=2.0),
        "slice_negative_n": lambda: slice_requests(reqs, first_n=-1),
        "assign_groups_3": lambda: assign_trust_groups(reqs, 3, seed=2),
        "assign_groups_named": lambda: assign_trust_groups(reqs, ["a", "b"], seed=0),
        "assign_groups_one": lambda: assign_trust_groups(reqs, 1),
        "assign_groups_empty": lambda: assign_trust_groups(reqs, []),
        "assign_groups_zero": lambda: assign_trust_groups(reqs, 0),
        "scale_lengths_half": lambda: scale_lengths(mreqs, 0.5),
        "scale_lengths_small": lambda: scale_lengths(mreqs, 0.01, block_size=16),
        "scale_lengths_block_4": lambda: scale_lengths(mreqs, 0.25, block_size=4, trace_block=256),
        "scale_lengths_zero": lambda: scale_lengths(mreqs, 0),
        "scale_lengths_past_one": lambda: scale_lengths(mreqs, 1.5),
        "scale_lengths_bad_block": lambda: scale_lengths(mreqs, 0.5, block_size=0),
        "synthetic_all": lambda: synthetic(8, arrivals=Poisson(3.0), prompt_len=LogNormal(20, 0.5, low=2, high=40),
                                           output_len=Choice((1, 5), (1.0, 3.0)), system_prompts=2,
                                           system_prompt_len=6, shared_fraction=0.5, trust_groups=["x", "y", "z"],
                                           n=Uniform(1, 3), priority=Choice((-1, 1)), seed=4, id_prefix="s",
                                           token_base=10),
        "synthetic_lognormal_unbounded": lambda: synthetic(6, arrivals=Gamma(5.0, 3.0), prompt_len=LogNormal(30, 1.5),
                                                           output_len=LogNormal(3, 2.0, low=0), seed=9),
        "synthetic_times": lambda: synthetic(3, arrivals=[0.3, 0.1, 0.2, 9.0], prompt_len=Fixed(4), output_len=2),
        "synthetic_zero": lambda: synthetic(0, arrivals=Poisson(1.0), prompt_len=4, output_len=1),
        "synthetic_only_system_prompt": lambda: synthetic(2, arrivals=[0, 0], prompt_len=0, output_len=1,
                                                          system_prompts=1, system_prompt_len=5, shared_fraction=1.0),
        "synthetic_empty_prompt": lambda: synthetic(2, arrivals=[0, 0], prompt_len=0, output_len=1),
        "synthetic_fraction": lambda: synthetic(2, arrivals=[0, 0], prompt_len=4, output_len=1, shared_fraction=1.5),
        "synthetic_fraction_without_prompts": lambda: synthetic(2, arrivals=[0, 0], prompt_len=4, output_len=1,
                                                                shared_fraction=0.5),
        "synthetic_few_times": lambda: synthetic(3, arrivals=[0.0], prompt_len=4, output_len=1),
        "synthetic_bad_arrivals": lambda: synthetic(3, arrivals=7, prompt_len=4, output_len=1),
        "synthetic_bad_dist": lambda: synthetic(3, arrivals=[0, 0, 0], prompt_len="long", output_len=1),
        "synthetic_token_space": lambda: synthetic(2, arrivals=[0, 0], prompt_len=10, output_len=1,
                                                   token_base=2**32 - 15),
        "synthetic_bad_groups": lambda: synthetic(2, arrivals=[0, 0], prompt_len=4, output_len=1, trust_groups=[""]),
        "dist_uniform": lambda: Uniform(5, 4),
        "dist_fixed": lambda: Fixed(-1),
        "dist_lognormal": lambda: LogNormal(0, 1),
        "dist_lognormal_high": lambda: LogNormal(5, 1, low=3, high=2),
        "dist_choice_empty": lambda: Choice(()),
        "dist_choice_weights": lambda: Choice((1, 2), (0.0, 0.0)),
        "dist_choice_weights_count": lambda: Choice((1, 2), (1.0,)),
        "poisson_zero": lambda: Poisson(0),
        "poisson_bool": lambda: Poisson(True),
        "gamma_cv": lambda: Gamma(1.0, 0),
        "gamma_rate": lambda: Gamma(float("nan"), 1.0),
        "request_empty_prompt": lambda: SimRequest("e", 0.0, [], 1),
        "request_arrival": lambda: SimRequest("e", -1.0, [1], 1),
        "request_arrival_int": lambda: as_rows([SimRequest("e", 3, [1], 1)]),
        "request_output": lambda: SimRequest("e", 0.0, [1], -1),
        "request_n": lambda: SimRequest("e", 0.0, [1], 1, n=0),
        "request_priority": lambda: SimRequest("e", 0.0, [1], 1, priority=1.5),
        "request_group": lambda: SimRequest("e", 0.0, [1], 1, trust_group=""),
        "prompt_run": lambda: Prompt([(-1, 2)]),
        "prompt_past_ids": lambda: Prompt([(2**32 - 1, 2)]),
        "prompt_token": lambda: Prompt.from_tokens([1, 2**32]),
        "prompt_blocks_count": lambda: Prompt.from_blocks([1], 4, 9),
        "prompt_blocks_past_ids": lambda: Prompt.from_blocks([2**30], 4, 4),
        "prompt_repr": lambda: [repr(Prompt([(0, 2), (5, 1), (9, 1), (20, 3), (40, 1)])), repr(Prompt())],
        "prompt_ops": lambda: prompt_ops(Prompt([(10, 3), (50, 2), (7, 1)])),
        "prompt_common_prefix": lambda: [Prompt([(0, 5), (9, 3)]).common_prefix_len([0, 1, 2, 3, 4, 9, 10, 7]),
                                         Prompt([(0, 5)]).common_prefix_len(Prompt([(0, 3), (7, 1)]))],
    }
    return {name: outcome(fn, tmp_path) for name, fn in calls.items()}


def prompt_ops(p: Prompt) -> dict[str, Any]:
    """A prompt read every way a sequence is read."""
    return {"list": p.tolist(), "len": len(p), "reversed": list(reversed(p)), "items": [p[i] for i in range(-6, 6)],
            "slices": [list(p[a:b]) for a, b in ((0, 6), (1, 4), (2, 5), (4, 99), (5, 2), (-3, None))],
            "slice_runs": [list(map(list, p[1:5].runs)), list(map(list, p[3:].runs))],
            "stepped": p[::2], "contains": [x in p for x in (9, 10, 12, 13, 50, 51, 52, 7, True, "7")],
            "added": [list(x) for x in (p + Prompt([(8, 2)])).runs], "equal": [p == p.tolist(), p == [10, 11],
                                                                               p == Prompt.from_tokens(p.tolist())],
            "hash": hash(p) == hash(Prompt.from_tokens(list(p))), "index_errors": [repr(_raises(lambda: p[6])),
                                                                                    repr(_raises(lambda: p["a"]))]}


def _raises(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 -- the type is the answer
        return exc
    return None


def test_every_trace_format_and_refusal_equals_its_known_answer(tmp_path: Path) -> None:
    check("workload-files", {"files": files_answer(tmp_path / "files"), "calls": calls_answer(tmp_path)})


@pytest.mark.parametrize(("name", "header", "row"), [
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 00:00:00,4,1"),
    ("k.csv", "arrival_s,prompt_len,output_len", "0,4,1"),
    ("l.csv", "num_prefill_tokens,num_decode_tokens", "4,1"),
])
def test_a_csv_saved_with_a_byte_order_mark_loads(tmp_path: Path, name: str, header: str, row: str) -> None:
    """Spreadsheets save CSV as UTF-8 with a byte order mark. Sniffing skipped the mark and named the format,
    then the loader read the mark as part of the first column's name and refused its own format's header
    ("missing column(s) TIMESTAMP in header \\ufeffTIMESTAMP,...")."""
    path = tmp_path / name
    path.write_bytes(("\ufeff" + header + "\n" + row + "\n").encode())
    plain = tmp_path / "plain" / name
    plain.parent.mkdir()
    plain.write_bytes((header + "\n" + row + "\n").encode())
    kwargs = {"arrivals": [0.0]} if name == "l.csv" else {}
    assert as_rows(load_trace(path, **kwargs)) == as_rows(load_trace(plain, **kwargs))
    assert len(load_trace(path, **kwargs)) == 1


@pytest.mark.parametrize("fmt", ["azure", "kvledger-csv", "lengths"])
def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path: Path, fmt: str) -> None:
    """A CSV trace with a stray byte deep in the file: the refusal names the line holding it. The CSV reader
    decodes ahead of the rows it has returned, so the line it had counted (0 for a small file, an earlier line
    for a large one) was the line shown."""
    header = {"azure": "TIMESTAMP,ContextTokens,GeneratedTokens", "kvledger-csv": "arrival_s,prompt_len,output_len",
              "lengths": "num_prefill_tokens,num_decode_tokens"}[fmt]
    row = {"azure": "2023-11-16 00:00:00,4,1", "kvledger-csv": "0,4,1", "lengths": "4,1"}[fmt]
    lines = [header] + [row] * 5000 + [row.replace("4", "\xff")] + [row] * 10
    path = tmp_path / "t.csv"
    path.write_bytes("\n".join(lines).encode().replace("\xff".encode(), b"\xff"))
    with pytest.raises(ConfigError) as err:
        load_trace(path, fmt, arrivals=[0.0] * 6000)
    assert str(err.value) == f"{path}:5002: not UTF-8 text (byte 0xff)"
