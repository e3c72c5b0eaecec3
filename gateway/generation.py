"""Generation: the engine requests behind one API call, run at once and merged as they stream.

A call's `Ask` says what it asks of the tier that runs it: each tier (a local model or an
upstream) reads the prompts with its own tokenizer and fits the answers to its own context, so a
route may mix models that tokenize differently.

Each engine request is pumped by its own task into one queue, so the n choices of a call decode in
the same engine batch. Cancelling the tasks (close(), or the HTTP task being cancelled when the
client disconnects) closes the engine streams, which aborts the requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from gateway.engine_client import (AdapterRef, AdapterRejected, AdapterUnusable, ChatNotServed,
                                   ContextExceeded, DamagedAdapterCopy, EngineClient, EngineFailure,
                                   EngineStopped, EngineUnavailable, GenerationChunk,
                                   OptionNotServed, RequestRejected, SamplingOptions, TokenLogprob,
                                   WorkersOutOfSpace)
from gateway.metrics import LatencyMetrics
from gateway.protocol import MAX_LOGPROBS

@dataclass
class Prompt:
    """One prompt of a call, which each engine reads with its own tokenizer.

    `render(engine)` is the text that engine reads and whether its tokenizer adds special tokens
    to it (a chat goes through each model's own template); a prompt sent as token ids
    (`token_ids`) is read as it is. Each engine renders the prompt once, and engines that share a
    tokenizer tokenize the same text once.
    """

    render: Callable[[EngineClient], tuple[str, bool]] | None = None
    token_ids: list[int] | None = None
    _by_engine: dict[EngineClient, list[int]] = field(default_factory=dict, init=False, repr=False)
    _by_text: dict[tuple, list[int]] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def of_text(cls, text: str) -> Prompt:
        return cls(lambda engine: (text, True))

    def tokens(self, engine: EngineClient) -> list[int]:
        """The prompt as `engine` reads it; RequestRejected if it cannot read the text."""
        if self.token_ids is not None:
            return self.token_ids
        if engine not in self._by_engine:
            text, add_special_tokens = self.render(engine)
            key = (engine.tokenizer_key, text, add_special_tokens)
            if key not in self._by_text:
                self._by_text[key] = engine.tokenize(text, add_special_tokens=add_special_tokens)
            self._by_engine[engine] = self._by_text[key]
        return self._by_engine[engine]


@dataclass(frozen=True)
class Tier:
    """One model a call may run on, as the tenant runs it: the model, its engine and adapter."""

    model: str
    engine: EngineClient
    adapter: AdapterRef | None = None
    # Checks this gateway's copy of the adapter's files, replacing a damaged one (see
    # store.blobs.ensure_intact_copy); whether it is intact now.
    ensure_intact_adapter: Callable[[], Awaitable[bool]] | None = None


Reading = tuple[list[int], SamplingOptions]  # a prompt as one tier reads it, and its answer's options


@dataclass(frozen=True)
class Ask:
    """What one call asks of the tier that runs it: answers to `prompts`, sampled with `options`.

    A tier that cannot serve the call refuses it as it reads it (CannotServe): one whose
    context cannot fit a prompt, or a prompt and its answer (ContextExceeded), or that does not
    serve its options (OptionNotServed). A route runs the call on its tiers that can serve it.
    """

    prompts: list[Prompt]
    options: SamplingOptions  # each tier sets max_tokens from `max_tokens`
    max_tokens: int | None  # None: each answer may fill the rest of its tier's context...
    implicit_max_tokens: int | None = None  # ...up to this many tokens, when set
    # Echo with max_tokens 0: the prompt back, scored. The engine still samples one token, which
    # the client never sees, so the answer is not worth judging or running twice.
    scores_prompt_only: bool = False
    # The client asked for logprobs naming tokens by id ("token_id:<id>", return_tokens_as_token_ids).
    names_tokens_by_id: bool = False
    prompt_param: str = "prompt"  # the request's fields, for the errors that concern them
    max_tokens_param: str = "max_tokens"
    logprobs_param: str = "logprobs"

    def param_of(self, error: RequestRejected) -> str | None:
        """The request field, as the client named it, that `error` is about."""
        # The prompt's logprobs are asked for by echo (with logprobs) alone.
        return {"prompt": self.prompt_param, "max_tokens": self.max_tokens_param,
                "logprobs": self.logprobs_param,
                "prompt_logprobs": "echo"}.get(error.param, error.param)

    def length_param(self) -> str | None:
        """The field that sets how long the answers may be, which admission's refusals advise
        lowering: max_tokens as the call named it; for a call that left it out (its answers are
        fitted to its tenant's limits), min_tokens when set, else None (one token is the least)."""
        if self.max_tokens is not None:
            return self.max_tokens_param
        return "min_tokens" if self.options.min_tokens > 1 else None

    def read(self, tier: Tier) -> list[Reading]:
        """Each prompt as `tier` reads it, with the options of its answer there. OptionNotServed,
        before any prompt is tokenized, if the tier does not serve the options; RequestRejected
        if it cannot read a prompt (ChatNotServed: its chat template refuses the chat);
        ContextExceeded as soon as one cannot fit its context, before the prompts after it are
        tokenized (a call's other prompts cannot save it)."""
        if self.max_tokens is not None and self.options.min_tokens > self.max_tokens:
            # NOTE: the engine refuses it too, but names max_tokens, which a chat may not have sent.
            raise RequestRejected(f"min_tokens must be in [0, {self.max_tokens_param}] = "
                                  f"[0, {self.max_tokens}], got {self.options.min_tokens}",
                                  "min_tokens")
        tier.engine.check_options(self.options)
        # NOTE: an engine whose tokens are the text's bytes (an upstream) names the tokens of its
        # logprobs by ids of this gateway's own, which mean nothing to the model (nor to
        # logit_bias and stop_token_ids, which the upstream reads as its own ids).
        if self.names_tokens_by_id and tier.engine.counts_text_bytes:
            raise OptionNotServed(f"{tier.model!r} is served by an upstream API, whose logprobs "
                                  "name tokens by their text: it has no token ids to return; "
                                  "leave out return_tokens_as_token_ids, or call a local model",
                                  "return_tokens_as_token_ids")
        readings = []
        for prompt in self.prompts:
            try:
                token_ids = prompt.tokens(tier.engine)
            except ChatNotServed as error:  # the engine knows no name: the tier's, which a route has
                raise ChatNotServed(error.reason, tier.model) from None
            max_tokens, fills_context = self.max_tokens, False
            if max_tokens is None:
                context_left = max(1, tier.engine.max_model_len - len(token_ids))
                max_tokens = min(context_left, self.implicit_max_tokens or context_left)
                fills_context = max_tokens == context_left
            self._check_context(tier.engine, len(token_ids), max_tokens,
                                least_tokens=self.options.min_tokens if self.max_tokens is None else 0)
            readings.append((token_ids, msgspec.structs.replace(
                self.options, max_tokens=max_tokens, fills_context=fills_context)))
        return readings

    def check_logprobs(self, tier: Tier, reading: list[Reading], n: int) -> None:
        """RequestRejected if the answers to `reading` (`n` choices per prompt) could carry more
        logprob entries than one full context of `tier`'s model at the most logprobs.

        The gateway holds a response's logprobs in memory while it builds it (some 200 bytes an
        entry, some 30 in its JSON), so a call of many prompts or choices must not ask for
        gigabytes of them; one prompt at its model's whole context still gets every logprob.
        NOTE: a choice's tokens are counted as its context counts them: the echoed prompt's, and
        max_tokens, at least one (the engine samples a token even for echo with max_tokens 0).
        """
        num_top, max_model_len = self.options.logprobs, tier.engine.max_model_len
        if num_top is None or max_model_len == 0:  # 0: not known yet (the call gets a 503)
            return
        num_tokens = n * sum(options.max_tokens + (0 if options.prompt_logprobs is None else
                                                   len(token_ids)) for token_ids, options in reading)
        num_entries, max_entries = num_tokens * (num_top + 1), max_model_len * (MAX_LOGPROBS + 1)
        if num_entries > max_entries:
            raise RequestRejected(
                f"this call asks for the logprobs of up to {num_tokens} tokens (each choice's "
                f"{self.max_tokens_param}, and its prompt when echoed), each with "
                f"{self.logprobs_param} = {num_top} alternatives: {num_entries} entries, but one "
                f"call returns at most {max_entries} (this model's context of {max_model_len} "
                f"tokens x {MAX_LOGPROBS + 1}); send fewer prompts or choices per call, lower "
                f"{self.max_tokens_param}, or ask for fewer {self.logprobs_param}", "logprobs")

    def _check_context(self, engine: EngineClient, num_prompt_tokens: int, max_tokens: int, *,
                       least_tokens: int = 0) -> None:
        """ContextExceeded if a prompt of `num_prompt_tokens` and an answer of `max_tokens` cannot
        fit `engine`'s context, or (for a call that set no max_tokens, whose answer fills the rest
        of the context) one of `least_tokens`, its min_tokens.

        NOTE: a context of 0 is not known yet (no engine worker of the model has registered): the
        call gets a 503 instead (serving._leave_out_unavailable). A prompt of more bytes than
        an upstream's context may still fit its tokens: the upstream judges it."""
        max_model_len = engine.max_model_len
        if max_model_len == 0 or (engine.counts_text_bytes and num_prompt_tokens >= max_model_len):
            return
        if num_prompt_tokens >= max_model_len:  # as the engine words it (LLMEngine.add_request)
            raise ContextExceeded(f"the prompt has {num_prompt_tokens} tokens but this model "
                                  f"accepts at most {max_model_len - 1}; shorten the prompt",
                                  "prompt")
        if num_prompt_tokens + least_tokens > max_model_len:
            raise ContextExceeded(
                f"this model's maximum context length is {max_model_len} tokens, but you asked "
                f"for at least {num_prompt_tokens + least_tokens} ({num_prompt_tokens} in the "
                f"prompt, min_tokens = {least_tokens} for the output); lower min_tokens or "
                "shorten the prompt", "min_tokens")
        num_tokens = num_prompt_tokens + max_tokens
        if num_tokens > max_model_len:
            raise ContextExceeded(
                f"this model's maximum context length is {max_model_len} tokens, but you asked "
                f"for {num_tokens} ({num_prompt_tokens} in the prompt, {max_tokens} for the "
                f"output); lower {self.max_tokens_param} or shorten the prompt", "max_tokens")

    async def generate(self, tier: Tier, prompt: list[int], options: SamplingOptions, *,
                       request_id: str, tenant: str | None) -> AsyncIterator[GenerationChunk]:
        """The stream of one answer on `tier` (a reading of `read`); like the engine's own, its
        first iteration raises RequestRejected if the request cannot run there."""
        for attempt in (1, 2):
            is_started = False
            async with contextlib.aclosing(tier.engine.generate(
                    prompt, options, request_id=request_id, tenant=tenant,
                    adapter=tier.adapter)) as stream:  # closing it aborts the engine request
                try:
                    async for chunk in stream:
                        is_started = True
                        yield chunk
                    return
                except EngineFailure as error:
                    if is_started or not await _is_worth_another_try(tier, error):
                        raise
                    if attempt == 2:
                        await _refuse_adapter_that_does_not_fit(tier)
                        raise


# Failures a second try would meet again, or that say where to send it instead.
_NOT_RETRIED = (EngineUnavailable, EngineStopped, DamagedAdapterCopy, WorkersOutOfSpace)


async def _is_worth_another_try(tier: Tier, error: EngineFailure) -> bool:
    """After an engine failed a request before its first token: whether the tier's adapter has
    an intact copy here now: sent once more, the request may run; failed again, it did not fail
    on the copy. DamagedAdapterCopy (with the engine's message) when the copy is not intact and
    cannot be replaced: the adapter, not the engine, cannot run, so a route's next tier does not
    answer in its place (it did, without the adapter).

    An engine reads the adapter's files before a request's first token: it may have failed on
    a copy damaged on this gateway's disk (replaced here now: see Tier.ensure_intact_adapter) or
    on a worker's (dropped there by the failure, so the files are sent again)."""
    if tier.ensure_intact_adapter is None or isinstance(error, _NOT_RETRIED):
        return False
    if not await tier.ensure_intact_adapter():
        raise DamagedAdapterCopy(str(error)) from error
    return True


async def _refuse_adapter_that_does_not_fit(tier: Tier) -> None:
    """After the engine failed a request twice before its first token, with an intact copy of its
    adapter's files: AdapterUnusable if the model served now cannot take the adapter (the server
    was restarted on a model of other shapes under its base model's name), as when it was
    uploaded. Else the engine's own failure stands."""
    assert tier.adapter is not None
    try:
        await tier.engine.check_adapter(tier.adapter.path)
    except AdapterRejected as rejected:
        raise AdapterUnusable(
            f"the adapter does not fit the model served as {tier.model!r} now: {rejected}; upload "
            "it again, made for the model served now") from None
    except EngineFailure:  # cannot check it now: say what the engine said
        pass


@dataclass
class Choice:
    """Everything one engine request has produced so far."""

    index: int
    prompt_index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_engine_output_tokens: int = 0  # the engine's own count, as its last chunk said
    last_chunk_at: float | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        self.logprobs.extend(chunk.logprobs)
        self.finish_reason = chunk.finish_reason
        self.num_prompt_tokens = chunk.num_prompt_tokens
        self.num_cached_tokens = chunk.num_cached_tokens
        self.num_engine_output_tokens = chunk.num_output_tokens

    @property
    def num_output_tokens(self) -> int:
        """The tokens this choice used: its token ids, or the engine's count when that is larger.
        An upstream that sends no logprobs gives one id per piece of text, and a piece may hold
        several of its tokens; its usage, on the last chunk, counts them all."""
        return max(len(self.token_ids), self.num_engine_output_tokens)


class HeldChunk(GenerationChunk, frozen=True, kw_only=True):
    """A chunk read before the call's answer began (a route judging a tier, or holding one to
    fall back on), handed on later: latencies are timed by when it arrived, not when it is
    handed on, which would make a judged answer's tokens seem to come all at once."""

    arrived_at: float  # time.monotonic()

    @classmethod
    def of(cls, chunk: GenerationChunk) -> HeldChunk:
        """`chunk`, arrived now."""
        return cls(**msgspec.structs.asdict(chunk), arrived_at=time.monotonic())


class Generation:
    """Runs `streams` (choice i comes from prompt `prompt_indices[i]`) and merges their chunks.
    `same_prompt_as[p]`: the first prompt of the call with prompt p's tokens (by default, p).

    Latencies are observed as chunks arrive, once per call however many choices it has: the
    first token is the first of any choice, the last token the last of all; the time between
    tokens is observed for each choice's gaps.
    """

    def __init__(self, streams: list[AsyncIterator[GenerationChunk]], prompt_indices: list[int],
                 latency: LatencyMetrics, arrived_at: float, same_prompt_as: list[int] | None = None,
                 *, prompt_per_choice: bool = False):
        self.choices = [Choice(i, p) for i, p in enumerate(prompt_indices)]
        self._prompt_per_choice = prompt_per_choice
        self._same_prompt_as = same_prompt_as or sorted(set(prompt_indices))  # prompts 0, 1, ...
        self._prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        self._latency = latency
        self._arrived_at = arrived_at  # time.monotonic() when the HTTP request came in
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: collections.deque[tuple[int, GenerationChunk, float]] = collections.deque()
        self._num_finished = 0
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def start(self) -> None:
        """Wait until every request produced its first chunk; raises what the engine raised
        (RequestRejected for a request it refused) after stopping the others."""
        waiting = set(range(len(self._tasks)))
        while waiting:
            index, item, at = await self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            waiting.discard(index)
            self._keep_prompt_logprobs(index, item)
            self._buffer.append((index, item, at))

    async def __aiter__(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """(choice index, chunk) in arrival order, each already added to `self.choices`."""
        while self._buffer:
            # NOTE: taken out before it is recorded: a consumer stopped at this yield (a
            # shutdown's deadline) leaves only unrecorded chunks for `close` to add.
            index, chunk, at = self._buffer.popleft()
            yield index, self._record(index, chunk, at)
        while self._num_finished < len(self.choices):
            index, item, at = await self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                if isinstance(item, EngineFailure):
                    raise item  # as it is: its kind decides what the client gets (engine_failed)
                raise EngineFailure(str(item)) from item
            yield index, self._record(index, item, at)

    def close(self) -> None:
        """Abort the requests still running (a no-op for finished ones). What they produced
        before is added to `choices` even if nobody read it, since it is billed: the chunks
        `start` kept and those still queued (the client left, or another choice failed)."""
        for task in self._tasks:
            task.cancel()
        unread = [(index, chunk) for index, chunk, _ in self._buffer]
        self._buffer.clear()
        while not self._queue.empty():
            index, item, _ = self._queue.get_nowait()
            if not isinstance(item, BaseException):
                unread.append((index, item))
        for index, chunk in unread:
            self.choices[index].add(chunk)
            self._num_finished += chunk.finished

    def prompt_logprobs(self, prompt_index: int) -> list[TokenLogprob] | None:
        """The logprobs of a prompt's tokens 1.., when asked for (SamplingOptions.prompt_logprobs):
        one choice per prompt scores it, and they are known once `start` has returned."""
        return self._prompt_logprobs.get(prompt_index)

    @property
    def is_done(self) -> bool:
        """Whether every engine request has finished."""
        return self._num_finished == len(self.choices)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the call, each prompt counted once however many choices it has; or
        once per choice, when `prompt_per_choice` (each choice was a request of its own to an
        upstream, which billed it the prompt)."""
        if self._prompt_per_choice:
            return sum(c.num_prompt_tokens for c in self.choices)
        return sum(c.num_prompt_tokens for c in self._one_started_choice_per_prompt())

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens read from the prefix cache as earlier calls left it, each prompt once.
        Of the choices of a prompt and of the prompts the call repeats, the fewest: one computes
        it, and the others read its blocks from the cache (the engine shares them), which saved
        this call nothing. NOTE: prompts that share only a prefix still count the blocks of it
        that one of them computed: which blocks they share depends on the engine's block size.
        With `prompt_per_choice`, each choice's own (each read the cache of an upstream of its
        own accord)."""
        if self._prompt_per_choice:
            return sum(c.num_cached_tokens for c in self.choices)
        fewest: dict[int, int] = {}
        for c in self.choices:
            if c.num_prompt_tokens:
                key = self._same_prompt_as[c.prompt_index]
                fewest[key] = min(c.num_cached_tokens, fewest.get(key, c.num_cached_tokens))
        return sum(fewest[self._same_prompt_as[c.prompt_index]]
                   for c in self._one_started_choice_per_prompt())

    def _one_started_choice_per_prompt(self) -> list[Choice]:
        """A choice of each prompt that got a chunk (the last), if any did: one still waiting when
        the call ended counts 0 tokens, though its prompt's other choices computed the prompt."""
        started = {c.prompt_index: c for c in self.choices if c.num_prompt_tokens}
        return list(started.values())

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)

    def _keep_prompt_logprobs(self, index: int, chunk: GenerationChunk) -> None:
        """Engines send a prompt's logprobs on a request's first chunk, which `start` sees."""
        if chunk.prompt_logprobs is not None:
            self._prompt_logprobs[self.choices[index].prompt_index] = chunk.prompt_logprobs

    def _record(self, index: int, chunk: GenerationChunk, now: float) -> GenerationChunk:
        choice = self.choices[index]
        if choice.last_chunk_at is None:
            if all(c.last_chunk_at is None for c in self.choices):
                self._latency.time_to_first_token.observe(now - self._arrived_at)
        elif chunk.token_ids:
            self._latency.time_per_output_token.observe((now - choice.last_chunk_at)
                                                        / len(chunk.token_ids))
        choice.last_chunk_at = now
        choice.add(chunk)
        if chunk.finished:
            self._num_finished += 1
            if self._num_finished == len(self.choices):
                self._latency.e2e_request_latency.observe(now - self._arrived_at)
        return chunk

    async def _pump(self, index: int, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                at = chunk.arrived_at if isinstance(chunk, HeldChunk) else time.monotonic()
                self._queue.put_nowait((index, chunk, at))
        except Exception as error:  # handed to the consumer, which decides what the client sees
            self._queue.put_nowait((index, error, time.monotonic()))
