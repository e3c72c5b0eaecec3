"""Admission: a tenant's rate limits and monthly budget, checked before any engine work.

The rate check pays the request's estimated tokens (prompt + max_tokens for every choice) into
the tenant's tpm bucket up front, and the call gives back what it did not use when it settles
(and pays what it used beyond them: an upstream may count the prompt as more tokens);
the budget holds the same estimate until the call settles with the tokens it really used
(streamed ones included, also when the client went away). A call refused after admission (the
budget, or the engine, said no) costs nothing. An adapter upload with a tenant's key uses no
tokens: it pays one request into rpm alone (charge_request), given back if it is refused.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TypeVar

from gateway.errors import ApiError
from store import UNAVAILABLE_ERRORS, RateDecision, Reservation, Store, StoreUnavailable, Tenant, refund_rate
from store.limits import SPEND_TOLERANCE_USD, budget_left

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


# A hold lapses this long after its last renewal, so the budget a gateway that died mid-call held
# comes back by then (a tenant near its budget waits out at most this after a crash); a live call
# renews its hold every third of it, however long it runs, which also rides out a store outage
# of up to two thirds of it.
HOLD_TTL_S = 60.0
_RENEWALS_PER_TTL = 3  # how often a live call renews its hold within its ttl (see above)
# The waits between tries of a settle the store could not take for a while (another process held
# SQLite's write lock past its wait, its volume was full, Redis was down or restarting), about a
# hold's TTL in all.
SETTLE_RETRY_WAITS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)


class Admission:
    """A call let in under its tenant's limits; `settle` once with the real counts."""

    def __init__(self, store: Store, tenant: Tenant, reservation: Reservation,
                 hold_ttl_s: float = HOLD_TTL_S):
        self._store = store
        self._tenant = tenant
        self._reservation = reservation
        self._renewal = asyncio.create_task(self._keep_held(hold_ttl_s))

    async def _keep_held(self, ttl_s: float) -> None:
        """Renew the hold until the call settles: a stream longer than the hold's ttl must not
        free its budget for other calls while it still generates."""
        while True:
            await asyncio.sleep(ttl_s / _RENEWALS_PER_TTL)
            try:
                if not await self._store.extend_hold(self._reservation, ttl_s=ttl_s):
                    return  # settled meanwhile, or lapsed (the store was unreachable for long)
            except Exception:  # the next try may reach the store
                logger.warning("could not renew the budget hold of tenant %s", self._reservation.tenant,
                               exc_info=True)

    async def settle(self, tokens_in: int, tokens_out: int, spend_usd: float,
                     on_billed: Callable[[], None] = lambda: None) -> None:
        """Bill the real counts, release the hold and leave the tpm bucket paid the tokens used:
        give it back those held for but not used, or pay those used beyond the hold. Runs as its
        own task, so a cancelled caller (a client that disconnected) still bills what was
        generated. Returns once billed, or once the store refused the first try: the tries after
        it (see _retried) go on in that task, and must not hold back an answer that is ready.
        `on_billed` runs once the store billed the tenant: not when it billed nothing, the
        tenant having been deleted meanwhile, nor when it could not be reached."""
        retrying = asyncio.Event()
        await self._finally(self._settle(tokens_in, tokens_out, spend_usd, on_billed, retrying),
                            retrying)

    async def withdraw(self, *, refund_requests: bool) -> None:
        """End a call that used nothing: drop its hold, billing and counting nothing, and give
        back the tokens it paid into tpm, and its request into rpm when `refund_requests` (it
        was refused with an error, not left by its client). Returns as `settle` does."""
        retrying = asyncio.Event()
        await self._finally(self._withdraw(refund_requests, retrying), retrying)

    async def _finally(self, ending: Coroutine[None, None, None], retrying: asyncio.Event) -> None:
        """Run `ending` in a task of its own, waiting for it to end or to start `retrying`."""
        task = _in_background(ending)
        # NOTE: the hold is renewed until the call is settled: one whose settle is retried while
        # the store is locked must not free its budget for other calls meanwhile.
        task.add_done_callback(lambda _: self._renewal.cancel())
        waiting = asyncio.ensure_future(retrying.wait())
        try:
            await asyncio.shield(asyncio.wait((task, waiting), return_when=asyncio.FIRST_COMPLETED))
        finally:
            waiting.cancel()

    async def _settle(self, tokens_in: int, tokens_out: int, spend_usd: float,
                      on_billed: Callable[[], None], retrying: asyncio.Event) -> None:
        reservation = self._reservation
        usage = (f"usage of tenant {reservation.tenant!r} for {reservation.month}: {tokens_in} "
                 f"prompt tokens, {tokens_out} output tokens, {spend_usd:.6f} USD")
        try:
            billed = await _retried(
                "settle a call", reservation.tenant, retrying, UNAVAILABLE_ERRORS,
                lambda: self._store.settle(reservation, tokens_in=tokens_in, tokens_out=tokens_out,
                                           spend_usd=spend_usd))
        except asyncio.CancelledError:  # a shutdown that could wait no longer (wait_for_settles)
            # NOTE: a write under way (on SQLite's worker thread) may still commit.
            logger.error("shut down before the store confirmed the settle of a call, which may not "
                         "be billed: %s", usage)
            raise
        except Exception:  # the hold lapses on its own; billing must not fail the response
            logger.exception("could not settle a call, which is not billed: %s", usage)
            return
        if billed:
            on_billed()
        unused = reservation.tokens - tokens_in - tokens_out  # below 0: used beyond
        if unused != 0:
            try:
                await _refund_retried(self._store, self._tenant, 0, unused, retrying)
            except Exception:  # the bucket refills on its own
                logger.exception("could not give tenant %s's tpm back %d tokens", reservation.tenant,
                                 unused)

    async def _withdraw(self, refund_requests: bool, retrying: asyncio.Event) -> None:
        try:
            await _retried("release the hold of a call", self._reservation.tenant, retrying,
                           UNAVAILABLE_ERRORS, lambda: self._store.release(self._reservation))
            await _refund_retried(self._store, self._tenant, int(refund_requests),
                                  self._reservation.tokens, retrying)
        except Exception:  # the hold lapses on its own, the buckets refill
            logger.exception("could not release the hold of tenant %s", self._reservation.tenant)


