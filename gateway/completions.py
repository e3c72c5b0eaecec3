"""POST /v1/completions: text (or token-id) prompts in, completions out, whole or streamed."""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine.detokenizer import PROMPT_TAIL_TOKENS
from gateway.engine_client import EngineClient, EngineFailure, TokenLogprob
from gateway.errors import engine_failed, invalid_request
from gateway.generation import Ask, Prompt
from gateway.protocol import (MAX_CHOICES_PER_CALL, MAX_PROMPT_LIST_CHARS, MAX_PROMPTS, Completion,
                              CompletionChoice, CompletionLogprobs, CompletionRequest)
from gateway.serving import (Call, Target, authenticated_body, refuse_token_ids, refuse_unsupported,
                             resolve_target, respond, sampling_options, start_call, token_namer)
from gateway.sse import DONE, event
from gateway.text_codec import name_bytes


async def create_completion(request: Request) -> Response:
    """Create a completion for one or more prompts (OpenAI's legacy completions API)."""
    tenant, body = await authenticated_body(request, CompletionRequest)
    target = await resolve_target(request, tenant, body.model)
    refuse_unsupported(body, target)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and not body.echo:
        raise invalid_request("max_tokens must be at least 1; 0 is only for echo, to get the prompt "
                              "back (scored, with logprobs)", param="max_tokens")
    options = sampling_options(body, body.logprobs)
    if body.echo and body.logprobs is not None:
        options = msgspec.structs.replace(options, prompt_logprobs=body.logprobs)
    prompts = _prompts(target, body.prompt)
    _refuse_too_many_choices(len(prompts), body.n or 1)
    # NOTE: max_tokens 0 runs one token, as the engine always samples one; echo leaves it out.
    ask = Ask(prompts, options, max(max_tokens, 1), scores_prompt_only=max_tokens == 0,
              names_tokens_by_id=bool(body.return_tokens_as_token_ids and body.logprobs is not None))
    call = await start_call(request, "cmpl", tenant, body.model, target, ask, body.n or 1,
                            streamed=bool(body.stream))
    name = token_namer(call.engine, body.return_tokens_as_token_ids) \
        if body.logprobs is not None else None
    echo = None
    if body.echo:
        try:
            # NOTE: in a thread: the text offsets of a call's echoed prompts, thousands of tokens
            # each, take seconds to read, which every other tenant's request would wait out.
            echo = await asyncio.to_thread(Echo.of, call, ask, ask.scores_prompt_only)
        except BaseException:  # the client left meanwhile: its engine requests end here
            await call.finish()
            raise
    stream = None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(call, ask, name, include_usage, echo)

    def whole() -> Completion:
        choices = []
        for c in call.generation.choices:
            text, entries = c.text, _entries(c.logprobs)
            offsets = _text_offsets(call, ask, echo, c.prompt_index).advance(t for t, _, _ in entries)
            if echo is not None:
                text, entries, offsets = echo.apply(
                    c.prompt_index, call.generation.prompt_logprobs(c.prompt_index), text, entries,
                    offsets)
            finish_reason = c.finish_reason if echo is None else echo.finish_reason(c.finish_reason)
            choices.append(CompletionChoice(c.index, text, name and _logprobs(name, entries, offsets),
                                            finish_reason))
        return Completion(id=call.id, created=call.created, model=call.model, choices=choices,
                          usage=call.usage())

    return await respond(request, call, stream, whole)


# A logprob entry: (token id, its logprob, the top alternatives); None for an echoed prompt's
# first token, which follows nothing.
Entry = tuple[int, float | None, list[tuple[int, float]] | None]


def _entries(logprobs: list[TokenLogprob]) -> list[Entry]:
    return [(lp.token_id, lp.logprob, lp.top) for lp in logprobs]


@dataclass(frozen=True)
class Echo:
    """What `echo` puts before each choice: its prompt as text and, for logprobs, as the
    answering model's tokens with their logprobs. With max_tokens 0 it is all a choice says."""

    texts: list[str]  # per prompt: as sent, or the text of its tokens when sent as ids
    token_ids: list[list[int]]  # per prompt, as the answering model read it
    offsets: list[list[int]]  # per prompt: where each of its tokens starts in its text
    drop_output: bool

    @classmethod
    def of(cls, call: Call, ask: Ask, drop_output: bool) -> Echo:
        token_ids = [p.tokens(call.engine) for p in ask.prompts]
        texts = [p.render(call.engine)[0] if p.token_ids is None
                 else call.engine.detokenize(ids)
                 for p, ids in zip(ask.prompts, token_ids)]
        offsets = [_prompt_offsets(call.engine, ids, text) for ids, text in zip(token_ids, texts)]
        return cls(texts, token_ids, offsets, drop_output)

    def apply(self, prompt_index: int, prompt_logprobs: list[TokenLogprob] | None, text: str,
              entries: list[Entry], offsets: list[int]) -> tuple[str, list[Entry], list[int]]:
        """A choice's text, logprob entries and text offsets with its prompt in front (the
        offsets of its own tokens already count from the prompt's end: see _text_offsets)."""
        if self.drop_output:
            text, entries, offsets = "", [], []
        ids = self.token_ids[prompt_index]
        prompt_entries = [(ids[0], None, None), *_entries(prompt_logprobs or [])]
        return (self.texts[prompt_index] + text, prompt_entries + entries,
                self.offsets[prompt_index] + offsets)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """With max_tokens 0 a choice ends with `length` (its 0 tokens), whatever ended the one
        token the engine sampled and this leaves out (an EOS, a stop string)."""
        return "length" if self.drop_output and engine_reason is not None else engine_reason


