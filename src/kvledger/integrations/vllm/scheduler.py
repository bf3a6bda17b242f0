"""The scheduler class vLLM loads with ``--scheduler-cls kvledger.integrations.vllm.Scheduler``: vLLM's
``AsyncScheduler`` with kvledger's ledger as its KV cache manager (see the package docstring)."""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from ...errors import ConfigError, InvariantError
from .lean import LeanSteps
from .manager import LedgerKVCacheManager
from .options import Options

logger = logging.getLogger(__name__)


class VllmLedgerScheduler(LeanSteps, AsyncScheduler):
    """vLLM's scheduler with kvledger's ledger as its KV cache manager; exported as
    ``kvledger.integrations.vllm.Scheduler`` (the package docstring says what it gives)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = self.vllm_config
        if self.connector is not None:
            raise ConfigError("kvledger's vLLM scheduler does not support KV connectors (--kv-transfer-config)")
        if self.num_spec_tokens or self.num_lookahead_tokens:
            raise ConfigError("kvledger's vLLM scheduler does not support speculative decoding yet")
        if self.lora_config is not None:
            raise ConfigError("kvledger's vLLM scheduler does not support LoRA adapters yet")
        if self.kv_cache_config.needs_kv_cache_zeroing:
            raise ConfigError("kvledger's vLLM scheduler supports full-attention models only")
        self.kvledger_options = Options.from_vllm(config.additional_config)
        old = self.kv_cache_manager
        self.kv_cache_manager = LedgerKVCacheManager(  # type: ignore[assignment]
            self.kv_cache_config, block_size=self.block_size, max_model_len=self.max_model_len,
            enable_caching=bool(self.cache_config.enable_prefix_caching), log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events, watermark=self.scheduler_config.watermark,
            options=self.kvledger_options, model=str(config.model_config.model) if config.model_config else "",
            kv_format=str(self.cache_config.cache_dtype))
        del old  # vLLM's own manager and its block pool: never used
        self.kv_cache_manager.add_pins(self._pin_tokens())
        self._kvl_metrics = None
        if self.kvledger_options.metrics:
            from .metrics import LedgerMetrics
            name = config.model_config.served_model_name if config.model_config else None
            if isinstance(name, (list, tuple)):
                name = name[0] if name else None
            self._kvl_metrics = LedgerMetrics(str(name or (config.model_config.model if config.model_config else "")))
        self._kvl_init_lean()

    def add_request(self, request: Any) -> None:
        if not self.enable_kv_cache_events:
            # kvledger's ledger hashes blocks itself (its own identity); vLLM's per-request block hashes only
            # feed the events, so without them vLLM need not hash every block of every generated token.
            request._block_hasher = None
        self._kvl_note_request(request)
        super().add_request(request)

    def schedule(self, throttle_prefills: bool = False) -> Any:
        manager: LedgerKVCacheManager = self.kv_cache_manager  # type: ignore[assignment]
        manager.sync_tokens(self.running)
        if manager._pins:
            manager.refresh_pins()
        if not throttle_prefills and self._kvl_lean_now():
            out = self._kvl_schedule()
        else:
            out = super().schedule(throttle_prefills)
        if self.kvledger_options.check:
            self._check()
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self._kvl_lean_now() and self._kvl_lean_output(scheduler_output, model_runner_output):
            out = self._kvl_update_from_output(scheduler_output, model_runner_output)
        else:
            out = super().update_from_output(scheduler_output, model_runner_output)
        manager: LedgerKVCacheManager = self.kv_cache_manager  # type: ignore[assignment]
        if manager.refused:
            self._end_refused(manager, out)
        if self._kvl_metrics is not None:
            if self.has_unfinished_requests():
                self._kvl_metrics.maybe_update(manager.ledger)
            else:  # going idle: no later step would refresh them
                self._kvl_metrics.update(manager.ledger)
        if self.kvledger_options.check:
            self._check()
        return out

    def _pin_tokens(self) -> list[tuple[tuple[int, ...], str | None]]:
        """The pinned prefixes as token ids: text is tokenized as vLLM tokenizes a completion prompt."""
        pins = []
        tokenizer = None
        for pin in self.kvledger_options.pins:
            tokens = pin.tokens
            if pin.prompt is not None:
                if tokenizer is None:
                    from vllm.tokenizers import cached_tokenizer_from_config
                    tokenizer = cached_tokenizer_from_config(self.vllm_config.model_config)
                    if tokenizer is None:
                        raise ConfigError("kvledger pins given as text need the model's tokenizer "
                                          "(not --skip-tokenizer-init); give prompt_token_ids instead")
                tokens = tuple(tokenizer.encode(pin.prompt))
            pins.append((tokens, pin.cache_salt))
        return pins

    def _check(self) -> None:
        """The ledger's laws, and the ledger's sequences are exactly vLLM's running requests."""
        manager: LedgerKVCacheManager = self.kv_cache_manager  # type: ignore[assignment]
        try:
            manager.check()
            held = set(manager.ledger.sequences())
            running = {r.request_id for r in self.running}
            if held != running:
                raise InvariantError(f"ledger sequences {sorted(held - running)} are not running in vLLM, "
                                     f"running {sorted(running - held)} hold no sequence")
        except InvariantError:
            if self._kvl_metrics is not None:
                self._kvl_metrics.check_failed()
            raise

    def _end_refused(self, manager: LedgerKVCacheManager, outputs: dict[int, Any]) -> None:
        """Requests the ledger can never admit (over their trust group's quota) end with an error output,
        as vLLM ends a request it cannot serve, instead of blocking the waiting queue for ever."""
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
        from vllm.v1.request import RequestStatus

        refused, manager.refused = manager.refused, {}
        for request in self.finish_requests(list(refused), RequestStatus.FINISHED_ERROR):
            logger.warning("kvledger: request %s can never be admitted: %s", request.request_id,
                           refused[request.request_id])
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=request.get_finished_reason(),
                events=request.take_events(), trace_headers=request.trace_headers))