async def _retried(what: str, tenant: str, retrying: asyncio.Event,
                   retried_errors: tuple[type[Exception], ...],
                   write: Callable[[], Awaitable[_T]]) -> _T:
    """`write()`, tried again for about a minute (`retrying` set from the first failure) while it
    fails with one of `retried_errors`: a call that ended during another process's long write, or
    while Redis restarted, must still be billed, or given back what it held. StoreUnavailable
    wrote nothing (SQLite rolled it back); Redis's errors may have written it, so only writes that
    count once however often they are made (store.Store.settle, release) retry on those."""
    for wait_s in (*SETTLE_RETRY_WAITS_S, None):
        try:
            return await write()
        except retried_errors as error:
            if wait_s is None:
                raise
            logger.warning("could not %s of tenant %s (%s); trying again in %g s", what, tenant,
                           error, wait_s)
            retrying.set()
            await asyncio.sleep(wait_s)
    raise AssertionError("the last try raises")  # pragma: no cover


async def _refund_retried(store: Store, tenant: Tenant, requests: int, tokens: int,
                          retrying: asyncio.Event) -> None:
    await _retried("give back the rate limits a call paid", tenant.name, retrying, (StoreUnavailable,),
                   lambda: refund_rate(store, tenant, requests=requests, tokens=tokens))


def _refund_in_background(store: Store, tenant: Tenant, tokens: int) -> None:
    """Give back what a call that never ran paid into the rate limits, once the store takes
    writes again (in a task of its own: the call's 503 must not wait for that)."""
    async def refund() -> None:
        try:
            await _refund_retried(store, tenant, 1, tokens, asyncio.Event())
        except Exception:  # the buckets refill on their own
            logger.exception("could not give tenant %s back the rate limits of a call that did "
                             "not run", tenant.name)

    _in_background(refund())


_pending: set[asyncio.Task] = set()  # NOTE: keeps settle tasks alive until they finish


def _in_background(work: Coroutine[None, None, None]) -> asyncio.Task:
    """`work` in a task of its own, kept (in `_pending`) until it ends: a cancelled caller does
    not cancel it, and a shutdown waits for it (wait_for_settles)."""
    task = asyncio.create_task(work)
    _pending.add(task)
    task.add_done_callback(_pending.discard)
    return task