class TextOffsets:
    """Where each token of a choice starts in its text, counted token after token, so that a
    stream's chunks give the offsets of the whole reply.

    A token's text is its bytes (text_codec.name_bytes of its name) read as UTF-8, bytes that
    never form a character reading as U+FFFD, one for each maximal run that could have begun one,
    as the engine's text shows them. A token starts at the character its first byte belongs to:
    one that continues a character begun before it starts where that character does.

    A special token adds nothing (the engine's text leaves it out) except in an echoed prompt,
    whose text spells it (see _prompt_offsets).

    `after`: the prompt that the tokens counted follow, as the engine read it. A prompt of token
    ids may end partway into a character, which the first tokens finish: the engine's text
    starts with it whole (engine/detokenizer.py), so its bytes are begun here. A prompt of
    special tokens alone shows no text: a tokenizer may then strip the leading space of the
    first token that shows some (sentencepiece's decoder strips the text's).
    """

    def __init__(self, engine: EngineClient, start: int = 0, *, in_prompt: bool = False,
                 after: Sequence[int] = ()):
        self._engine = engine
        self._token_bytes = (lambda t: name_bytes(engine.token_text(t))) if in_prompt \
            else engine.text_bytes
        self.num_chars = start  # the text so far, without the bytes of a character begun
        # The bytes of a character begun, which the next bytes may finish.
        self._begun = _decode_to_begun(b"".join(map(self._token_bytes, after[-PROMPT_TAIL_TOKENS:])))[1]
        self._at_text_start = bool(after) and not any(map(self._token_bytes, after))

    def advance(self, token_ids: Iterable[int]) -> list[int]:
        """The offsets of the next tokens."""
        offsets = []
        for token_id in token_ids:
            data = self._token_bytes(token_id)
            if data and self._at_text_start:
                data, self._at_text_start = self._at_the_start(token_id, data), False
            # The last character these read as holds the token's first byte; any before it are
            # the begun bytes, broken by that byte.
            head = (self._begun + data[:1]).decode(errors="replace")
            offsets.append(self.num_chars + (len(head) - 1 if head else 0))
            text, self._begun = _decode_to_begun(self._begun + data)
            self.num_chars += len(text)
        return offsets

    def _at_the_start(self, token_id: int, data: bytes) -> bytes:
        """The bytes of the first token that shows text, as it shows them at the text's start."""
        if data.startswith(b" ") and not self._engine.detokenize(
                [token_id], skip_special_tokens=True).startswith(" "):
            return data[1:]
        return data

    @property
    def num_chars_at_end(self) -> int:
        """The text's length were it to end here (a character begun shows as one U+FFFD)."""
        return self.num_chars + bool(self._begun)


def _decode_to_begun(data: bytes) -> tuple[str, bytes]:
    """`data` read as UTF-8 up to a character begun at its end, and the bytes of that character
    (which later bytes may finish)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, begun = decoder.decode(data), decoder.getstate()[0]
    # NOTE: CPython's decoder also holds back 0xED 0xA0..0xBF (a UTF-16 surrogate's start), which
    # no byte can finish: those are two U+FFFD already.
    broken = begun.decode(errors="replace")
    return (text + broken, b"") if len(broken) > 1 else (text, begun)


def _text_offsets(call: Call, ask: Ask, echo: Echo | None, prompt_index: int) -> TextOffsets:
    """The offsets of a choice's own tokens: after its echoed prompt, if any."""
    return TextOffsets(call.engine, 0 if echo is None else len(echo.texts[prompt_index]),
                       after=ask.prompts[prompt_index].tokens(call.engine))


def _prompt_offsets(engine: EngineClient, token_ids: list[int], text: str) -> list[int]:
    """Where each prompt token starts in the prompt's text as echoed.

    The tokens may spell more than the text at its start (the special tokens a tokenizer adds,
    sentencepiece's leading space), so their offsets are aligned to the text's end.
    """
    counter = TextOffsets(engine, in_prompt=True)
    offsets = counter.advance(token_ids)
    extra = max(0, counter.num_chars_at_end - len(text))
    return [min(max(0, offset - extra), len(text)) for offset in offsets]


