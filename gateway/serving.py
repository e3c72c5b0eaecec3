"""The path both generation endpoints share: auth, body, model, admission, engine requests, billing.

`start_call` takes a request from its HTTP body to running engine requests; the endpoint then
formats what they produce and calls `Call.finish` exactly once, however the call ended.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.admission import Admission, admit
from gateway.engine_client import (AdapterRef, EngineClient, EngineFailure, RequestRejected,
                                   SamplingOptions)
from gateway.errors import (ApiError, engine_failed, from_validation_error, invalid_request,
                           model_not_found)
from gateway.generation import Generation
from gateway.protocol import PromptTokensDetails, SamplingFields, Usage
from gateway.sse import EventStreamResponse
from gateway.state import GatewayState, gateway_state
from routing.models import ModelNotFound, resolve_model
from store import Tenant

T = TypeVar("T")


async def decode_body(request: Request, body_type: type[T]) -> T:
    """The JSON body as `body_type`; a 400 naming the field when it does not fit."""
    try:
        return msgspec.json.decode(await request.body(), type=body_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise from_validation_error(error) from None


def refuse_unsupported(body: SamplingFields) -> None:
    """400 for a known OpenAI field set to something this server cannot honour."""
    unsupported = body.unsupported_field()
    if unsupported is not None:
        raise invalid_request(f"'{unsupported}' is not supported by this server; leave it out",
                              param=unsupported, code="unsupported_parameter")


@dataclass(frozen=True)
class Target:
    """Where a call runs: the base model and its engine, and the adapter it runs with if any."""

    base_model: str
    engine: EngineClient
    adapter: AdapterRef | None = None


async def resolve_target(state: GatewayState, tenant: Tenant, model: str) -> Target:
    """The engine and adapter `model` names for this tenant; 404 if it names nothing they may use."""
    try:
        target = await resolve_model(state.require_store(), tenant, state.engines, model)
    except ModelNotFound:
        raise model_not_found(model) from None
    engine = state.engines[target.base_model]
    if target.adapter is None:
        return Target(target.base_model, engine)
    folder = state.blobs.path(target.adapter.digest)
    if folder is None:
        raise ApiError(503, f"the files of adapter {target.adapter.name!r} are missing from this "
                       "server's adapter folder; upload the adapter again", type="server_error",
                       code="adapter_files_missing")
    return Target(target.base_model, engine, AdapterRef(target.adapter.digest, str(folder)))


def sampling_options(body: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingOptions:
    """SamplingOptions from the fields both endpoints share; None means the engine's default."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    fields = dict(max_tokens=max_tokens, logprobs=logprobs, stop=tuple(stop),
                  stop_token_ids=tuple(body.stop_token_ids or ()))
    for name in ("temperature", "top_p", "top_k", "seed", "min_tokens", "ignore_eos",
                 "repetition_penalty", "include_stop_str_in_output"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    return SamplingOptions(**fields)


def token_namer(engine: EngineClient, as_ids: bool | None) -> Callable[[int], str]:
    """How logprobs name tokens: their text, or "token_id:<id>" when the client asked for ids."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else engine.token_text


def check_context_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
                         param: str = "max_tokens") -> None:
    """400 if the prompt plus the requested output cannot fit the model's context."""
    if num_prompt_tokens < max_model_len < num_prompt_tokens + max_tokens:
        raise invalid_request(
            f"this model's maximum context length is {max_model_len} tokens, but you asked for "
            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, {max_tokens} "
            f"for the output); lower {param} or shorten the prompt", param=param)


@dataclass
class Call:
    """One API call in flight: its engine requests, and what to bill when it ends."""

    request: Request
    id: str
    created: int
    model: str
    tenant: Tenant
    target: Target
    generation: Generation
    admission: Admission
    state: GatewayState
    is_finished: bool = False

    def usage(self) -> Usage:
        g = self.generation
        return Usage(g.num_prompt_tokens, g.num_output_tokens,
                     g.num_prompt_tokens + g.num_output_tokens,
                     PromptTokensDetails(g.num_cached_tokens))

    async def run_to_end(self) -> bool:
        """Wait until every engine request finished; a 500 if the engine failed."""
        try:
            async for _ in self.generation:
                pass
        except EngineFailure as error:
            raise engine_failed(error) from None
        return True

    async def finish(self) -> None:
        """Stop what still runs, then count and bill the tokens really used (once)."""
        if self.is_finished:
            return
        self.is_finished = True
        self.generation.close()
        usage = self.usage()
        self.state.metrics.count_tokens(self.tenant.name, self.model, usage.prompt_tokens,
                                        usage.completion_tokens)
        self.request.state.prompt_tokens = usage.prompt_tokens
        self.request.state.completion_tokens = usage.completion_tokens
        await self.admission.settle(usage.prompt_tokens, usage.completion_tokens)


async def start_call(request: Request, id_prefix: str, tenant: Tenant, model: str,
                     target: Target, prompts: list[list[int]], options: SamplingOptions,
                     n: int) -> Call:
    """Admit the call and start `n` engine requests per prompt; returns once each produced its
    first token, so a request the engine refuses still gets a 400, not a broken stream."""
    state = gateway_state(request)
    estimate = sum(len(p) for p in prompts) + options.max_tokens * n * len(prompts)
    admission = await admit(state.require_store(), tenant, estimate)
    call_id = f"{id_prefix}-{uuid.uuid4().hex}"
    streams, prompt_indices = [], []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            # Seeded choices differ from each other but stay reproducible (vLLM does the same).
            seed = None if options.seed is None else options.seed + j
            streams.append(target.engine.generate(
                prompt, msgspec.structs.replace(options, seed=seed),
                request_id=f"{call_id}-{len(streams)}", tenant=tenant.name, adapter=target.adapter))
            prompt_indices.append(p)
    arrived_at = getattr(request.state, "arrived_at", time.monotonic())
    generation = Generation(streams, prompt_indices, state.metrics.latency(model), arrived_at)
    call = Call(request, call_id, int(time.time()), model, tenant, target, generation, admission,
                state)
    try:
        await generation.start()
    except RequestRejected as error:
        await call.finish()
        raise invalid_request(str(error)) from None
    except EngineFailure as error:
        await call.finish()
        raise engine_failed(error) from None
    except BaseException:
        await call.finish()
        raise
    return call


async def respond(request: Request, call: Call, stream: AsyncIterator[bytes] | None,
                  whole: Callable[[], msgspec.Struct]) -> Response:
    """Send `stream` as server-sent events, or run the call to its end and send `whole()`."""
    if stream is not None:
        return EventStreamResponse(stream, on_close=call.finish)
    try:
        completed = await until_disconnected(request, call.run_to_end())
    finally:
        await call.finish()
    if completed is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    return Response(msgspec.json.encode(whole()), media_type="application/json")


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
