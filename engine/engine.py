"""LLMEngine: one shared base model, continuous batching. `step()` = schedule -> execute -> update."""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.cache import AdapterCache
from adapters.config import AdapterConfig, is_int
from adapters.slots import slot_buffer_bytes
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheManager
from engine.lora import LoraRequest
from engine.model.loader import load_model
from engine.model.spec import ModelSpec
from engine.request import InvalidParameter, Request, RequestStatus, SamplingParams, TokenLogprobs
from engine.runner import ModelRunner, kv_block_bytes
from engine.scheduler import Scheduler, SchedulerConfig
from engine.tokenizer import decoded_bytes_reader, end_of_sequence_ids, load_tokenizer, special_token_ids

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 1 << 30
_CUDA_FREE_MEMORY_FRACTION = 0.85
# How long an idle step waits for an adapter load before returning to its caller.
_IDLE_LOAD_WAIT_S = 0.05


@dataclass
class RequestOutput:
    """What one step produced for one request: the new tokens and text since the last output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: str | int | None  # the stop string or stop token id that ended it, if any
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None  # why the request failed, when finish_reason is "error"
    prompt_logprobs: list[TokenLogprobs] | None = None
    """With SamplingParams.prompt_logprobs, on a request's first output: prompt tokens 1.. (the
    first has none, as it follows nothing)."""


@dataclass
class EngineMetrics:
    """A snapshot of the engine's gauges and counters."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    adapter_hits: int = 0
    adapter_misses: int = 0
    adapter_evictions: int = 0
    adapter_page_ins: int = 0
    adapter_disk_loads: int = 0
    adapters_resident: int = 0


