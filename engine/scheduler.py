"""Iteration-level scheduler: which requests run this step, and how many tokens each computes.

There is no prefill phase. Every request has `num_computed_tokens`; a step gives each scheduled
request some of its pending tokens under a token budget, so a long prompt is prefilled in chunks
that ride alongside the decode tokens of other requests (chunked prefill is the same code path).
"""

from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.lora import AdapterSlots
from engine.request import Request, RequestStatus, TokenLogprobs


# Distinct adapters of the queue head warmed each step; deeper in the queue they would only churn.
_MAX_PREFETCH_ADAPTERS = 16
# Tenants whose next turn TenantRounds keeps before it forgets those with no request left.
_MAX_TENANT_TURNS = 1024


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

    @property
    def prompt_logprob_positions(self) -> range:
        """The positions of this chunk whose logits give prompt logprobs still to record."""
        start = self.request.num_computed_tokens
        return self.request.prompt_logprob_positions(start, start + self.num_tokens)


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
    error: str | None = None
    """Why sampling this request failed (then `token_id` means nothing): the request fails alone."""


@dataclass
class RunnerOutput:
    """What one forward pass produced: one sampled token per request whose chunk reached its end."""

    sampled: dict[str, SampledToken]
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """Per request, the prompt logprobs of the positions its chunk computed, in order."""


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0
    num_generation_tokens: int = 0


class TenantRounds:
    """Fair turns between tenants within a priority. Each request takes a round: its tenant's next,
    but none before the round admission has reached, and requests wait in (priority, round,
    arrival) order. A tenant that queues many requests at once (the 2048 choices of one call)
    takes as many rounds, so another tenant's request arriving behind them waits for about one
    round, not for all of them; a tenant that was idle saves up no turns, nor owes the turns of
    requests that left unserved (aborted). Requests of one tenant (or of none: the offline API)
    keep first come, first served."""

    def __init__(self) -> None:
        self.reached = 0
        self._next: dict[str | None, int] = {}
        self._num_requests: dict[str | None, int] = {}  # each tenant's requests in the scheduler
        self._forget_at = _MAX_TENANT_TURNS

    def take(self, tenant: str | None) -> int:
        turn = max(self._next.get(tenant, 0), self.reached)
        self._next[tenant] = turn + 1
        self._num_requests[tenant] = self._num_requests.get(tenant, 0) + 1
        if len(self._next) > self._forget_at:
            # A tenant with no request left starts again at `reached`, as one never seen: it has
            # no turns in the queue to wait behind.
            self._next = {t: n for t, n in self._next.items() if t in self._num_requests}
            self._forget_at = max(_MAX_TENANT_TURNS, 2 * len(self._next))
        return turn

    @property
    def num_tenants(self) -> int:
        """Tenants whose next turn is kept."""
        return len(self._next)

    def admitted(self, request: Request, skipped_round: int) -> None:
        """`request` left the queue for the batch, passing over waiting requests whose lowest round
        is `skipped_round`: admission reaches no further than a round still waiting (the choices
        of an n > 1 call that wait one step for their prompt's blocks)."""
        self.reached = max(self.reached, min(request.fair_round, skipped_round))

    def left(self, request: Request) -> None:
        """`request` left the scheduler (finished, aborted or failed)."""
        tenant = request.tenant
        self._num_requests[tenant] -= 1
        if self._num_requests[tenant] == 0:
            del self._num_requests[tenant]
            # Rounds its requests took and left unserved (aborted while queued) are not owed.
            self._next[tenant] = min(self._next[tenant], self.reached + 1)


