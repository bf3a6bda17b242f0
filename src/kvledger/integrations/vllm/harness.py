"""vLLM's scheduler on CPU with no model: the tests' and the step benchmark's harness.

``build_scheduler`` makes a vLLM ``VllmConfig`` from a tiny Llama ``config.json`` (no weights, no
tokenizer) and a hand-built ``KVCacheConfig`` (one full-attention group, no tensors), then the scheduler
class asked for -- vLLM's own (``"vllm"``, ``"vllm-async"``) or kvledger's (``"kvledger"``). ``step``
runs one ``schedule()`` and feeds ``update_from_output`` a fake model output: one sampled token per
request whose prompt is complete. Nothing in vLLM is patched. (After ``/work/shared/peers/
vllm_scheduler_step.py``, which measured vLLM's own scheduler on the same workload.)
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

SCHEDULERS = ("vllm", "vllm-async", "kvledger")

_TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 1,
    "vocab_size": 32000, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
}
_MODEL_DIR: str | None = None


def tiny_model_dir() -> str:
    """A folder holding only a tiny Llama ``config.json`` (made once per process)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = tempfile.mkdtemp(prefix="kvledger-vllm-tiny-")
        with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
            json.dump(_TINY, f)
    return _MODEL_DIR


def scheduler_class(name: str) -> type:
    if name == "vllm":
        from vllm.v1.core.sched.scheduler import Scheduler
        return Scheduler
    if name == "vllm-async":
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        return AsyncScheduler
    if name == "kvledger":
        from . import Scheduler
        return Scheduler
    raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {name!r}")


def fake_token(position: int) -> int:
    """The fake model's token after ``position`` computed tokens (distinct for positions < 32000)."""
    return (position * 7919) % 32000


@dataclass(slots=True)
class Harness:
    """A scheduler and what a fake engine needs to drive it."""

    scheduler: Any
    hasher: Any
    block_size: int
    preemptions: int = 0
    hit_tokens: int = 0  # vLLM's prefix-cache statistics, summed (the scheduler is built with log_stats)
    query_tokens: int = 0
    finished: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)  # request id -> vLLM's finish reason
    outputs: dict[str, list[int]] = field(default_factory=dict)
    in_flight: int = 0  # steps scheduled ahead of their outputs (1: async scheduling)
    _queue: list = field(default_factory=list)

    def add(self, request_id: str, prompt: list[int], max_tokens: int, *, cache_salt: str | None = None,
            ignore_eos: bool = True, stop_after: int | None = None) -> Any:
        """``stop_after``: the request stops (a stop token) after that many output tokens."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        stop = None if stop_after is None else [fake_token(len(prompt) + stop_after - 1)]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop)
        req = Request(request_id, list(prompt), sp, None, block_hasher=self.hasher, cache_salt=cache_salt)
        self.scheduler.add_request(req)
        return req

    def step(self) -> Any:
        """One schedule + update; returns the SchedulerOutput. With ``in_flight`` 1 (async scheduling, as
        vLLM's engine runs it on a GPU) the update is the previous step's: a step is scheduled before the
        tokens of the one before it are known."""
        from vllm.v1.outputs import ModelRunnerOutput
        sched = self.scheduler
        out = sched.schedule()
        req_ids = list(out.num_scheduled_tokens)
        reqs = sched.requests
        sampled = []
        for rid in req_ids:
            r = reqs[rid]
            end = r.num_computed_tokens  # already advanced by schedule()
            sampled.append([] if r.is_prefill_chunk else [fake_token(end)])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)
        self._queue.append((out, mro))
        if len(self._queue) <= self.in_flight and sched.has_unfinished_requests():
            return out
        done, mro = self._queue.pop(0)
        eco = sched.update_from_output(done, mro)
        self.preemptions += len(out.preempted_req_ids or ())
        for outs in eco.values():
            pcs = outs.scheduler_stats.prefix_cache_stats if outs.scheduler_stats else None
            if pcs is not None:
                self.hit_tokens += pcs.hits
                self.query_tokens += pcs.queries
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished.append(o.request_id)
                    self.reasons[o.request_id] = str(o.finish_reason)
        return out

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is left; returns the number of steps."""
        n = 0
        while self.scheduler.has_unfinished_requests():
            self.step()
            n += 1
            if n >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
        return n


def build_scheduler(name: str = "kvledger", *, num_blocks: int = 1024, block_size: int = 16,
                    max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_model_len: int = 8192,
                    long_prefill_token_threshold: int = 0, prefix_caching: bool = True, watermark: float = 0.0,
                    additional_config: dict | None = None, log_stats: bool = True,
                    kv_events: bool = False) -> Harness:
    """A model-free vLLM scheduler of class ``name`` over ``num_blocks`` KV blocks (block 0 is vLLM's
    null block)."""
    import torch
    from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True, max_model_len=max_model_len,
                               dtype="float32", seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold, enable_chunked_prefill=True,
        is_encoder_decoder=False, async_scheduling=False, watermark=watermark)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    kwargs: dict[str, Any] = {}
    if kv_events:
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    vllm_config = VllmConfig(model_config=model_config, cache_config=cache_config,
                             scheduler_config=scheduler_config, additional_config=additional_config or {},
                             **kwargs)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    cls = scheduler_class(name)
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size,
                hash_block_size=block_size, log_stats=log_stats)
    return Harness(sched, get_request_block_hasher(block_size, hash_fn), block_size)
