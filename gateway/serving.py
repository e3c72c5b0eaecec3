"""The path both generation endpoints share: auth, body, model, admission, engine requests, billing.

`start_call` takes a request from its HTTP body to running engine requests; the endpoint then
formats what they produce and calls `Call.finish` exactly once, however the call ended.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission import Admission, Estimate, admit
from gateway.auth import authenticate_tenant
from gateway.cascade import Attempt, run_cascade, run_with_fallback
from gateway.engine_client import (AdapterCannotRun, AdapterDeleted, AdapterRef, CannotServe, EngineClient,
                                   EngineFailure, EngineUnavailable, RequestRejected, SamplingOptions)
from gateway.errors import (ApiError, client_closed, engine_failed, from_validation_error,
                           invalid_request, model_not_found, quoted, refused_when_out_of_space,
                           server_shutdown, too_deep_message, unavailable_until_mended)
from gateway.generation import Ask, Generation, Prompt, Reading, Tier
from gateway.protocol import PromptTokensDetails, SamplingFields, Usage
from gateway.sse import DONE, EventStreamResponse, event
from gateway.state import GatewayState, gateway_state
from gateway.uploads import ADAPTER_FOLDER
from routing.models import ModelNotAllowed, ModelNotFound, resolve_model
from routing.routes import CascadeRoute, LearnedRoute, Route
from store import AdapterRecord, StoreError, Tenant
from store.blobs import ensure_intact_copy, fetch_blob
from store.limits import budget_left

T = TypeVar("T")


# The largest JSON body read (2048 prompts of 4096 token ids fit): a larger one is a 413 before it
# is held in memory, where a few gigabytes would take the gateway down for every tenant.
MAX_BODY_BYTES = 64 << 20
# The most arrays and objects a JSON body may hold, counted as its '[' and '{' characters (those in
# its strings too: telling them apart would cost as much as decoding). Decoding makes a Python
# object of each, holding the GIL, so the event loop that every tenant shares (a thread would not
# help): a body of millions of one-element lists would take seconds and gigabytes to decode before
# its fields could be refused, where this bound keeps any body near the cost of the largest
# legitimate one (calls need a few thousand: 2048 prompts, 2048 messages).
MAX_BODY_CONTAINERS = 2**20


async def authenticated_body(request: Request, body_type: type[T]) -> tuple[Tenant, T]:
    """The calling tenant, and the request's JSON body as `body_type`. The key is checked before
    the body is read (a stranger's body is never read), and again once it is in: a key revoked,
    or a tenant deleted or changed, while a slow body arrived must not be served as it was
    before (a client could hold connections open to outlive a revocation)."""
    state = gateway_state(request)
    await authenticate_tenant(request, state.require_store(), state.metrics_key_hash)
    body = await decode_body(request, body_type)
    return await authenticate_tenant(request, state.require_store(), state.metrics_key_hash), body


async def decode_body(request: Request, body_type: type[T]) -> T:
    """The JSON body as `body_type`; a 400 naming the field when it does not fit."""
    try:
        body = await _read_body(request)
        _refuse_too_many_containers(body)
        return msgspec.json.decode(body, type=body_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise from_validation_error(error) from None
    except UnicodeDecodeError as error:  # msgspec's own, for a string that is not UTF-8
        raise invalid_request(f"the request body is not valid UTF-8 ({error}); send JSON encoded "
                              "as UTF-8") from None
    except RecursionError:  # msgspec's, for arrays and objects nested past Python's depth limit
        raise invalid_request(too_deep_message("the request body")) from None


async def _read_body(request: Request) -> bytes:
    """The request's body; a 413 as soon as it is known to pass MAX_BODY_BYTES."""
    too_large = ApiError(413, f"the request body is larger than this server accepts "
                         f"({MAX_BODY_BYTES} bytes); split the prompts over several calls",
                         code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_too_many_containers(body: bytes) -> None:
    """400 for a body with more than MAX_BODY_CONTAINERS arrays and objects, before it is decoded,
    naming the top-level field that holds the most of them."""
    if len(body) <= MAX_BODY_CONTAINERS or (num := _num_containers(body)) <= MAX_BODY_CONTAINERS:
        return
    # NOTE: cheap: msgspec skips a Raw value without building it. A body of more '[' and '{' than
    # the object's own is not empty.
    fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    counts = {name: _num_containers(value) for name, value in fields.items()}
    param = max(counts, key=counts.__getitem__)
    raise invalid_request(
        f"the request body holds {num} '[' and '{{' characters (arrays, objects, "
        f"and those characters in strings), {counts[param]} of them in '{param}'; a body holds at "
        f"most {MAX_BODY_CONTAINERS}: send fewer prompts or messages per call", param=param)


def _num_containers(data: bytes | msgspec.Raw) -> int:
    data = bytes(data)  # NOTE: no copy of a body, which is bytes already
    return data.count(b"[") + data.count(b"{")


def refuse_unsupported(body: SamplingFields, target: Target) -> None:
    """400 for a known OpenAI field set to something this server cannot honour, and for fields
    that name token ids (stop_token_ids, logit_bias) on a route whose models read text with
    different tokenizers: there an id means a different token to each model."""
    if (unsupported := body.unsupported_field()) is not None:
        raise invalid_request(unsupported[1], param=unsupported[0], code="unsupported_parameter")
    if (conflict := body.conflict()) is not None:
        raise invalid_request(conflict[1], param=conflict[0])
    for name in ("stop_token_ids", "logit_bias"):
        if getattr(body, name):
            refuse_token_ids(target, name, "leave it out")


def refuse_token_ids(target: Target, param: str, remedy: str) -> None:
    """400 for token ids in `param` when `target` is a route whose models read text with different
    tokenizers: there an id means a different token to each model."""
    if not target.shares_tokenizer:
        raise invalid_request(
            f"the models of route {target.route.name!r} read text with different tokenizers, so "
            f"the token ids in '{param}' cannot mean the same to all of them; {remedy}, or name one "
            f"of its models ({', '.join(t.model for t in target.tiers)}) instead of the route",
            param=param)


@dataclass(frozen=True)
class Target:
    """Where a call runs: a base model (maybe with an adapter), or a route over several tiers
    (each reads the prompt with its own tokenizer)."""

    tiers: tuple[Tier, ...]  # of a route: those whose model this server serves now, in order
    route: Route | None = None
    steps: tuple[int, ...] | None = None  # each tier's index in the route's tiers (None: 0, 1, ...)

    def step(self, index: int) -> int:
        """The index in its route's tiers of `self.tiers[index]`."""
        return index if self.steps is None else self.steps[index]

    @property
    def shares_tokenizer(self) -> bool:
        """Whether every tier reads text as the same token ids (so token ids mean one thing)."""
        return len({t.engine.tokenizer_key for t in self.tiers}) == 1


async def resolve_target(request: Request, tenant: Tenant, model: str) -> Target:
    """What `model` names for this tenant: 404 for nothing it knows, 403 for what its policy
    excludes. A name that resolves labels the call, even if it is then refused: its access log
    line with the name, its metrics with the served model or route it names (an adapter's base
    model), which the operator controls, where each adapter name a tenant uploads would add
    series never freed. A client's names that mean nothing label nothing."""
    state = gateway_state(request)
    try:
        target = await resolve_model(state.require_store(), tenant, state.catalog, model)
    except ModelNotFound as error:
        raise model_not_found(model, error.why) from None
    except ModelNotAllowed as error:
        request.state.model, request.state.model_label = model, error.served
        where = ("GET /v1/models lists the models and routes you can use" if error.instead is None
                 else f"your policy allows the adapter through a route: call it as "
                      f"{quoted(error.instead)}")
        raise ApiError(403, f"your tenant's policy does not allow the model {quoted(model)}; "
                       f"{where}", param="model", type="permission_error",
                       code="model_not_allowed") from None
    request.state.model = model
    request.state.model_label = target.route.name if target.route is not None else target.base_model
    if target.route is None and target.base_model not in state.engines:
        # An adapter of a base model this server no longer serves.
        served = (f"it serves {', '.join(state.engines)}" if state.engines
                  else "it serves no base model now")
        raise ApiError(404, f"{quoted(model)} is an adapter for the base model "
                       f"{target.base_model!r}, which this server does not serve now ({served}): "
                       "the operator can serve it again, or you can upload the adapter again for a "
                       "base model it serves", param="model", code="model_not_found")
    models = target.route.tiers if target.route is not None else (target.base_model,)
    # NOTE: only with engine workers (other routes are checked at startup), a route's tier may
    # name a model not served now: its workers are not up yet, or stopped heartbeating long
    # enough ago that the pool dropped it. The route leaves that tier out, as it does one whose
    # workers are all down (_leave_out_unavailable).
    steps = [step for step, m in enumerate(models) if m in state.engines]
    if not steps:
        raise engine_failed(EngineUnavailable(f"no engine worker serves {', '.join(models)} now"))
    adapter = None
    if target.adapter is not None and target.adapter.base_model in state.engines:
        adapter = await _adapter_tier(state, target.adapter)
    tiers = tuple(adapter if adapter is not None and adapter.model == models[step]
                  else Tier(models[step], state.engines[models[step]]) for step in steps)
    return Target(tiers, target.route, tuple(steps))


async def _adapter_tier(state: GatewayState, adapter: AdapterRecord) -> Tier:
    """The adapter's base model, run with this gateway's copy of its files."""
    engine = state.engines[adapter.base_model]
    if adapter.rank > engine.max_adapter_rank:
        raise _adapter_not_served(adapter, engine)
    folder = await adapter_folder(state, adapter)
    return Tier(adapter.base_model, engine, AdapterRef(adapter.digest, str(folder), adapter.rank),
                functools.partial(_ensure_intact_adapter, state, adapter))


async def _ensure_intact_adapter(state: GatewayState, adapter: AdapterRecord) -> bool:
    """Tier.ensure_intact_adapter: whether this gateway holds an intact copy of the adapter's
    files now (see ensure_intact_copy); AdapterDeleted if they are gone because no adapter uses
    them any more: the adapter was deleted while its call waited for the engine to read them."""
    store = state.require_store()
    if await ensure_intact_copy(state.blobs, store.shared_blobs, adapter.digest):
        return True
    if await _was_deleted(state, adapter):
        raise _deleted_meanwhile(adapter, "waited to run")
    return False


async def _was_deleted(state: GatewayState, adapter: AdapterRecord) -> bool:
    """Whether the adapter's files are missing here because no adapter uses them any more: the
    adapter was deleted since its record was read. False when the store cannot tell."""
    if state.blobs.path(adapter.digest) is not None:
        return False
    try:
        return not await state.require_store().is_digest_referenced(adapter.digest)
    except StoreError:
        return False


def _deleted_meanwhile(adapter: AdapterRecord, doing: str) -> AdapterDeleted:
    return AdapterDeleted(f"the adapter {quoted(adapter.name)} was deleted while this call {doing}; "
                          "GET /v1/models lists the models you can use")


def _adapter_not_served(adapter: AdapterRecord, engine: EngineClient) -> ApiError:
    """503 for an adapter whose base model is served here (since a restart) with a lower
    --max-lora-rank than its rank, without adapter slots, or by an upstream: it can never run
    until the operator changes that. Refused before anything is read or admitted, and without
    Retry-After, as retrying cannot help (where it can, with engine workers, their 503 has one)."""
    model = adapter.base_model
    if engine.supports_adapters:
        why = (f"{model!r} is served here with --max-lora-rank {engine.max_adapter_rank:.0f}, so "
               f"it cannot run: the operator must restart the server with --max-lora-rank "
               f"{adapter.rank} or more")
    else:
        why = f"{model!r} {engine.why_no_adapters}"
    return unavailable_until_mended(f"adapter {adapter.name!r} has rank {adapter.rank}, but {why}",
                                    code="engine_unavailable")


async def adapter_folder(state: GatewayState, adapter: AdapterRecord) -> Path:
    """The folder of the adapter's files in this gateway's blob folder, fetched there from the
    store's shared copy if need be (once, however many requests wait for it); 503 when neither
    holds them, the shared copy is damaged, or the folder has no room left to copy it into; 404
    when they are gone because the adapter was deleted meanwhile (through another gateway, say)."""
    # NOTE: no store round trip when the files are here, as they are after the first request.
    folder = state.blobs.path(adapter.digest)
    shared = state.require_store().shared_blobs
    damage = None
    if folder is None and shared is not None:
        try:
            # The request holding it may have fetched the files meanwhile.
            async with state.blobs.locks.hold(adapter.digest):
                with refused_when_out_of_space(f"copy the files of adapter {adapter.name!r} from "
                                               "the store", ADAPTER_FOLDER, state.blobs.root):
                    folder = (state.blobs.path(adapter.digest)
                              or await fetch_blob(state.blobs, shared, adapter.digest))
        except StoreError as error:
            damage = error
    if folder is not None:
        return folder
    if await _was_deleted(state, adapter):
        raise engine_failed(_deleted_meanwhile(adapter, "fetched its files"))
    if damage is not None:
        raise unavailable_until_mended(
            f"the files of adapter {adapter.name!r} are damaged in the store and were not "
            f"used ({damage}); upload the adapter again", code="adapter_files_damaged")
    where = "this server's adapter folder" + (" and the store" if shared is not None else "")
    raise unavailable_until_mended(f"the files of adapter {adapter.name!r} are missing from "
                                   f"{where}; upload the adapter again",
                                   code="adapter_files_missing")


def sampling_options(body: SamplingFields, logprobs: int | None) -> SamplingOptions:
    """SamplingOptions from the fields both endpoints share (max_tokens aside, which each tier
    sets: see Ask); None means the engine's default."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    fields = dict(logprobs=logprobs, stop=tuple(stop),
                  stop_token_ids=tuple(body.stop_token_ids or ()),
                  logit_bias=_logit_bias(body.logit_bias or {}))
    for name in ("temperature", "top_p", "top_k", "seed", "min_tokens", "ignore_eos",
                 "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "include_stop_str_in_output"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    return SamplingOptions(**fields)


def _logit_bias(biases: dict[str, float]) -> dict[int, float]:
    """logit_bias with its keys read as token ids; 400 for a key that is not one."""
    by_id = {}
    for token, bias in biases.items():
        if not (token.isascii() and token.isdigit() and len(token) <= 18):  # 18 digits fit int64
            raise invalid_request(f"logit_bias keys must be token ids (integers as strings), got "
                                  f"{quoted(token)}", param="logit_bias")
        by_id[int(token)] = bias
    return by_id


def token_namer(engine: EngineClient, as_ids: bool | None) -> Callable[[int], str]:
    """How logprobs name tokens: their text, or "token_id:<id>" when the client asked for ids."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else engine.token_text


@dataclass
class Call:
    """One API call in flight: its engine requests, and what to bill when it ends."""

    request: Request
    id: str
    created: int
    model: str  # what responses name: the requested model, or for a route the tier that answered
    answered_by: str  # the base model that answers, whose price applies
    # Its engine: its tokens are the ones logprobs name. NOTE: held, not looked up by name when
    # the answer is encoded: with engine workers the model may no longer be served by then.
    engine: EngineClient
    tenant: Tenant
    target: Target
    generation: Generation
    admission: Admission
    state: GatewayState
    attempts: list[Attempt] = field(default_factory=list)  # a route's tiers, in the order run
    # A cascade passed over a tier it ran; a learned route's strong model answers.
    escalated: bool = False
    # Every choice's answer began (the first chunks came): until then no tier has answered it.
    began: bool = False
    is_finished: bool = False

    def usage(self) -> Usage:
        g = self.generation
        return Usage(g.num_prompt_tokens, g.num_output_tokens,
                     g.num_prompt_tokens + g.num_output_tokens,
                     PromptTokensDetails(g.num_cached_tokens), self.cost_usd())

    def uses(self) -> list[_Use]:
        """The tokens of every tier escalated past, then the answer's, each at its price."""
        g = self.generation
        answer = _Use(self.answered_by, g.num_prompt_tokens, g.num_output_tokens,
                      self.state.price_of(self.answered_by).cost(g.num_prompt_tokens,
                                                                 g.num_output_tokens))
        return [*_uses_of(self.state, self.attempts), answer]

    def cost_usd(self) -> float:
        return sum(use.cost_usd for use in self.uses())

    def headers(self) -> dict[str, str]:
        """What the gateway did, for the response headers (the cost only once it is known)."""
        headers = {"x-switchboard-model": self.answered_by}
        route = self.target.route
        if route is not None:
            headers.update({"x-switchboard-route": route.name,
                            "x-switchboard-escalated": "true" if self.escalated else "false"})
            judged = [a for a in self.attempts if a.threshold is not None]
            if judged:  # none where the tiers judged were left out, or the call scores its prompt
                headers.update({
                    "x-switchboard-score": ",".join(_number(a.score) for a in judged),
                    "x-switchboard-threshold": ",".join(_number(a.threshold) for a in judged),
                })
        if self.generation.is_done:
            headers["x-switchboard-cost-usd"] = _number(self.cost_usd())  # as usage.cost_usd
        return headers

    async def run_to_end(self) -> bool:
        """Wait until every engine request finished; a 500 if the engine failed."""
        try:
            async for _ in self.generation:
                pass
        except EngineFailure as error:
            raise engine_failed(error) from None
        return True

    async def finish(self, *, refused: bool = False, rejected: bool = False) -> None:
        """Stop what still runs, then count and bill the tokens really used (once). `refused`:
        the call ends with an error before its answer began (see `_bill`); `rejected`: with a
        400, as the engine refused one of its requests, so the tokens the others produced
        meanwhile (the answer's) are not billed either: the client gets none of them."""
        if self.is_finished:
            return
        self.is_finished = True
        self.generation.close()
        route = self.target.route
        if route is not None and self.began:
            self.state.metrics.count_route(route.name, self.answered_by, self.escalated,
                                           [a.model for a in self.attempts])
        elif route is not None:  # no tier answered: those that ran still count
            self.state.metrics.count_tier_calls(route.name, [a.model for a in self.attempts])
        uses = _uses_of(self.state, self.attempts) if rejected else self.uses()
        await _bill(self.request, self.admission, self.tenant.name, uses,
                    refused=refused or rejected)


def _number(value: float | None) -> str:
    # Every digit (the shortest text that reads back as the same float): a learned route that sends
    # nothing strong sets its threshold one float step above the top score, which six digits
    # showed as equal to it; a cheap model's call costs less than eight decimals show.
    return "none" if value is None else repr(float(value))


class _Use(NamedTuple):
    """Tokens one model used for a call, and what they cost at its price."""

    model: str  # the base model that used them: their metrics' label, and the price that applies
    tokens_in: int
    tokens_out: int
    cost_usd: float


def _uses_of(state: GatewayState, attempts: list[Attempt]) -> list[_Use]:
    """What a route's attempts used (the answering tier's tokens are its Generation's), each at
    its own tier's price."""
    return [_Use(a.model, a.tokens_in, a.tokens_out,
                 state.price_of(a.model).cost(a.tokens_in, a.tokens_out)) for a in attempts]


async def _bill(request: Request, admission: Admission, tenant: str, uses: list[_Use], *,
                refused: bool = False) -> None:
    """Charge the sum of a call's tokens and spend to its tenant, and count them under the models
    that used them once the store billed them: the one place a call is billed. A call that used
    no tokens is neither billed nor counted as a request, and, when `refused` (it got an error:
    the engine refused it or failed before starting it), does not count against rpm either, as
    the gateway's own 400s do not."""
    if not any(use.tokens_in or use.tokens_out for use in uses):
        await admission.withdraw(refund_requests=refused)
        return
    metrics = gateway_state(request).metrics

    def count() -> None:  # NOTE: not for a tenant deleted meanwhile: its call billed no one
        for use in uses:
            metrics.count_tokens(tenant, use.model, use.tokens_in, use.tokens_out)
            metrics.spend.inc(use.cost_usd, tenant=tenant, model=use.model)

    tokens_in, tokens_out = sum(u.tokens_in for u in uses), sum(u.tokens_out for u in uses)
    request.state.prompt_tokens = tokens_in
    request.state.completion_tokens = tokens_out
    await admission.settle(tokens_in, tokens_out, sum(u.cost_usd for u in uses), on_billed=count)


async def start_call(request: Request, id_prefix: str, tenant: Tenant, model: str,
                     target: Target, ask: Ask, n: int, *, streamed: bool = False,
                     prompt_text: str | None = None) -> Call:
    """Admit the call and start `n` engine requests per prompt (a route picks its tier first);
    returns once each produced its first token, so a request the engine refuses still gets a 400,
    not a broken stream. `prompt_text` is what a learned route reads (default: _router_text)."""
    state = gateway_state(request)
    if target.route is not None and (n != 1 or len(ask.prompts) != 1):
        raise invalid_request(f"routes answer one prompt with one choice; send n = 1 and a single "
                              f"prompt, or name a model instead of {target.route.name!r}",
                              param="n" if n != 1 else ask.prompt_param)
    try:
        # NOTE: in a thread: tokenizing a long prompt takes seconds, which the event loop must not
        # wait out (the tokenizer releases the GIL); later reads find the tokens cached.
        readings = await asyncio.to_thread(_read_tiers, ask, target.tiers)
        for tier, reading in zip(target.tiers, readings):  # before admission: refused, it costs nothing
            if reading is not None:
                ask.check_logprobs(tier, reading, n)
    except RequestRejected as error:
        raise invalid_request(str(error), param=ask.param_of(error) or ask.prompt_param) from None
    readings = await _leave_out_unavailable(target, readings)
    if ask.max_tokens is None:
        limits = await _call_limits(state, tenant)
        if limits is not None:
            ask, readings = _fit_to_limits(state, target, ask, readings, n, *limits)
    route = target.route
    estimate = Estimate(ask.length_param(), None if route is None else route.name,
                        holds_every_tier=isinstance(route, CascadeRoute)
                        and sum(reading is not None for reading in readings) > 1,
                        fitted_tokens=_fitted_tokens(ask, readings), n=n,
                        num_prompts=len(ask.prompts))
    admission = await admit(state.require_store(), tenant, *_hold(state, target, readings, n),
                            estimate=estimate)
    call_id = f"{id_prefix}-{uuid.uuid4().hex}"
    attempts: list[Attempt] = []
    try:
        if isinstance(target.route, CascadeRoute):
            steps = [(target.step(i), tier) for i, (tier, reading)
                     in enumerate(zip(target.tiers, readings)) if reading is not None]
            outcome = await run_cascade(
                target.route, steps, ask, attempts, streamed=streamed,
                request_id=call_id, tenant=tenant.incarnation,
                guard=functools.partial(_unless_disconnected, request))
            tier = outcome.tier
            streams, prompt_indices, same_prompt_as = [outcome.stream], [0], None
            # Another tier ran: passed over, or failed. One left out, as it cannot serve the
            # call or its engine is unavailable, was not: the call went straight to the tier
            # that answers.
            escalated = any(a.model != tier.model for a in attempts)
        elif isinstance(target.route, LearnedRoute):
            serving = [t for t, reading in zip(target.tiers, readings) if reading is not None]
            text = prompt_text if prompt_text is not None else _router_text(ask.prompts[0],
                                                                             serving[0].engine)
            # NOTE: off the event loop: scoring reads every n-gram of the prompt, about 1 s for
            # a long context's, which would stall every other call.
            score = await asyncio.to_thread(target.route.router.score, text)
            decision = state.learned.decide(target.route, tenant, score)
            by_step = {target.step(i): tier for i, tier in enumerate(target.tiers)}
            picked, other = by_step.get(decision.tier), by_step.get(1 - decision.tier)
            # The other tier answers if the picked one cannot serve the call (left out, it is
            # not the tier judged: the call has no score), or fails before its first token.
            # NOTE: not after, even for a whole answer: the call holds one tier's tokens (_hold).
            judged = (decision.score, decision.threshold) if picked in serving else (None, None)
            outcome = await run_with_fallback(
                [t for t in (picked, other) if t in serving], ask, attempts, score=judged[0],
                threshold=judged[1], request_id=call_id, tenant=tenant.incarnation,
                guard=functools.partial(_unless_disconnected, request))
            tier = outcome.tier
            streams, prompt_indices, same_prompt_as = [outcome.stream], [0], None
            escalated = tier.model != target.route.tiers[0]  # the strong model answers
        else:
            tier = target.tiers[0]
            streams, prompt_indices, same_prompt_as = _engine_streams(tier, ask, n, call_id,
                                                                      tenant.incarnation)
            escalated = False
    except BaseException as error:  # only a route's tiers have used tokens yet; bill those
        if target.route is not None:
            state.metrics.count_tier_calls(target.route.name, [a.model for a in attempts])
        # An EngineFailure is a refusal (its adapter cannot run), as for a call to the adapter;
        # so is the shutdown's deadline (see below: its client is told to send the call again).
        await _bill(request, admission, tenant.name, _uses_of(state, attempts),
                    refused=isinstance(error, (EngineFailure, asyncio.CancelledError)))
        if isinstance(error, EngineFailure):  # the call's adapter cannot run (see cascade.py)
            raise engine_failed(error) from None
        raise
    answered_by = tier.model
    if target.route is not None:
        model = answered_by  # a route's replies name the model that answered
    arrived_at = getattr(request.state, "arrived_at", time.monotonic())
    generation = Generation(streams, prompt_indices, state.metrics.latency(answered_by), arrived_at,
                            same_prompt_as, prompt_per_choice=_bills_prompt_per_choice(tier.engine))
    call = Call(request, call_id, int(time.time()), model, answered_by, tier.engine, tenant, target,
                generation, admission, state, attempts, escalated)
    try:
        # A client that leaves while its requests wait for a batch slot or prefill takes them
        # back: they never run, nor are billed.
        await _unless_disconnected(request, generation.start())
        call.began = True
    except RequestRejected as error:
        await call.finish(rejected=True)
        raise invalid_request(str(error), param=ask.param_of(error)) from None
    except EngineFailure as error:
        await call.finish(refused=True)
        raise engine_failed(error) from None
    except asyncio.CancelledError:
        # NOTE: only a shutdown's deadline cancels a call (a client leaving is a 499 here): it
        # tells the client to send the call again, so one that used nothing is refused, and
        # gives its request back to rpm, as when a stopping worker refuses it.
        await call.finish(refused=True)
        raise
    except BaseException:
        await call.finish()
        raise
    return call


def _router_text(prompt: Prompt, engine: EngineClient) -> str:
    """What a learned route reads of a prompt: its text as sent, or the text of its ids without
    special tokens (routers are trained on prompts' text, which has no "<s>")."""
    if prompt.token_ids is None:
        return prompt.render(engine)[0]
    return engine.detokenize(prompt.token_ids, skip_special_tokens=True)


async def _leave_out_unavailable(target: Target, readings: list[list[Reading] | None]
                                 ) -> list[list[Reading] | None]:
    """`readings` with None, as for a tier that cannot serve the call, for each tier whose
    engine could not take it now (no engine worker of its model is up): a route runs the call
    on its other tiers, rather than run and bill tiers before one that could only fail it. A 503
    before admission when no tier that can serve the call is available, which then costs its
    tenant nothing, rate limit included."""
    refusal = None
    available: list[list[Reading] | None] = []
    for tier, reading in zip(target.tiers, readings):
        if reading is not None:
            try:
                await tier.engine.ensure_available(tier.adapter)
            except AdapterCannotRun as error:
                # NOTE: the call asked for the adapter: no other tier answers in its place, and
                # tiers run and billed before it were a 503 all the same.
                raise engine_failed(error) from None
            except EngineUnavailable as error:
                refusal, reading = refusal or error, None
        available.append(reading)
    if all(reading is None for reading in available):
        raise engine_failed(refusal)  # NOTE: set: some tier can serve the call (_read_tiers)
    return available


def _read_tiers(ask: Ask, tiers: tuple[Tier, ...]) -> list[list[Reading] | None]:
    """Each tier's reading of the call (Ask.read), None for a tier that cannot serve it (a route
    runs the call on its other tiers). Raises RequestRejected if a tier cannot read the prompts,
    and the roomiest tier's CannotServe if no tier can serve the call."""
    readings: list[list[Reading] | None] = []
    refusals: list[tuple[int, CannotServe]] = []
    for tier in tiers:
        try:
            readings.append(ask.read(tier))
        except CannotServe as error:
            readings.append(None)
            refusals.append((tier.engine.max_model_len, error))
    if refusals and all(reading is None for reading in readings):
        # The roomiest tier's refusal: the call must shrink to fit that one, or leave out what
        # it does not serve.
        raise max(refusals, key=lambda entry: entry[0])[1]
    return readings


def _hold(state: GatewayState, target: Target, readings: list[list[Reading] | None],
          n: int) -> tuple[int, float]:
    """The tokens and spend to hold before a call runs: the most its tiers may use, each in its
    own tokens and at its own price.

    A tier that cannot serve the call (its reading None) never runs it, so it holds nothing. A
    cascade may run, and bill, every other tier: it holds their sum. A model, or a learned
    route, runs one tier: the dearest one's.
    """
    holds = []
    for tier, reading in zip(target.tiers, readings):
        if reading is not None:
            tokens = _estimate(tier.engine, reading, n)
            holds.append((sum(tokens), state.price_of(tier.model).cost(*tokens)))
    tokens, spend = zip(*holds)
    if isinstance(target.route, CascadeRoute):
        return sum(tokens), sum(spend)
    return max(tokens), max(spend)


async def _call_limits(state: GatewayState, tenant: Tenant) -> tuple[float, float] | None:
    """The most tokens and spend one call of `tenant` may hold now: what its tpm allows, and what
    its monthly budgets have left (a snapshot: admission decides). None when it has no limits."""
    tokens, spend = math.inf, math.inf
    if tenant.monthly_token_budget is not None or tenant.monthly_spend_budget_usd is not None:
        tokens, spend = budget_left(tenant, await state.require_store().get_usage(tenant.name))
    if tenant.tpm is not None:
        tokens = min(tokens, tenant.tpm)
    return None if tokens == spend == math.inf else (tokens, spend)


def _fit_to_limits(state: GatewayState, target: Target, ask: Ask,
                   readings: list[list[Reading] | None], n: int, tokens: float, spend_usd: float
                   ) -> tuple[Ask, list[list[Reading] | None]]:
    """A call that left max_tokens out, with its answers shortened so that what it holds fits
    `tokens` and `spend_usd` (the tenant's tpm and what its monthly budgets have left; they end
    with finish_reason "length"), rather than refused for holding the rest of the context.
    Unchanged when it fits already; when it cannot fit at all, the least call (one token per
    answer, or min_tokens), so that admission says what the tenant lacks (its budget is used up),
    rather than that the rest of the context is more than it may ever hold. Never shortened below
    min_tokens: the engine would refuse that for a max_tokens the call did not send."""
    def capped(cap: int) -> list[list[Reading] | None]:
        return [None if reading is None else
                [(p, msgspec.structs.replace(o, max_tokens=min(o.max_tokens, cap))) for p, o in reading]
                for reading in readings]

    def fits(cap: int) -> bool:
        held_tokens, held_spend = _hold(state, target, capped(cap), n)
        return held_tokens <= tokens and held_spend <= spend_usd

    longest = _longest_answer(readings)
    least = min(longest, _least_answer(ask))
    if fits(longest):
        return ask, readings
    if not fits(least):
        return dataclasses.replace(ask, implicit_max_tokens=least), capped(least)
    low, high = least, longest  # fits(low) and not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return dataclasses.replace(ask, implicit_max_tokens=low), capped(low)


def _fitted_tokens(ask: Ask, readings: list[list[Reading] | None]) -> int | None:
    """For a call that left max_tokens out, the most output tokens an answer holds, unless that
    is its least (one token, or min_tokens): what admission's refusal says it counted."""
    if ask.max_tokens is not None:
        return None
    longest = _longest_answer(readings)
    return longest if longest > _least_answer(ask) else None


def _longest_answer(readings: list[list[Reading] | None]) -> int:
    """The most output tokens an answer of the call may have, on any tier that serves it."""
    return max(o.max_tokens for reading in readings if reading for _, o in reading)


def _least_answer(ask: Ask) -> int:
    """The fewest output tokens an answer of a call that left max_tokens out is cut to: one, or
    its min_tokens."""
    return max(1, ask.options.min_tokens)


def _estimate(engine: EngineClient, reading: list[Reading], n: int) -> tuple[int, int]:
    """The most prompt tokens one tier's reading of a call may be billed, and the most its
    answers may use."""
    num_prompts = n if _bills_prompt_per_choice(engine) else 1
    return (num_prompts * sum(engine.max_prompt_tokens(p) for p, _ in reading),
            n * sum(o.max_tokens for _, o in reading))


def _bills_prompt_per_choice(engine: EngineClient) -> bool:
    """Whether each choice of a call uses its prompt anew: an upstream's (whose tokens are the
    text's bytes) gets a request per choice and bills each the prompt; an engine here computes
    a prompt once for all its choices, which share its KV blocks."""
    return engine.counts_text_bytes


def _engine_streams(tier: Tier, ask: Ask, n: int, call_id: str, tenant: str):
    """`n` engine requests per prompt on one tier, the prompt each choice answers, and for each
    prompt the first one with the same tokens (Generation's `same_prompt_as`)."""
    readings = ask.read(tier)
    first_with_tokens: dict[tuple[int, ...], int] = {}
    same_prompt_as = [first_with_tokens.setdefault(tuple(prompt), p)
                      for p, (prompt, _) in enumerate(readings)]
    streams, prompt_indices = [], []
    for p, (prompt, options) in enumerate(readings):
        for j in range(n):
            # Seeded choices differ from each other but stay reproducible (vLLM does the same).
            seed = None if options.seed is None else _wrap_int64(options.seed + j)
            # The prompt's logprobs are the same for every choice: the first one scores it
            # (Generation.prompt_logprobs), and the others may start from cached prefix blocks.
            prompt_logprobs = options.prompt_logprobs if j == 0 else None
            streams.append(ask.generate(tier, prompt, msgspec.structs.replace(
                options, seed=seed, prompt_logprobs=prompt_logprobs),
                request_id=f"{call_id}-{len(streams)}", tenant=tenant))
            prompt_indices.append(p)
    return streams, prompt_indices, same_prompt_as


def _wrap_int64(value: int) -> int:
    """`value` wrapped into a signed 64-bit integer (what a seed must be)."""
    return (value + 2**63) % 2**64 - 2**63


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`, or 499 if the client leaves first (a cascade judging a tier must not outlive it)."""
    result = await until_disconnected(request, _wrapped(work))
    if result is None:
        raise client_closed()
    return result[0]


async def _wrapped(work: Awaitable[T]) -> tuple[T]:
    return (await work,)


async def respond(request: Request, call: Call, stream: AsyncIterator[bytes] | None,
                  whole: Callable[[], msgspec.Struct]) -> Response:
    """Send `stream` as server-sent events, or run the call to its end and send `whole()`."""
    if stream is not None:
        return EventStreamResponse(stream, on_close=call.finish, at_shutdown=_STOPPED_STREAM_END,
                                   headers=call.headers())
    try:
        completed = await until_disconnected(request, call.run_to_end())
    finally:
        await call.finish()
    if completed is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    return Response(await _encode(call, whole), media_type="application/json",
                    headers=call.headers())


# How a stream still running at a shutdown's deadline ends: as one whose engine failed, with an
# error event (one the client may retry) and [DONE].
_STOPPED_STREAM_END = event(server_shutdown().body) + DONE

# A response of more tokens than this is built in a thread: with logprobs, each token is up to
# 21 entries that Python loops name one by one (about 0.1 s per thousand tokens at 20 logprobs).
_MAX_TOKENS_ENCODED_ON_LOOP = 256


async def _encode(call: Call, whole: Callable[[], msgspec.Struct]) -> bytes:
    """`whole()` as JSON; a large one built off the event loop, so that one tenant's big response
    does not hold up every other tenant's requests while it is built.
    NOTE: the call has ended, so nothing changes what `whole` reads meanwhile."""
    def encode() -> bytes:
        return msgspec.json.encode(whole())

    num_tokens = call.generation.num_prompt_tokens + call.generation.num_output_tokens
    return encode() if num_tokens <= _MAX_TOKENS_ENCODED_ON_LOOP else await asyncio.to_thread(encode)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`; if the client goes away first, cancel it and return None.

    NOTE: the request body must be read already, so `receive` can only report the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    return None if task.cancelled() else task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