async def wait_for_settles(timeout_s: float) -> None:
    """Wait, at most `timeout_s`, for this event loop's calls still settling (each in a task of
    its own, which outlives a cancelled caller): the store must not close under them. Those still
    settling then (retrying while the store is locked) are cancelled, and log what they leave
    unbilled: the loop's end would cancel them without a word."""
    loop = asyncio.get_running_loop()
    settling = {task for task in _pending if task.get_loop() is loop}
    if not settling:
        return
    _, still_settling = await asyncio.wait(settling, timeout=timeout_s)
    for task in still_settling:
        task.cancel()
    if still_settling:
        await asyncio.wait(still_settling)


@dataclass(frozen=True)
class Estimate:
    """What a call's estimate counts, as the errors that refuse it say (and what to lower)."""

    # The field the call set its output's length with; None for a call that set neither
    # max_tokens nor min_tokens (its answers were fitted to the limits: refused, they were cut
    # to one token each, the least it can use).
    max_tokens_param: str | None = "max_tokens"
    route: str | None = None  # the route it runs on, which answers one choice of one prompt
    holds_every_tier: bool = False  # a cascade: it may run, and bill, each of its tiers
    # A call that set neither, fitted to its tenant's limits as read just before, not cut to its
    # least: the most output tokens an answer held (a call in flight took the room meanwhile).
    fitted_tokens: int | None = None
    n: int = 1  # choices per prompt: named in the advice only where lowering it helps
    num_prompts: int = 1

    def counted(self) -> str:
        if self.fitted_tokens is not None:
            output = (f"up to {self.fitted_tokens} output tokens (the room your limits had as "
                      "the call was read)")
        else:
            output = "one output token" if self.max_tokens_param is None else self.max_tokens_param
        if self.holds_every_tier:
            return f"prompt plus {output} on each tier of route {self.route!r}, which may run them all"
        return f"prompt plus {output} for every choice" + (
            ", the least it can use" if self.max_tokens_param is None and self.fitted_tokens is None
            else "")

    def advice(self) -> str:
        """What makes the estimate smaller ("lower max_tokens or n, or shorten the prompt")."""
        # NOTE: a fitted call held less than the rest of the context: a lower max_tokens holds less.
        param = self.max_tokens_param or ("max_tokens" if self.fitted_tokens is not None else None)
        lower = [name for name in (param, "n" if self.n > 1 else None) if name is not None]
        prompts = "shorten the prompt" if self.num_prompts == 1 else "send fewer or shorter prompts"
        advice = prompts if not lower else \
            f"lower {' or '.join(lower)}{',' * (len(lower) > 1)} or {prompts}"
        if self.route is not None:  # n is 1: a route answers one choice
            return f"{advice}, or call one model instead of route {self.route!r}"
        return advice


async def admit(store: Store, tenant: Tenant, estimated_tokens: int,
                estimated_spend_usd: float = 0.0, *, hold_ttl_s: float = HOLD_TTL_S,
                estimate: Estimate = Estimate()) -> Admission:
    """Charge the rate limits and hold the budgets for one call, or raise the ApiError to send
    (which says what `estimate` counts)."""
    budget, spend_budget = tenant.monthly_token_budget, tenant.monthly_spend_budget_usd
    if tenant.tpm is not None and estimated_tokens > tenant.tpm:
        raise _too_large(f"use {estimated_tokens} tokens", f"limit is {tenant.tpm} tokens per minute",
                         estimate)
    if budget is not None and estimated_tokens > budget:
        raise _too_large(f"use {estimated_tokens} tokens", f"monthly budget is {budget} tokens in all",
                         estimate)
    if spend_budget is not None and estimated_spend_usd > spend_budget + SPEND_TOLERANCE_USD:
        raise _too_large(f"cost {estimated_spend_usd:.6f} USD",
                         f"monthly budget is {spend_budget} USD in all", estimate)
    decision = await store.check_and_consume_rate(tenant, requests=1, tokens=estimated_tokens)
    if not decision.allowed:
        raise _rate_limited(tenant, decision)
    try:
        reservation = await store.reserve_tokens(tenant, estimated_tokens,
                                                 spend_usd=estimated_spend_usd, ttl_s=hold_ttl_s)
    except UNAVAILABLE_ERRORS:  # the call gets a 503, and never runs
        _refund_in_background(store, tenant, estimated_tokens)
        raise
    if reservation is None:
        await refund_rate(store, tenant, requests=1, tokens=estimated_tokens)
        raise await _over_budget(store, tenant, estimated_tokens, estimated_spend_usd, estimate)
    return Admission(store, tenant, reservation, hold_ttl_s)