class Scheduler:
    """Owns the waiting and running queues, the KV block manager and adapter slot admission;
    never touches tensors."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 adapter_slots: AdapterSlots | None = None):
        self.config = config
        self.kv = kv_manager
        self.adapter_slots = adapter_slots
        self.waiting: list[Request] = []  # NOTE: kept sorted by Request.sort_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.failed: list[Request] = []  # finished with an error since the last `take_failed`
        self.stats = SchedulerStats()
        self.tenant_rounds = TenantRounds()

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.fair_round = self.tenant_rounds.take(request.tenant)
        self._enqueue_waiting(request)  # NOTE: first: a request it failed to queue is not kept
        self.requests[request.request_id] = request

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

        if not preempted:  # a step that had to preempt admits nothing: the pool is full
            self._admit_waiting(budget, scheduled, preempted)
        self._prefetch_waiting_adapters()
        return SchedulerOutput(scheduled, preempted)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest], preempted: list[str]) -> None:
        """Admit waiting requests into the budget left, in priority and turn order (TenantRounds),
        onto `scheduled`.

        A request whose next prompt block another request computes in this step (the choices
        of one n > 1 call, a shared system prompt arriving in a burst) waits one step, and then
        reads that block, and the ones after it that are ready, from the prefix cache instead of
        computing them again.

        KV memory and batch slots are taken in that order within a priority: the first request
        that does not fit stops admission, unless less urgent requests run. Then, as vLLM's priority
        policy, the least urgent of them is preempted (even if scheduled in this step) until it fits.

        Adapter slots are not: a request whose adapter cannot get a slot now waits without blocking
        requests of the base model behind it, and preempts nothing. NOTE: once one adapter request
        is blocked for want of a slot, later adapter requests wait too, so the busy adapters drain
        and free a slot for it; otherwise a steady stream for resident adapters could starve it
        forever. One whose adapter is not loaded yet blocks no one: storage may take seconds, and
        the cache loads only as many adapters ahead as its host tier holds.
        """
        in_flight = self._blocks_in_flight(scheduled)
        slot_blocked = False
        skipped_round = sys.maxsize  # the lowest round of the requests passed over, which still wait
        index = 0
        while index < len(self.waiting) and budget > 0:
            request = self.waiting[index]
            has_seat = len(self.running) < self.config.max_num_seqs
            if not has_seat and self._victim_for(request) is None:
                break
            if request.adapter_id is not None and (slot_blocked or not self._can_get_slot(request)):
                if request.is_finished:  # its adapter failed to load: its requests left the queue
                    index = self._index_after(request)
                    continue
                # A request whose adapter is not in host memory yet needs no slot yet.
                slot_blocked = slot_blocked or self.adapter_slots.is_loaded(request.adapter_id)
                skipped_round = min(skipped_round, request.fair_round)
                index += 1
                continue
            # Cached blocks would skip the positions whose logits prompt logprobs come from.
            hits = [] if request.needs_prompt_logprobs else self.kv.get_computed_blocks(request)
            if not request.needs_prompt_logprobs and self._next_block_is_in_flight(request, hits, in_flight):
                skipped_round = min(skipped_round, request.fair_round)
                index += 1
                continue
            num_new = min(request.num_tokens - len(hits) * self.kv.block_size, budget)
            if not has_seat or not self.kv.can_allocate(request, num_new, hits):
                victim = self._victim_for(request)
                if victim is None:
                    break
                budget += self._preempt_for_priority(victim, scheduled)
                preempted.append(victim.request_id)
                in_flight = self._blocks_in_flight(scheduled)
                # NOTE: the victim waits again behind `request` (it is less urgent), so `index`
                # still points at `request`: try it again with the victim's seat and blocks free.
                continue
            if not self._acquire_slot(request):
                index = self._index_after(request)
                continue
            del self.waiting[index]
            self.tenant_rounds.admitted(request, skipped_round)
            self.kv.allocate(request, num_new, hits)
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            in_flight.update(self._blocks_computed_by(scheduled[-1]))
            budget -= num_new

    def _victim_for(self, request: Request) -> Request | None:
        """The running request to preempt for waiting `request`: the least urgent one (the latest
        turn among equals), if it is strictly less urgent than `request`."""
        victim = max(self.running, key=lambda r: r.sort_key, default=None)
        return victim if victim is not None and victim.priority > request.priority else None

    def _preempt_for_priority(self, victim: Request, scheduled: list[ScheduledRequest]) -> int:
        """Preempt a running request for a more urgent one; returns the tokens it had been
        scheduled in this step, which go back to the budget."""
        self.running.remove(victim)
        self._preempt(victim)
        item = next((item for item in scheduled if item.request is victim), None)
        if item is None:  # the budget ran out before the victim's turn in this step
            return 0
        scheduled.remove(item)
        return item.num_tokens

    def _blocks_in_flight(self, scheduled: list[ScheduledRequest]) -> set[bytes]:
        return {block for item in scheduled for block in self._blocks_computed_by(item)}

    def _blocks_computed_by(self, item: ScheduledRequest) -> list[bytes]:
        """Hashes of the full blocks that `item` completes in this step."""
        if not self.kv.enable_prefix_caching:
            return []
        request = item.request
        done = request.num_computed_tokens // self.kv.block_size
        return self.kv.full_block_hashes(request, request.num_computed_tokens + item.num_tokens)[done:]

    def _next_block_is_in_flight(self, request: Request, hits: list[int], in_flight: set[bytes]) -> bool:
        """Whether the first prompt block `request` would compute is being computed in this step."""
        hashes = request.block_hashes  # NOTE: get_computed_blocks hashed every block it may hit
        max_hit_blocks = (request.num_tokens - 1) // self.kv.block_size
        return len(hits) < min(max_hit_blocks, len(hashes)) and hashes[len(hits)] in in_flight

    def _can_get_slot(self, request: Request) -> bool:
        if self.adapter_slots is None:
            raise RuntimeError("a request with an adapter reached an engine without LoRA support")
        try:
            return self.adapter_slots.can_acquire(request.adapter_id)
        except Exception as error:  # the adapter failed to load: fail its requests, not the step
            self._fail_adapter_requests(request.adapter_id, error)
            return False

    def _acquire_slot(self, request: Request) -> bool:
        """Pin the adapter of a request being admitted, if it has one; False if that failed (and
        failed the adapter's requests).

        NOTE: called while the request is still waiting and holds no KV block, so a failure leaves
        nothing behind and no request outside both queues.
        """
        if request.adapter_id is None:
            return True
        try:
            request.lora_slot = self.adapter_slots.acquire(request.adapter_id,
                                                           counted=request.num_preemptions == 0)
        except Exception as error:
            self._fail_adapter_requests(request.adapter_id, error)
            return False
        return True

    def _fail_adapter_requests(self, adapter_id: str, error: Exception) -> None:
        """Fail every waiting request of an adapter that could not be loaded: they waited on the
        same load, and loading it again for each would fail again (or hammer storage)."""
        message = f"adapter {adapter_id} could not be loaded: {error}"
        for request in [r for r in self.waiting if r.adapter_id == adapter_id]:
            self._fail(request, message)

    def _index_after(self, request: Request) -> int:
        """Where in `waiting` the requests queued after `request` (which left the queue) now start."""
        return bisect.bisect_right(self.waiting, request.sort_key, key=lambda r: r.sort_key)

    def _prefetch_waiting_adapters(self) -> None:
        if self.adapter_slots is None:
            return
        wanted = list(dict.fromkeys(r.adapter_id for r in self.waiting if r.adapter_id is not None))
        wanted = wanted[:_MAX_PREFETCH_ADAPTERS]
        if wanted:
            self.adapter_slots.prefetch(wanted)

    def _drop_unwanted_load(self, adapter_id: str | None) -> None:
        """Once no waiting request needs an adapter, the cache forgets its load: nothing else would
        ever collect it, and a failure must not reach a request that arrives later."""
        if adapter_id is not None and all(r.adapter_id != adapter_id for r in self.waiting):
            self.adapter_slots.drop_load(adapter_id)

    def _fail(self, request: Request, error: str) -> None:
        """Finish a request with an error; the engine reports it after the step (`take_failed`)."""
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        request.error = error
        self.failed.append(request)

    def take_failed(self) -> list[Request]:
        failed, self.failed = self.failed, []
        return failed

    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Request]:
        """Advance scheduled requests past the step; returns those that got a new token.

        Requests that hit EOS, a stop token, max_tokens or max_model_len are finished and freed;
        those whose sampling failed are finished with an error (see `take_failed`).
        """
        updated = []
        for item in output.scheduled:
            request = item.request
            start = request.num_computed_tokens
            request.num_computed_tokens += item.num_tokens
            self.stats.num_prompt_tokens_computed += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - start)
            self.kv.cache_full_blocks(request)
            request.prompt_logprobs += runner_output.prompt_logprobs.get(request.request_id, [])
            sampled = runner_output.sampled.get(request.request_id)
            if sampled is None:
                continue
            if sampled.error is not None:
                self._fail(request, sampled.error)
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
            self._drop_unwanted_load(request.adapter_id)
        self._release(request)
        self.tenant_rounds.left(request)
        request.status = status
        return request

    def _release(self, request: Request) -> None:
        """Give back everything a running request holds: KV blocks and its adapter slot."""
        self.kv.free(request)
        if request.lora_slot >= 0:
            self.adapter_slots.release(request.adapter_id)
            request.lora_slot = -1

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.can_stop:
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV and the slot, keep the tokens, wait again."""
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
