"""kvledger's lean ``schedule()`` / ``update_from_output()`` against vLLM's own code on the same state: two
kvledger schedulers fed the same randomized request stream (arrivals, shared prefixes, salts, stop tokens,
aborts, chunked prefills, preemptions under a small pool, a step in flight), one forced onto vLLM's path;
every step's ``SchedulerOutput`` and engine outputs must be equal."""

from __future__ import annotations

import random
import zlib

import pytest

from kvledger.integrations.vllm.harness import build_scheduler


def token(rid: str, pos: int) -> int:
    return zlib.crc32(f"{rid}:{pos}".encode()) % 40  # 7 is a stop token for some requests: ~2.5% a step


def comparable(engine_outputs: dict) -> dict:
    """Engine outputs with each request's event timestamps dropped (each scheduler stamps its own)."""
    out = {}
    for client, eco in engine_outputs.items():
        rows = [(o.request_id, list(o.new_token_ids), o.finish_reason, o.stop_reason,
                 [e.type for e in (o.events or [])], o.prefill_stats is not None) for o in eco.outputs]
        stats = eco.scheduler_stats
        pcs = stats.prefix_cache_stats if stats is not None else None
        out[client] = (rows, sorted(eco.finished_requests or ()),
                       None if stats is None else (stats.num_running_reqs, stats.num_waiting_reqs,
                                                   stats.kv_cache_usage, pcs.queries, pcs.hits, pcs.requests))
    return out


def drive(seed: int, *, admission: str, num_blocks: int, in_flight: int, steps: int = 300) -> int:
    """Runs the stream on a lean and a stock-path scheduler side by side; returns the lean steps taken."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    rng = random.Random(seed)
    cfg = {"kvledger": {"admission": admission, "check": True}}
    pair = [build_scheduler("kvledger", num_blocks=num_blocks, additional_config=cfg, max_num_batched_tokens=256,
                            max_num_seqs=24, max_model_len=512, long_prefill_token_threshold=96)
            for _ in range(2)]
    lean, stock = pair
    stock.scheduler._kvl_lean_config = False
    taken = 0
    real = lean.scheduler._kvl_schedule

    def counted():
        nonlocal taken
        taken += 1
        return real()

    lean.scheduler._kvl_schedule = counted
    heads = [[rng.randrange(1000, 32000) for _ in range(rng.choice((16, 40, 64)))] for _ in range(3)]
    queues: list[list] = [[], []]
    n = 0
    for _ in range(steps):
        arrivals = []
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2, 4))):
            prompt = (rng.choice(heads) if rng.random() < 0.5 else []) + [
                rng.randrange(1000, 32000) for _ in range(rng.randrange(1, 200))]
            mt = rng.randrange(1, 60)
            kw = {"max_tokens": mt, "ignore_eos": True,
                  "min_tokens": min(mt, rng.choice((0, 0, 3))), "stop_token_ids": [7] if rng.random() < 0.5 else None}
            arrivals.append((f"r{n}", prompt, kw, rng.choice((None, None, "tenant-a"))))
            n += 1
        aborts = [rid for rid in list(lean.scheduler.requests) if rng.random() < 0.004]
        outs = []
        for h, queue in zip(pair, queues, strict=True):
            sched = h.scheduler
            for rid, prompt, kw, salt in arrivals:
                sched.add_request(Request(rid, list(prompt), SamplingParams(**kw), None, block_hasher=h.hasher,
                                          cache_salt=salt))
            if aborts:
                sched.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
            out = sched.schedule()
            req_ids = list(out.num_scheduled_tokens)
            sampled = [[] if sched.requests[r].is_prefill_chunk else [token(r, sched.requests[r].num_computed_tokens)]
                       for r in req_ids]
            queue.append((out, ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                                 sampled_token_ids=sampled)))
            eco = {}
            if len(queue) > in_flight:
                done, mro = queue.pop(0)
                eco = comparable(sched.update_from_output(done, mro))
            outs.append((out, eco))
        (a, eco_a), (b, eco_b) = outs
        assert a == b, f"SchedulerOutput differs at step {lean.scheduler.current_step}"
        assert eco_a == eco_b, f"engine outputs differ at step {lean.scheduler.current_step}"
        assert [r.request_id for r in lean.scheduler.running] == [r.request_id for r in stock.scheduler.running]
    return taken


@pytest.mark.parametrize(("admission", "num_blocks", "in_flight"),
                         [("full", 400, 0), ("incremental", 60, 0), ("incremental", 60, 1), ("full", 90, 1)])
def test_lean_steps_equal_vllms_step_by_step(admission: str, num_blocks: int, in_flight: int) -> None:
    taken = drive(11 + num_blocks + in_flight, admission=admission, num_blocks=num_blocks, in_flight=in_flight)
    assert taken == 300  # every step went through the lean path, and each equalled vLLM's


def test_a_request_outside_the_subset_sends_the_step_to_vllms_code() -> None:
    h = build_scheduler("kvledger", num_blocks=64)
    sched = h.scheduler
    h.add("plain", list(range(1, 40)), 4)
    assert sched._kvl_lean_now()
    sched._kvl_note_request(type("R", (), {"request_id": "x", "structured_output_request": object(),
                                           "mm_features": [], "pooling_params": None, "sampling_params": None,
                                           "resumable": False, "lora_request": None})())
    sched.requests["x"] = sched.requests["plain"]  # as if it were waiting
    assert not sched._kvl_lean_now()
    del sched.requests["x"]
    assert sched._kvl_lean_now()  # gone with the request
