"""POST /v1/completions: text (or token-id) prompts in, completions out, whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import authenticate_tenant
from gateway.engine_client import EngineFailure, TokenLogprob
from gateway.errors import engine_failed, invalid_request
from gateway.generation import Ask, Prompt
from gateway.protocol import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from gateway.serving import (Call, Target, decode_body, refuse_unsupported, resolve_target,
                             respond, sampling_options, start_call, token_namer)
from gateway.sse import DONE, event
from gateway.state import gateway_state


async def create_completion(request: Request) -> Response:
    """Create a completion for one or more prompts (OpenAI's legacy completions API)."""
    state = gateway_state(request)
    tenant = await authenticate_tenant(request, state.require_store())
    body = await decode_body(request, CompletionRequest)
    target = await resolve_target(state, tenant, body.model)
    request.state.model = body.model
    refuse_unsupported(body, target)
    ask = Ask(_prompts(target, body.prompt), sampling_options(body, body.logprobs),
              body.max_tokens or 16)
    call = await start_call(request, "cmpl", tenant, body.model, target, ask, body.n or 1,
                            streamed=bool(body.stream),
                            prompt_text=body.prompt if isinstance(body.prompt, str) else None)
    name = token_namer(call.engine, body.return_tokens_as_token_ids) \
        if body.logprobs is not None else None
    stream = None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(call, name, include_usage)

    def whole() -> Completion:
        choices = [CompletionChoice(c.index, c.text, name and _logprobs(name, c.logprobs, 0),
                                    c.finish_reason)
                   for c in call.generation.choices]
        return Completion(id=call.id, created=call.created, model=call.model, choices=choices,
                          usage=call.usage())

    return await respond(request, call, stream, whole)


def _prompts(target: Target, prompt: str | list) -> list[Prompt]:
    """The prompts of a request: a string, strings, token ids, or lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise invalid_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [Prompt.of_text(p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    elif not all(isinstance(p, list) and p for p in prompt):
        raise invalid_request("prompt must be a string, a list of strings, a list of token ids "
                              "or a list of non-empty lists of token ids", param="prompt")
    if not target.shares_tokenizer:
        raise invalid_request(
            f"the models of route {target.route.name!r} read text with different tokenizers, so "
            "token ids cannot mean the same to all of them; send the prompt as text, or name one "
            f"of its models ({', '.join(t.model for t in target.tiers)}) instead of the route",
            param="prompt")
    return [Prompt(token_ids=p) for p in prompt]


async def _stream(call: Call, name: Callable[[int], str] | None,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """One event per engine chunk that carries text, logprobs or the finish reason."""
    offsets = [0] * len(call.generation.choices)
    try:
        async for index, chunk in call.generation:
            if not (chunk.text or chunk.finished or (name and chunk.logprobs)):
                continue
            logprobs = None
            if name is not None:
                logprobs = _logprobs(name, chunk.logprobs, offsets[index])
                offsets[index] += sum(len(t) for t in logprobs.tokens)
            choice = CompletionChoice(index, chunk.text, logprobs, chunk.finish_reason)
            yield event(Completion(id=call.id, created=call.created, model=call.model,
                                   choices=[choice]))
    except EngineFailure as error:
        yield event(engine_failed(error).body)
    else:
        if include_usage:
            yield event(Completion(id=call.id, created=call.created, model=call.model,
                                   choices=[], usage=call.usage()))
    yield DONE


def _logprobs(name: Callable[[int], str], logprobs: list[TokenLogprob],
              start_offset: int) -> CompletionLogprobs:
    tokens = [name(lp.token_id) for lp in logprobs]
    offsets, offset = [], start_offset
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [{name(t): v for t, v in lp.top} for lp in logprobs]
    return CompletionLogprobs(tokens, [lp.logprob for lp in logprobs], top, offsets)