def _prompts(target: Target, prompt: str | list) -> list[Prompt]:
    """The prompts of a request: a string, strings, token ids, or lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise invalid_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]  # one prompt of token ids
    if len(prompt) > MAX_PROMPTS:
        raise invalid_request(f"prompt is a list of {len(prompt)} prompts; one call takes at most "
                              f"{MAX_PROMPTS}: send the others in further calls", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        _refuse_too_much_text(prompt)
        return [Prompt.of_text(p) for p in prompt]
    if not all(isinstance(p, list) and p for p in prompt):
        raise invalid_request("prompt must be a string, a list of strings, a list of token ids "
                              "or a list of non-empty lists of token ids", param="prompt")
    refuse_token_ids(target, "prompt", "send the prompt as text")
    return [Prompt(token_ids=p) for p in prompt]


def _refuse_too_much_text(prompts: list[str]) -> None:
    """400 for a list of text prompts with more characters in all than the gateway tokenizes
    for one call."""
    num_chars = sum(map(len, prompts))
    if len(prompts) > 1 and num_chars > MAX_PROMPT_LIST_CHARS:
        raise invalid_request(f"the {len(prompts)} prompts hold {num_chars} characters in all; a "
                              f"list of prompts holds at most {MAX_PROMPT_LIST_CHARS}: split it "
                              "over several calls", param="prompt")


def _refuse_too_many_choices(num_prompts: int, n: int) -> None:
    """400 for a call whose prompts times n (each choice a request the engine runs) exceed the cap.
    NOTE: MAX_PROMPTS <= MAX_CHOICES_PER_CALL, so only n > 1 exceeds it: n is what to lower."""
    if num_prompts * n > MAX_CHOICES_PER_CALL:
        raise invalid_request(f"{num_prompts} prompts with n = {n} make {num_prompts * n} choices; "
                              f"one call makes at most {MAX_CHOICES_PER_CALL}: lower n, or send "
                              "fewer prompts per call", param="n")


async def _stream(call: Call, ask: Ask, name: Callable[[int], str] | None, include_usage: bool,
                  echo: Echo | None) -> AsyncIterator[bytes]:
    """One event per engine chunk that carries text, logprobs or the finish reason; with echo,
    each choice's first event starts with its prompt."""
    counters = [_text_offsets(call, ask, echo, c.prompt_index) for c in call.generation.choices]
    echoed: set[int] = set()
    try:
        async for index, chunk in call.generation:
            text, entries = chunk.text, _entries(chunk.logprobs)
            offsets = counters[index].advance(t for t, _, _ in entries)
            if echo is not None:
                if index not in echoed:
                    echoed.add(index)
                    prompt_index = call.generation.choices[index].prompt_index
                    text, entries, offsets = echo.apply(
                        prompt_index, call.generation.prompt_logprobs(prompt_index), text, entries,
                        offsets)
                elif echo.drop_output:
                    text, entries, offsets = "", [], []
            if not (text or chunk.finished or (name and entries)):
                continue
            logprobs = None if name is None else _logprobs(name, entries, offsets)
            finish_reason = chunk.finish_reason if echo is None else echo.finish_reason(
                chunk.finish_reason)
            choice = CompletionChoice(index, text, logprobs, finish_reason)
            yield event(Completion(id=call.id, created=call.created, model=call.model,
                                   choices=[choice]))
    except EngineFailure as error:
        yield event(engine_failed(error).body)
    else:
        if include_usage:
            yield event(Completion(id=call.id, created=call.created, model=call.model,
                                   choices=[], usage=call.usage()))
    yield DONE


def _logprobs(name: Callable[[int], str], entries: list[Entry],
              offsets: list[int]) -> CompletionLogprobs:
    tokens = [name(token_id) for token_id, _, _ in entries]
    top = [None if alternatives is None else _top(name, alternatives, token_id, logprob)
           for token_id, logprob, alternatives in entries]
    return CompletionLogprobs(tokens, [logprob for _, logprob, _ in entries], top, offsets)


def _top(name: Callable[[int], str], alternatives: list[tuple[int, float]], token_id: int,
         logprob: float | None) -> dict[str, float]:
    """The alternatives by name, and the chosen token's own, as OpenAI's API (and vLLM) always
    give it: up to `logprobs` + 1 entries. Two tokens may have one name (sentencepiece's piece
    for a byte and its "<0x41>" byte piece spell the same): the first, better one keeps it."""
    top: dict[str, float] = {}
    for alternative, alternative_logprob in alternatives:
        top.setdefault(name(alternative), alternative_logprob)
    if logprob is not None:
        top.setdefault(name(token_id), logprob)
    return top