@dataclass
class _OutputState:
    detokenizer: IncrementalDetokenizer | None
    adapter_id: str | None = None
    num_logprobs_sent: int = 0
    sent_prompt_logprobs: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        # Intra-op threads of this engine's work, which its CPU linears are split for
        # (engine/model/linear.py); AsyncEngine's step thread keeps it (sgmv_cpu.pin_num_threads).
        self.num_threads = torch.get_num_threads()
        self.spec = ModelSpec.from_folder(config.model)
        dtype = getattr(torch, config.dtype)
        device = torch.device(config.device)
        self.tokenizer = load_tokenizer(config.model)
        self._decoded_bytes = None if self.tokenizer is None else decoded_bytes_reader(self.tokenizer)
        self._special_ids = frozenset() if self.tokenizer is None else special_token_ids(self.tokenizer)
        self.eos_token_ids = end_of_sequence_ids(config.model, self.spec.eos_token_ids, self.tokenizer,
                                                 self.spec.vocab_size)
        num_blocks = self._num_kv_blocks(dtype, device)
        self.max_model_len = max_len = self._max_model_len(num_blocks)
        if config.lora is not None:
            self._check_lora_slots_fit(config.lora, dtype, device)
        self.model = load_model(config.model, dtype, device, max_positions=max_len,
                                show_progress=show_progress)
        self.kv_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # NOTE: an adapter's folder is kept while a request uses it, not after: every version of
        # every tenant's adapter passes through a long-running engine.
        self._adapter_paths: dict[str, Path] = {}
        self._adapter_uses: collections.Counter[str] = collections.Counter()
        self.adapter_cache = None
        if config.lora is not None:
            self.adapter_cache = AdapterCache(config.lora, self.spec, dtype, device,
                                              loader=self._adapter_paths.__getitem__)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, max_len),
            self.kv_manager, self.adapter_cache)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.seed,
                                  self.adapter_cache)
        self._outputs: dict[str, _OutputState] = {}
        logger.info("engine ready: %d KV blocks of %d tokens, max_model_len %d",
                    num_blocks, config.block_size, max_len)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, tenant: str | None = None,
                    lora: LoraRequest | None = None) -> Request:
        """Queue a request, on the base model or with `lora`'s adapter.

        Raises InvalidParameter (with the reason and the field) for requests it can never run,
        ValueError for what no field of the request could change."""
        if lora is not None and self.adapter_cache is None:
            raise ValueError("this engine was started without LoRA support; enable it to use adapters")
        if not is_int(priority):
            # NOTE: the waiting queue is kept sorted by it: any other type failed that sort, in
            # this call or in a later step (every request in flight then)
            raise InvalidParameter(f"priority must be an integer, got {priority!r}", "priority")
        token_ids = self._prompt_token_ids(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidParameter(f"the prompt has {len(token_ids)} tokens but this model accepts at "
                                   f"most {self.max_model_len - 1}; shorten the prompt", "prompt")
        if params.stop and self.tokenizer is None:
            raise InvalidParameter("stop strings need a tokenizer and this model folder has none", "stop")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            self._check_vocabulary(ids, name, f"{name} has token ids")
        request = Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids,
                          priority=priority, tenant=tenant,
                          adapter_id=lora.adapter_id if lora else None)
        self._check_something_is_sampleable(request)
        # NOTE: all that may raise comes before the request is queued: one queued with no output
        # state failed every step after it (a KeyError), every other request with it.
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop,
                                                 params.include_stop_str_in_output, self._decoded_bytes,
                                                 self._special_ids)
        if params.seed is not None:
            request.generator = self.runner.sampler.make_request_generator(params.seed)
        if lora is not None:
            self._adapter_paths[lora.adapter_id] = Path(lora.path)
        self.scheduler.add_request(request)
        self._outputs[request_id] = _OutputState(detokenizer, lora.adapter_id if lora else None)
        if lora is not None:
            self._adapter_uses[lora.adapter_id] += 1
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its KV blocks: its last output (finished, with
        finish_reason "abort"), None if it was not running."""
        self._forget_output(request_id)
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return None if request is None else self._last_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and self.adapter_cache is not None:
            self.adapter_cache.wait_for_loads(timeout=_IDLE_LOAD_WAIT_S)
        runner_output = self.runner.execute(scheduler_output)
        updated = self.scheduler.update(scheduler_output, runner_output)
        failed = [self._last_output(request) for request in self.scheduler.take_failed()]
        outputs = failed + [self._make_output(request) for request in updated]
        if len(self._adapter_paths) > len(self._adapter_uses):
            self._forget_unused_adapter_paths()
        return outputs

    def metrics(self) -> EngineMetrics:
        kv, stats = self.kv_manager, self.scheduler.stats
        adapters = {}
        if self.adapter_cache is not None:
            cache_stats = self.adapter_cache.stats
            adapters = dict(adapter_hits=cache_stats.num_hits, adapter_misses=cache_stats.num_misses,
                            adapter_evictions=cache_stats.num_evictions,
                            adapter_page_ins=cache_stats.num_page_ins,
                            adapter_disk_loads=cache_stats.num_loads,
                            adapters_resident=len(self.adapter_cache.resident_ids()))
        return EngineMetrics(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_free=kv.num_free_blocks,
            prefix_cache_queried_tokens=kv.prefix_stats.num_queried_tokens,
            prefix_cache_hit_tokens=kv.prefix_stats.num_hit_tokens,
            prefix_cache_hit_rate=kv.prefix_stats.hit_rate,
            num_prompt_tokens=stats.num_prompt_tokens_computed,
            num_generation_tokens=stats.num_generation_tokens,
            num_preemptions=stats.num_preemptions,
            **adapters,
        )

    def _make_output(self, request: Request) -> RequestOutput:
        state = self._outputs[request.request_id]
        detokenizer = state.detokenizer
        params = request.sampling_params
        last = request.output_token_ids[-1]
        # NOTE: stopped here means the scheduler stopped it on `last` (EOS or a stop token id);
        # as in vLLM, that token's text is left out unless include_stop_str_in_output.
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED
        stop_reason = last if stopped_by_token and last in params.stop_token_ids else None
        shows_last_token = not stopped_by_token or params.include_stop_str_in_output
        if detokenizer is not None and not shows_last_token:
            detokenizer.end_before(last)
        elif detokenizer is not None:
            detokenizer.add_tokens([last], check_stop=request.can_stop and not stopped_by_token,
                                   is_last=request.is_finished)
            if detokenizer.stop_reason is not None:
                stop_reason = detokenizer.stop_reason
                if not request.is_finished:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                # NOTE: a stop string completed by the last allowed token is still a stop.
                request.status = RequestStatus.FINISHED_STOPPED
        finished = request.is_finished
        if finished:
            self._forget_output(request.request_id)
        new_logprobs = request.output_logprobs[state.num_logprobs_sent:]
        state.num_logprobs_sent = len(request.output_logprobs)
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None and not state.sent_prompt_logprobs:
            # The first output follows the step that computed the prompt's last token: all there.
            prompt_logprobs, state.sent_prompt_logprobs = list(request.prompt_logprobs), True
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[last],
            new_text=detokenizer.take_delta(finished) if detokenizer else "",
            new_logprobs=new_logprobs,
            finished=finished,
            finish_reason=request.status.value if finished else None,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def _forget_output(self, request_id: str) -> None:
        """Drop what outputs a request that ended needed, and the folders of adapters no request
        uses and no load reads any more (a request that comes later names its folder again)."""
        state = self._outputs.pop(request_id, None)
        if state is None or state.adapter_id is None:
            return
        self._adapter_uses[state.adapter_id] -= 1
        if self._adapter_uses[state.adapter_id] > 0:
            return
        del self._adapter_uses[state.adapter_id]
        self._forget_unused_adapter_paths()

    def _forget_unused_adapter_paths(self) -> None:
        # NOTE: a load started for a request that left may not have asked for its folder yet;
        # its folder is forgotten at the first step after the load ends.
        loading = self.adapter_cache.loading_ids() if self.adapter_cache is not None else set()
        for adapter_id in self._adapter_paths.keys() - self._adapter_uses.keys() - loading:
            del self._adapter_paths[adapter_id]

    def _last_output(self, request: Request) -> RequestOutput:
        """The output that ends a request finished with no token more (aborted, or failed: its
        status says which), its output state forgotten (if it was not already)."""
        self._forget_output(request.request_id)
        return RequestOutput(request.request_id, [], "", [], finished=True,
                             finish_reason=request.status.value, stop_reason=None,
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_output_tokens=request.num_output_tokens,
                             num_cached_tokens=request.num_cached_tokens, error=request.error)

    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: send token ids, not text")
            token_ids = self.tokenizer.encode(prompt)
            # NOTE: a tokenizer may hold tokens added past the model's embeddings: one in the text
            # would fail the whole step it runs in, every request of the batch with it.
            self._check_vocabulary(token_ids, "prompt", "the prompt's text encodes to tokens the "
                                   "model has no embedding for (its tokenizer has tokens added "
                                   "past the model's embeddings): ids")
            return token_ids
        token_ids = [int(t) for t in prompt]
        self._check_vocabulary(token_ids, "prompt", "token ids")
        return token_ids

    def _check_vocabulary(self, token_ids: Iterable[int], param: str, what: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise InvalidParameter(f"{what} outside the vocabulary [0, {self.spec.vocab_size}): "
                                   f"{bad[:5]}", param)

    def _check_something_is_sampleable(self, request: Request) -> None:
        """Refuse a request whose first token has no choice left: before min_tokens, EOS and the
        stop token ids are banned, and banning the whole vocabulary leaves greedy a banned token
        and sampling nothing at all."""
        vocab_size = self.spec.vocab_size
        banned = request.unsampleable_token_ids
        if len(banned) < vocab_size or sum(0 <= t < vocab_size for t in banned) < vocab_size:
            return
        params = request.sampling_params
        banned_ids = "stop_token_ids" if params.ignore_eos else "EOS and stop_token_ids"
        raise InvalidParameter(
            f"min_tokens {params.min_tokens} bans {banned_ids} until that many tokens are generated, "
            f"and they are all {vocab_size} tokens of the vocabulary, so no token could be generated; "
            "set min_tokens to 0 or leave some tokens out of stop_token_ids", "min_tokens")

    def _max_model_len(self, num_blocks: int) -> int:
        """The longest sequence served: max_model_len when set, else the model's context, lowered
        (with a warning) to what the KV cache holds. Raises ValueError for a max_model_len that the
        model or the KV cache cannot serve."""
        context_length, max_model_len = self.spec.context_length, self.config.max_model_len
        num_kv_tokens = num_blocks * self.config.block_size
        if max_model_len is None:
            if num_kv_tokens < context_length:
                logger.warning("the KV cache holds %d tokens (%d blocks of %d), fewer than this model's "
                               "context of %d: max_model_len is %d; give the KV cache more memory "
                               "to serve the whole context", num_kv_tokens, num_blocks,
                               self.config.block_size, context_length, num_kv_tokens)
            return min(context_length, num_kv_tokens)
        if max_model_len > context_length:
            # Positions past the trained ones give garbage, silently (vLLM refuses too).
            raise ValueError(f"max_model_len {max_model_len} is more than the {context_length} tokens "
                             "this model was trained for (max_position_embeddings in its config.json); "
                             "lower max_model_len")
        if max_model_len > num_kv_tokens:
            # One sequence that long could never run, and lowering the limit silently would refuse
            # prompts the operator asked to serve (vLLM refuses too).
            raise ValueError(f"max_model_len {max_model_len} is more than the {num_kv_tokens} tokens "
                             f"the KV cache holds ({num_blocks} blocks of {self.config.block_size}); "
                             "give the KV cache more memory or lower max_model_len")
        return max_model_len

    def _check_lora_slots_fit(self, lora: AdapterConfig, dtype: torch.dtype,
                              device: torch.device) -> None:
        """ValueError, before the weights load, if the device slots cannot fit its memory."""
        need = slot_buffer_bytes(self.spec, lora.max_gpu_adapters, lora.max_lora_rank, dtype)
        if need > (memory := _device_memory_bytes(device)):
            raise ValueError(f"device slots for {lora.max_gpu_adapters} adapters of rank up to "
                             f"{lora.max_lora_rank} take {need} bytes, more than the {device.type} "
                             f"memory ({memory} bytes); lower max_loras or max_lora_rank")

    def _num_kv_blocks(self, dtype: torch.dtype, device: torch.device) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        budget = config.kv_cache_memory_bytes
        if budget is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                weight_bytes = _estimate_weight_bytes(self.spec, dtype)
                budget = int((free - weight_bytes) * _CUDA_FREE_MEMORY_FRACTION)
            else:
                budget = _DEFAULT_CPU_KV_BYTES
        elif budget > (memory := _device_memory_bytes(device)):
            raise ValueError(f"a KV budget of {budget} bytes is more than the {device.type} memory "
                             f"({memory} bytes{' free' if device.type == 'cuda' else ''}); lower "
                             "kv_cache_memory")
        num_blocks = budget // kv_block_bytes(self.spec, config.block_size, dtype)
        if num_blocks < 2:
            raise ValueError(f"a KV budget of {budget} bytes holds fewer than 2 blocks; raise it")
        return num_blocks


def _device_memory_bytes(device: torch.device) -> int:
    """What the engine's buffers (KV cache, adapter slots) may at most take, each: the GPU's free
    memory, or the host's physical memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _estimate_weight_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    per_layer = (spec.hidden_size * (spec.q_size + 2 * spec.kv_size) + spec.q_size * spec.hidden_size
                 + 3 * spec.hidden_size * spec.intermediate_size)
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return (spec.num_layers * per_layer + embeddings) * torch.empty((), dtype=dtype).element_size()
