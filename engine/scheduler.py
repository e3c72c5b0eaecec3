"""Iteration-level scheduler: which requests run this step, and how many tokens each computes.

There is no prefill phase. Every request has `num_computed_tokens`; a step gives each scheduled
request some of its pending tokens under a token budget, so a long prompt is prefilled in chunks
that ride alongside the decode tokens of other requests (chunked prefill is the same code path).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus, TokenLogprobs


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int
    """Tokens computed this step, starting at `request.num_computed_tokens`."""

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class RunnerOutput:
    """What one forward pass produced: one sampled token per request whose chunk reached its end."""

    sampled: dict[str, SampledToken]


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0
    num_generation_tokens: int = 0


class Scheduler:
    """Owns the waiting and running queues and the KV block manager; never touches tensors."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager):
        self.config = config
        self.kv = kv_manager
        self.waiting: list[Request] = []  # NOTE: kept sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self.running.sort(key=lambda r: r.sort_key)

        # Running requests first (decodes and unfinished prefills), best priority first.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.can_allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                self.kv.allocate(request, num_new)
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
                continue
            break

        # Then admit waiting requests into whatever budget is left, in priority/FCFS order. A step
        # that had to preempt admits nothing: the pool is full.
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            hits = self.kv.get_computed_blocks(request)
            num_pending = request.num_tokens - len(hits) * self.kv.block_size
            num_new = min(num_pending, budget)
            if not self.kv.can_allocate(request, num_new, hits):
                break
            self.waiting.pop(0)
            self.kv.allocate(request, num_new, hits)
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Advance scheduled requests past the step; returns those that got a new token.

        Requests that hit EOS, a stop token, max_tokens or max_model_len are finished and freed.
        """
        updated = []
        for item in output.scheduled:
            request = item.request
            start = request.num_computed_tokens
            request.num_computed_tokens += item.num_tokens
            self.stats.num_prompt_tokens_computed += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - start)
            self.kv.cache_full_blocks(request)
            sampled = runner_output.sampled.get(request.request_id)
            if sampled is None:
                continue
            request.output_token_ids.append(sampled.token_id)
            if sampled.logprobs is not None:
                request.output_logprobs.append(sampled.logprobs)
            self.stats.num_generation_tokens += 1
            finish = self._check_stop(request, sampled.token_id)
            if finish is not None:
                self.finish_request(request.request_id, finish)
            updated.append(request)
        return updated

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is; frees everything it holds. Idempotent."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        return request

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, go back to waiting."""
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
