"""A lean ``schedule()`` and ``update_from_output()`` for the part of vLLM 0.32 that kvledger's scheduler
serves: vLLM's own algorithm, line for line, with the branches for features refused at start-up (KV and
encoder connectors, speculative decoding, LoRA, Mamba alignment, pipeline parallelism, prefill replay and
look-ahead) and for requests it does not take on this path (structured output, multimodal or pooling
inputs, streaming sessions) left out.

Why: at 256 running requests most of a step is vLLM's own per-request loop (properties, context managers,
connector and encoder checks on every request), not the KV cache manager. :class:`LeanSteps` decides per
step: when anything outside the subset is present it calls vLLM's code, so behaviour never depends on the
path. ``tests/vllm_integration/test_lean.py`` holds the two paths to identical ``SchedulerOutput`` and
engine outputs step by step on randomized request streams.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Any

from vllm.distributed.kv_events import KVEventBatch
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.utils import check_stop, remove_all
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED
_RUNNING = RequestStatus.RUNNING
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
_SCHEDULED = EngineCoreEventType.SCHEDULED


def plain(request: Any) -> bool:
    """Whether ``request`` uses nothing the lean path leaves out."""
    return (request.structured_output_request is None and not request.mm_features
            and request.pooling_params is None and request.sampling_params is not None
            and not request.resumable and request.lora_request is None)


class LeanSteps:
    """Mixed into kvledger's ``AsyncScheduler`` subclass (see the module docstring). A mixin, not an object
    of its own, because these methods are vLLM's own ``schedule`` / ``update_from_output`` rewritten: they read
    and write the scheduler's state (queues, requests, budgets, stats) exactly where vLLM's methods do, so they
    must run as that scheduler; the module only keeps them apart from the adapter's wiring in scheduler.py."""

    _kvl_lean_config: bool
    _kvl_complex: set[str]

    def _kvl_init_lean(self: Any) -> None:
        cfg = self.scheduler_config
        self._kvl_complex = set()  # ids of unfinished requests the lean path does not take
        self._kvl_lean_config = (
            self.connector is None and self.ec_connector is None and self.aux_output_connector is None
            and not self.num_spec_tokens and self.dynamic_sd_lookup is None and not self.num_lookahead_tokens
            and self.lora_config is None and not self.need_mamba_block_aligned_split and not self.use_pp
            and not self.prefix_replay_tokens and not self.num_prefill_lookahead and not self.defer_block_free
            and not self.is_encoder_decoder and not self.is_mm_encoder_only and not self.return_sampling_mask
            and cfg.enable_chunked_prefill and self.policy == SchedulingPolicy.FCFS
            and self.num_sampled_tokens_per_step == 1
            and (self.perf_metrics is None or not self.perf_metrics.is_enabled()))

    def _kvl_note_request(self: Any, request: Any) -> None:
        if not plain(request):
            self._kvl_complex.add(request.request_id)

    def _kvl_lean_now(self: Any) -> bool:
        """The lean path serves this step: the configuration and every unfinished request allow it."""
        if not self._kvl_lean_config or self._pause_state != PauseState.UNPAUSED or self.kv_holding_waiting:
            return False
        complex_ = self._kvl_complex
        if complex_:
            requests = self.requests
            complex_.difference_update([rid for rid in complex_ if rid not in requests])
            if complex_:
                return False
        return True

    # ---- schedule ----------------------------------------------------------------------------------
    def _kvl_schedule(self: Any) -> SchedulerOutput:
        """vLLM 0.32's ``Scheduler.schedule`` + ``AsyncScheduler._update_after_schedule`` for the subset."""
        self.current_step += 1
        current_step = self.current_step
        scheduled_new_reqs: list[Any] = []
        scheduled_resumed_reqs: list[Any] = []
        scheduled_running_reqs: list[Any] = []
        preempted_reqs: list[Any] = []
        req_to_new_blocks: dict[str, Any] = {}
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens
        input_budget = self.scheduler_config.max_num_batched_tokens
        scheduled_timestamp = time.monotonic()
        manager = self.kv_cache_manager
        manager.new_step_starts()
        allocate = manager.allocate_slots
        running = self.running
        waiting = self.waiting
        max_model_len = self.max_model_len

        num_eligible = len(running) + len(waiting) + len(self.kv_holding_waiting)
        threshold = self.scheduler_config.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold > 0 and self.adaptive_long_prefill_threshold:
            threshold = max(threshold, input_budget // num_eligible)

        # The RUNNING requests.
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            if input_budget <= 0:
                break
            placeholders = request.num_output_placeholders
            computed = request.num_computed_tokens
            if placeholders > 0 and computed + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens:
                req_index += 1
                continue
            if current_step < request.next_decode_eligible_step:
                req_index += 1
                continue
            num_new_tokens = len(request._all_token_ids) + len(request.spec_token_ids) + placeholders - computed
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, token_budget, input_budget, max_model_len - computed - 1)
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while True:
                new_blocks = allocate(request, num_new_tokens)
                if new_blocks is not None:
                    break
                victim = running[-1]
                if not self._request_blocks_can_be_freed(victim):
                    break
                running.pop()
                self._preempt_request(victim, scheduled_timestamp, drop_stale_output=self.requires_kv_delivery)
                preempted_reqs.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled_running_reqs.append(request)
            request_id = request.request_id
            req_to_new_blocks[request_id] = new_blocks
            num_scheduled_tokens[request_id] = num_new_tokens
            token_budget -= num_new_tokens
            input_budget -= num_new_tokens
            req_index += 1
            if request.spec_token_ids:
                request.spec_token_ids = []

        # The WAITING requests.
        if not preempted_reqs:
            skipped_waiting: deque[Any] = deque()
            skipped_holding: deque[Any] = deque()
            deferred = self.deferred_waiting
            log_stats = self.log_stats
            while token_budget > 0:
                if not waiting or input_budget <= 0:
                    break
                if len(running) + self.num_waiting_for_streaming_input >= self.max_num_active_reqs:
                    break
                request = waiting.peek_request()
                request_id = request.request_id
                if request.num_stale_output_tokens and not request.drop_stale_output:
                    skipped = waiting.pop_request()
                    deferred.add(skipped)
                    if self._holds_kv_blocks(skipped):
                        skipped_holding.appendleft(skipped)
                    else:
                        skipped_waiting.appendleft(skipped)
                    continue
                did_lookup = False
                if request.num_computed_tokens == 0:
                    did_lookup = True
                    new_computed_blocks, num_local, request.shared_prefix_boundary = (
                        manager.get_computed_blocks(request))
                    num_computed_tokens = num_local
                    if request.prefill_stats and request.num_preemptions <= 0:
                        request.prefill_stats.set(num_prompt_tokens=request.num_prompt_tokens,
                                                  num_local_cached_tokens=num_local, num_external_cached_tokens=0)
                    self._set_kv_fetch_stage(request, None)
                else:
                    new_computed_blocks = manager.empty_kv_cache_blocks
                    num_local = 0
                    num_computed_tokens = request.num_computed_tokens
                num_new_tokens = request.num_tokens - num_computed_tokens
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                num_new_tokens = min(num_new_tokens, token_budget, input_budget)
                assert num_new_tokens > 0
                new_blocks = allocate(
                    request, num_new_tokens, num_new_computed_tokens=num_local,
                    new_computed_blocks=new_computed_blocks, num_lookahead_tokens=0,
                    num_external_computed_tokens=0, delay_cache_blocks=False, skip_zeroing_group_ids=(),
                    num_encoder_tokens=0, full_sequence_must_fit=self.scheduler_reserve_full_isl,
                    reserved_blocks=0, has_scheduled_reqs=bool(running))
                if new_blocks is None:
                    break
                if did_lookup:
                    manager.record_prefix_cache_stats(request, num_local)
                request = waiting.pop_request()
                deferred.discard(request)
                running.append(request)
                if log_stats:
                    request.record_event(_SCHEDULED, scheduled_timestamp)
                if request.status == _WAITING:
                    scheduled_new_reqs.append(request)
                elif request.status == _PREEMPTED:
                    scheduled_resumed_reqs.append(request)
                else:
                    raise RuntimeError(f"Invalid request status: {request.status}")
                req_to_new_blocks[request_id] = manager.get_blocks(request_id)
                num_scheduled_tokens[request_id] = num_new_tokens
                token_budget -= num_new_tokens
                input_budget -= num_new_tokens
                request.status = _RUNNING
                request.num_computed_tokens = num_computed_tokens
                self._set_kv_fetch_stage(request, None)
                if num_computed_tokens + num_new_tokens < request.num_tokens:
                    self._inflight_prefills.add(request)
            if skipped_holding:
                self.kv_holding_waiting.prepend_requests(skipped_holding)
            if skipped_waiting:
                waiting.prepend_requests(skipped_waiting)
            _, num_waiting = self.get_request_counts()
            self.prefill_capacity_bound = num_waiting > len(deferred)

        total = sum(num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens and token_budget >= 0 and input_budget >= 0
        assert len(running) <= self.max_num_running_reqs

        if self.use_v2_model_runner:
            scheduled_new_reqs.extend(scheduled_resumed_reqs)
            scheduled_resumed_reqs.clear()
            new_reqs_data = [NewRequestData.from_request(req, req_to_new_blocks[req.request_id].get_block_ids(),
                                                         req._all_token_ids, uses_mrope=self.model_uses_mrope)
                             for req in scheduled_new_reqs]
        else:
            new_reqs_data = [NewRequestData.from_request(req, req_to_new_blocks[req.request_id].get_block_ids(),
                                                         uses_mrope=self.model_uses_mrope)
                             for req in scheduled_new_reqs]
        cached_reqs_data = self._kvl_cached_request_data(scheduled_running_reqs, scheduled_resumed_reqs,
                                                         req_to_new_blocks)
        if not self.use_v2_model_runner:
            prev = self.prev_step_scheduled_req_ids
            prev.clear()
            prev.update(num_scheduled_tokens)
        manager.take_boundary_state_offloads()
        manager.take_kv_cache_block_copies()
        encoder_stats = None
        if self.log_stats and self.observability_config.enable_logging_iteration_details:
            encoder_stats = self._make_scheduled_encoder_input_stats({})
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data, scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens, total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            scheduled_encoder_input_stats=encoder_stats, preempted_req_ids=self.reset_preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            new_block_ids_to_zero=self._get_new_block_ids_to_zero(), has_sync_kv_loads=False,
            kv_cache_block_copies=None, kv_connector_block_state=None,
            num_spec_tokens_to_schedule=self.num_spec_tokens,
            ec_manager_metadata=self.encoder_cache_manager.get_manager_metadata())

        # _update_after_schedule (Scheduler's, then AsyncScheduler's).
        requests = self.requests
        inflight = self._inflight_prefills
        placeholders_list = self._spec_token_placeholders = []
        v2 = self.use_v2_model_runner
        next_step = current_step + self.decode_stagger
        for req_id, n in num_scheduled_tokens.items():
            request = requests[req_id]
            computed = request.num_computed_tokens = request.num_computed_tokens + n
            request.num_in_flight_tokens += n
            prefill = request.is_prefill_chunk = (
                computed < len(request._all_token_ids) + request.num_output_placeholders)
            if not prefill:
                inflight.discard(request)
                request.num_output_placeholders += 1
                request.spec_token_ids = placeholders_list
                if v2:
                    request.next_decode_eligible_step = next_step
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()
        return out

    def _kvl_cached_request_data(self: Any, running_reqs: list[Any], resumed_reqs: list[Any],
                                 req_to_new_blocks: dict[str, Any]) -> CachedRequestData:
        req_ids: list[str] = []
        new_block_ids: list[Any] = []
        all_token_ids: dict[str, list[int]] = {}
        num_computed_tokens: list[int] = []
        num_output_tokens: list[int] = []
        track = not self.use_v2_model_runner
        prev = self.prev_step_scheduled_req_ids
        for req in running_reqs:
            req_id = req.request_id
            req_ids.append(req_id)
            if track and req_id not in prev:
                all_token_ids[req_id] = req._all_token_ids.copy()
            new_block_ids.append(req_to_new_blocks[req_id].get_block_ids(allow_none=True))
            num_computed_tokens.append(req.num_computed_tokens)
            num_output_tokens.append(len(req._output_token_ids) + req.num_output_placeholders)
        resumed_req_ids = set()
        for req in resumed_reqs:
            req_id = req.request_id
            req_ids.append(req_id)
            resumed_req_ids.add(req_id)
            if track and req_id not in prev:
                all_token_ids[req_id] = req._all_token_ids.copy()
            new_block_ids.append(req_to_new_blocks[req_id].get_block_ids(allow_none=True))
            num_computed_tokens.append(req.num_computed_tokens)
            num_output_tokens.append(len(req._output_token_ids) + req.num_output_placeholders)
        return CachedRequestData(req_ids=req_ids, resumed_req_ids=resumed_req_ids, new_token_ids=[],
                                 all_token_ids=all_token_ids, new_block_ids=new_block_ids,
                                 num_computed_tokens=num_computed_tokens, num_output_tokens=num_output_tokens)

    # ---- update_from_output ------------------------------------------------------------------------
    def _kvl_lean_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> bool:
        """Whether this step's model output is one the lean update takes."""
        return (not model_runner_output.kv_connector_output and not model_runner_output.pooler_output
                and not scheduler_output.scheduled_spec_decode_tokens)

    def _kvl_update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        """vLLM 0.32's ``Scheduler.update_from_output`` with ``AsyncScheduler._update_request_with_output``
        (and ``check_stop``'s common checks) inlined, for the subset."""
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs_dict = model_runner_output.prompt_logprobs_dict
        prompt_token_id_logprobs_dict = model_runner_output.prompt_token_id_logprobs_dict
        num_nans_in_logits = model_runner_output.num_nans_in_logits
        req_id_to_index = model_runner_output.req_id_to_index
        outputs: dict[int, list[Any]] = defaultdict(list)
        stopped_running: set[Any] = set()
        stopped_preempted: set[Any] = set()
        requests = self.requests
        max_model_len = self.max_model_len
        estimate_cached = self.kv_cache_manager.estimate_cached_tokens
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            stale = False
            if request is not None:
                request.num_in_flight_tokens -= n
                if request.num_stale_output_tokens > 0:
                    stale = True
                    request.num_stale_output_tokens -= n
                    assert request.num_stale_output_tokens >= 0
            if request is None or request.status > _PREEMPTED:
                continue
            if stale and request.drop_stale_output:
                continue
            req_index = req_id_to_index[req_id]
            new_token_ids = sampled_token_ids[req_index] if sampled_token_ids else []
            stopped = False
            status_before_stop = request.status
            sp = request.sampling_params
            if new_token_ids:
                out_ids = request._output_token_ids
                all_ids = request._all_token_ids
                hasher = request._block_hasher
                for num_new, token in enumerate(new_token_ids, 1):
                    out_ids.append(token)
                    all_ids.append(token)
                    if hasher is not None:
                        request.block_hashes.extend(hasher(request))
                    if sp.repetition_detection is not None:
                        stopped = check_stop(request, max_model_len)
                    elif token == sp.eos_token_id:
                        request.status = _STOPPED
                        stopped = True
                    elif sp.stop_token_ids and token in sp.stop_token_ids:
                        request.status = _STOPPED
                        request.stop_reason = token
                        stopped = True
                    elif len(all_ids) >= max_model_len or len(out_ids) >= request.max_tokens:
                        request.status = _LENGTH
                        stopped = True
                    if stopped:
                        del new_token_ids[num_new:]
                        break
                if not stale:
                    request.num_output_placeholders -= len(new_token_ids)
                    assert request.num_output_placeholders >= 0
            prefill_stats = None
            if new_token_ids or stopped:
                prefill_stats = request.take_prefill_stats()
                if prefill_stats is not None:
                    prefill_stats.finalize(estimate_cached(request))
            new_logprobs = None
            if sp.num_logprobs is not None and logprobs:
                new_logprobs = logprobs.slice_request(req_index, len(new_token_ids))
            finish_reason = None
            if stopped:
                finish_reason = request.get_finished_reason()
                if self._handle_stopped_request(request):
                    self._free_request(request)
                if status_before_stop == _RUNNING:
                    stopped_running.add(request)
                else:
                    stopped_preempted.add(request)
            if num_nans_in_logits is not None and req_id in num_nans_in_logits:
                request.num_nans_in_logits = num_nans_in_logits[req_id]
            prompt_logprobs_tensors = prompt_logprobs_dict.get(req_id)
            prompt_token_id_logprobs = prompt_token_id_logprobs_dict.get(req_id)
            if new_token_ids or stopped:
                outputs[request.client_index].append(EngineCoreOutput(
                    request_id=req_id, new_token_ids=new_token_ids, finish_reason=finish_reason,
                    new_logprobs=new_logprobs, new_prompt_logprobs_tensors=prompt_logprobs_tensors,
                    prompt_token_id_logprobs=prompt_token_id_logprobs, stop_reason=request.stop_reason,
                    events=request.take_events(), prefill_stats=prefill_stats,
                    spec_decode_metrics=request.spec_decode_metrics if finish_reason is not None else None,
                    trace_headers=request.trace_headers, num_nans_in_logits=request.num_nans_in_logits))
            else:
                assert not prompt_logprobs_tensors
                assert prompt_token_id_logprobs is None

        if stopped_running:
            self.running = remove_all(self.running, stopped_running)
        if stopped_preempted:
            self.waiting.remove_requests(stopped_preempted)
            self.kv_holding_waiting.remove_requests(stopped_preempted)
            self.deferred_waiting.difference_update(stopped_preempted)
        error_req_ids = set(self.grammar_compile_error_reqs)
        self.grammar_compile_error_reqs.clear()
        error_req_ids.update(self.encoder_cache_mismatch_reqs)
        self.encoder_cache_mismatch_reqs.clear()
        if error_req_ids:
            for request in self.finish_requests(error_req_ids, RequestStatus.FINISHED_ERROR):
                outputs[request.client_index].append(EngineCoreOutput(
                    request_id=request.request_id, new_token_ids=[], finish_reason=request.get_finished_reason(),
                    events=request.take_events(), trace_headers=request.trace_headers))
        events = self.kv_cache_manager.take_events()
        if events:
            self.kv_event_publisher.publish(KVEventBatch(ts=time.time(), events=events))
        engine_core_outputs = {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}
        finished_req_ids = self.finished_req_ids_dict
        if finished_req_ids:
            for client, finished_set in finished_req_ids.items():
                if (eco := engine_core_outputs.get(client)) is not None:
                    eco.finished_requests = finished_set
                else:
                    engine_core_outputs[client] = EngineCoreOutputs(finished_requests=finished_set)
            finished_req_ids.clear()
        stats = self.make_stats(None, None, model_runner_output.cudagraph_stats, None, ec_connector_stats=None)
        if stats is not None:
            if (eco := next(iter(engine_core_outputs.values()), None)) is None:
                engine_core_outputs[0] = eco = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return engine_core_outputs
