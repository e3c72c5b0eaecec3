"""POST /v1/chat/completions: messages through the model's chat template, replies whole or streamed."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.engine_client import EngineClient, EngineFailure, TokenLogprob
from gateway.errors import engine_failed, invalid_request
from gateway.generation import Ask, Prompt
from gateway.protocol import (CHAT_ROLES, AssistantMessage, ChatChoice, ChatChunkChoice,
                              ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                              ChatLogprobs, ChatMessage, ChatTokenLogprob, Delta, TopLogprob)
from gateway.serving import (Call, authenticated_body, refuse_unsupported, resolve_target,
                             respond, sampling_options, start_call, token_namer)
from gateway.sse import DONE, event


async def create_chat_completion(request: Request) -> Response:
    """Create the assistant's reply to a conversation."""
    tenant, body = await authenticated_body(request, ChatCompletionRequest)
    target = await resolve_target(request, tenant, body.model)
    refuse_unsupported(body, target)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_request("top_logprobs needs logprobs: true", param="top_logprobs")
    turns = [_turn(m, i) for i, m in enumerate(body.messages)]
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    # As OpenAI: with no max_tokens (None) the reply may fill the rest of the context.
    ask = Ask([Prompt(functools.partial(_chat_text, turns))], sampling_options(body, num_top),
              body.max_completion_tokens or body.max_tokens, prompt_param="messages",
              max_tokens_param=param, logprobs_param="top_logprobs",
              names_tokens_by_id=bool(body.return_tokens_as_token_ids and body.logprobs))
    call = await start_call(request, "chatcmpl", tenant, body.model, target, ask, body.n or 1,
                            streamed=bool(body.stream), prompt_text=_last_user_text(body.messages))
    name = token_namer(call.engine, body.return_tokens_as_token_ids) if body.logprobs else None
    stream = None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(call, name, num_top, include_usage)

    def whole() -> ChatCompletion:
        choices = [ChatChoice(c.index, AssistantMessage(c.text),
                              name and _logprobs(call.engine, name, c.logprobs, num_top),
                              c.finish_reason)
                   for c in call.generation.choices]
        return ChatCompletion(id=call.id, created=call.created, model=call.model,
                              choices=choices, usage=call.usage())

    return await respond(request, call, stream, whole)


def _chat_text(turns: list[dict[str, str]], engine: EngineClient) -> tuple[str, bool]:
    """The conversation as `engine` reads it, through its model's chat template if it has one,
    and whether its tokenizer adds special tokens.

    Without a template the prompt is a plain transcript ("role: content" lines, then
    "assistant:"). Template output already holds any special tokens, so none are added to it.
    """
    rendered = engine.render_chat(turns)
    if rendered is not None:
        return rendered, False
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:", True


def _turn(message: ChatMessage, index: int) -> dict[str, str]:
    """A message as engines read it: its role, its text, and its author's name if it has one."""
    if message.role not in CHAT_ROLES:
        raise invalid_request(f"messages[{index}] has the role {message.role!r}; a message's role "
                              f"is one of {', '.join(CHAT_ROLES)}", param=f"messages[{index}].role")
    turn = {"role": message.role, "content": _text(message, index)}
    if message.name:
        turn["name"] = message.name
    return turn


def _last_user_text(messages: list[ChatMessage]) -> str | None:
    """What a learned route reads of a chat: the latest user turn (routers are trained on prompts,
    not on chat templates)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            return _text(messages[i], i)
    return None


def _text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for j, part in enumerate(message.content):
        if part.type != "text":
            raise invalid_request(f"messages[{index}] has a content part of type {part.type!r}; "
                                  "only text parts are supported", param=f"messages[{index}].content")
        if part.text is None:
            raise invalid_request(f"messages[{index}].content[{j}] is a text part with no 'text'; "
                                  "add its text, or leave the part out",
                                  param=f"messages[{index}].content[{j}].text")
        parts.append(part.text)
    # NOTE: one line each, as vLLM joins them: parts are separate pieces of the message, and
    # "".join would glue the last word of one to the first of the next.
    return "\n".join(parts)


async def _stream(call: Call, name: Callable[[int], str] | None, num_top: int | None,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """A role delta per choice, then one event per engine chunk with text, logprobs or the end."""

    def chunk(choices: list[ChatChunkChoice]) -> bytes:
        return event(ChatCompletionChunk(id=call.id, created=call.created, model=call.model,
                                         choices=choices))

    for choice in call.generation.choices:
        yield chunk([ChatChunkChoice(choice.index, Delta(role="assistant", content=""), None, None)])
    try:
        async for index, out in call.generation:
            if out.text or out.finished or (name and out.logprobs):
                delta = Delta(content=out.text) if out.text else Delta()
                logprobs = name and _logprobs(call.engine, name, out.logprobs, num_top)
                yield chunk([ChatChunkChoice(index, delta, logprobs, out.finish_reason)])
    except EngineFailure as error:
        yield event(engine_failed(error).body)
    else:
        if include_usage:
            yield event(ChatCompletionChunk(id=call.id, created=call.created, model=call.model,
                                            choices=[], usage=call.usage()))
    yield DONE


def _logprobs(engine: EngineClient, name: Callable[[int], str], logprobs: list[TokenLogprob],
              num_top: int) -> ChatLogprobs:
    """Logprobs as the chat API has them: each token named by `name`, with the bytes it adds to
    the text whatever the name (token ids included), so that a character split between tokens
    joins back whole; a special token, like the EOS that ends a reply, adds none: null bytes."""

    def entry(token_id: int, logprob: float) -> TopLogprob:
        data = engine.text_bytes(token_id)
        return TopLogprob(name(token_id), logprob, list(data) if data else None)

    content = []
    for lp in logprobs:
        sampled = entry(lp.token_id, lp.logprob)
        top = [entry(t, v) for t, v in lp.top[:num_top]]
        content.append(ChatTokenLogprob(sampled.token, sampled.logprob, sampled.bytes, top))
    return ChatLogprobs(content)