async def charge_request(store: Store, tenant: Tenant) -> None:
    """Charge one call that uses no tokens (an adapter upload) to the tenant's rpm, or raise the
    429 an API call refused for rate gets. `refund_request` gives it back if the call is refused."""
    decision = await store.check_and_consume_rate(tenant, requests=1)
    if not decision.allowed:
        raise _rate_limited(tenant, decision)


async def refund_request(store: Store, tenant: Tenant) -> None:
    """Give back the request `charge_request` charged, for a call refused with an error: as for
    an admitted call refused, only one its client left counts against rpm."""
    try:
        await refund_rate(store, tenant, requests=1)
    except UNAVAILABLE_ERRORS:  # the refusal, not the store's state, is what the client must see
        logger.warning("could not give back the request of tenant %s to its rpm", tenant.name,
                       exc_info=True)


def _rate_limited(tenant: Tenant, decision: RateDecision) -> ApiError:
    """The 429 for a call its tenant's rpm or tpm refused, with the wait in Retry-After."""
    unit = "requests" if decision.limited_by == "rpm" else "tokens"
    limit = tenant.rpm if decision.limited_by == "rpm" else tenant.tpm
    wait = max(1, math.ceil(decision.retry_after))
    return ApiError(429, f"rate limit reached: {limit} {unit} per minute "
                    f"({decision.limited_by}); retry in {wait} s",
                    type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(wait)})


def _too_large(what_it_may_use: str, limit: str, estimate: Estimate) -> ApiError:
    """The 400 for a call that no wait would let through: larger than one of its tenant's limits."""
    return ApiError(400, f"this request may {what_it_may_use} ({estimate.counted()}) but your "
                    f"{limit}; {estimate.advice()}", param=estimate.max_tokens_param,
                    code="request_too_large")


async def _over_budget(store: Store, tenant: Tenant, estimated_tokens: int,
                       estimated_spend_usd: float, estimate: Estimate) -> ApiError:
    """The 429 for a call this month's budgets do not cover: what is left of them, and whether
    calls in flight hold enough of them that the call would fit once they finish (a retry then
    may pass; else none can, and the SDKs are told not to retry)."""
    usage = await store.get_usage(tenant.name)
    tokens_left, spend_left = budget_left(tenant, usage)
    left = []
    if tenant.monthly_token_budget is not None:
        left.append(f"{max(0, tokens_left)} of {tenant.monthly_token_budget} tokens left "
                    f"({usage.tokens_in + usage.tokens_out} used, {usage.reserved_tokens} held by "
                    "calls in flight)")
    if tenant.monthly_spend_budget_usd is not None:
        left.append(f"{max(0.0, spend_left):.6f} of {tenant.monthly_spend_budget_usd} USD left "
                    f"({usage.spend_usd:.6f} spent, {usage.reserved_spend_usd:.6f} held by calls "
                    "in flight)")
    is_held = usage.reserved_tokens > 0 or usage.reserved_spend_usd > 0
    # NOTE: what the holds give back is at most all of them (a call bills no more than it holds).
    may_pass_later = is_held and (
        tokens_left + usage.reserved_tokens >= estimated_tokens
        and spend_left + usage.reserved_spend_usd + SPEND_TOLERANCE_USD >= estimated_spend_usd)
    return ApiError(
        429, f"tenant {tenant.name!r} has {' and '.join(left)} of its monthly budget; this request "
        f"may use {estimated_tokens} tokens / {estimated_spend_usd:.6f} USD ({estimate.counted()}): "
        f"{estimate.advice()}"
        + (", retry once the calls in flight finish" if may_pass_later else "")
        + ", or ask your administrator to raise the budget",
        type="insufficient_quota", code="insufficient_quota",
        headers={"x-should-retry": "true" if may_pass_later else "false"})
