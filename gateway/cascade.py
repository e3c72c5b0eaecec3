"""Running a cascade route: each tier answers unless its confidence is below the route's threshold
(and a learned route's pick, with its other tier as the fallback: `run_with_fallback`).

A judged tier runs with logprobs on. A whole (non-streamed) answer is judged on all its tokens;
a streamed one on its first `prefix_tokens`, before any byte reaches the client, and if it is
kept the stream goes on from there with nothing run twice. An escalated tier is aborted, and its
tokens are still billed. A tier whose engine fails is escalated past too (and so is one that
refuses the request, or answers without logprobs, which cannot be judged), so the last tier is the
fallback; not one whose adapter cannot run (deleted while the call waited, made for a model no
longer served, or its files damaged beyond repair): the call asked for that adapter, so it ends
as a call to it would. If the last tier fails too before its first token (a whole answer: before
its last, as none of it has reached the client), the tier escalated past that was surest of its
answer answers after all: that one is aborted only once a later tier answers, and its answer is
read on meanwhile (the engine makes it anyway), so the tokens it made are billed (all but one its
engine may be making as it is aborted, as for any request stopped midway).
Tiers that cannot serve the call are left out (their context cannot hold the prompt and its
answer, or they do not serve its options, as an upstream asked for the prompt's logprobs), and so
are those whose engine cannot take it now (no worker of their model is up): the last tier that
can is the one that answers whatever its score; so does the first that can when the call only
scores its prompt (echo with max_tokens 0), as there is no answer to judge (the next, if its engine
fails or refuses it before its first token). Each tier reads the prompt with its own tokenizer
(gateway/generation.py Ask), so a route may mix local models and upstreams.

Every token a tier generated is billed, however the call ends: each tier goes into the caller's
list of attempts as soon as it is done with (kept, escalated, failed, or cut short because the
client left while it was judged), so the list survives a cascade that raises. A tier cut short
counts its prompt once its first chunk came, and its output so far."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec

from gateway.engine_client import AdapterCannotRun, EngineFailure, GenerationChunk, RequestRejected
from gateway.generation import Ask, Choice, HeldChunk, Tier
from routing.confidence import confidence
from routing.routes import CascadeRoute

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Attempt:
    """A tier that ran: how sure it was, the bar it had to clear, and the tokens it used (none for
    the tier that answers: its Generation counts them). A learned route's pick has the router's
    score of the prompt and threshold instead."""

    model: str
    score: float | None  # None when it was not judged: its engine failed, or the call ended
    threshold: float | None  # None for a tier that answers whatever its score, or not judged
    tokens_in: int
    tokens_out: int


@dataclass(frozen=True)
class CascadeOutcome:
    """The tier that answers: its stream replays what judging it consumed."""

    tier: Tier
    stream: AsyncIterator[GenerationChunk]


async def run_cascade(route: CascadeRoute, steps: list[tuple[int, Tier]], ask: Ask,
                      attempts: list[Attempt], *, streamed: bool, request_id: str,
                      tenant: str | None, guard: Callable[[Awaitable], Awaitable]) -> CascadeOutcome:
    """Run `route` for the one prompt of `ask` over `steps`: its tiers that can run the call
    (cheapest first), each with its index in the route's tiers. Each tier run goes into
    `attempts` (also when this raises); see the module docstring.

    `guard` wraps each wait on a judged tier (the caller cancels it when the client leaves).
    """
    fallback: _PassedOver | None = None
    try:
        for step, tier in steps:
            # The last tier that can serve the call answers: escalating into one that cannot
            # would end a call that an earlier tier could answer with a 400, after billing that
            # tier. A call that only scores its prompt has no answer to judge: the first tier
            # gives it.
            is_last = step == steps[-1][0]
            answers_whatever = is_last or ask.scores_prompt_only
            threshold = None if answers_whatever else route.threshold(step)
            [(prompt, options)] = ask.read(tier)
            if threshold is not None:  # judged on its logprobs
                options = msgspec.structs.replace(options, logprobs=options.logprobs or 0)
            stream = ask.generate(tier, prompt, options, request_id=f"{request_id}-{step}",
                                  tenant=tenant)
            chunks: list[GenerationChunk] = []  # NOTE: filled as they come, so a cut-off tier is billed
            if threshold is None:
                # Unless it is the last tier with none passed over to fall back on, this one
                # must start first (a whole answer: end first, as nothing reaches the client
                # before): if it fails before (its model's last worker just went down), the call
                # is the tier's held, or the next tier scores it (one that only scores its
                # prompt), rather than an error after billing the others.
                if (is_last and fallback is None) or await _first_chunks(
                        tier, stream, 1 if streamed else None, chunks, attempts, None, None,
                        guard):
                    attempts.append(Attempt(tier.model, None, None, 0, 0))  # counted when it finishes
                    return CascadeOutcome(tier, _replay(chunks, stream))
                if fallback is not None:
                    outcome, fallback = fallback.answer(attempts), None
                    return outcome
                continue  # a call that only scores its prompt: the next tier scores it
            limit = route.prefix_tokens if streamed else None
            if not await _first_chunks(tier, stream, limit, chunks, attempts, None, threshold,
                                      guard):
                continue  # the next tier is the fallback
            score = _score(route, tier, chunks, limit)
            if score is not None and score >= threshold:
                attempts.append(Attempt(tier.model, score, threshold, 0, 0))  # counted when it finishes
                return CascadeOutcome(tier, _replay(chunks, stream))
            attempts.append(Attempt(tier.model, score, threshold, *_used(chunks)))
            fallback, dropped = _surer(fallback, _PassedOver(tier, stream, chunks, score,
                                                             len(attempts) - 1))
            if dropped is not None:
                await dropped.drop(attempts)
        raise AssertionError("the last tier always answers")  # pragma: no cover
    finally:
        if fallback is not None:  # a later tier answers, or the call ended
            await fallback.drop(attempts)


class _PassedOver:
    """A tier escalated past for its score, its answer left running: it answers instead if the
    last tier fails before its first token. Meanwhile its answer is read on in the background:
    the engine makes it whether read or not, and each token it made is billed, however it ends
    (its answer's chunks once read were only those judged: the rest went unbilled)."""

    def __init__(self, tier: Tier, stream: AsyncIterator[GenerationChunk],
                 chunks: list[GenerationChunk], score: float | None, attempt: int):
        self.tier = tier
        self.chunks = chunks  # what judging it consumed, then what came while it was held
        self.score = score
        self.attempt = attempt  # its index in the call's attempts
        self._arrived = asyncio.Event()  # set when a chunk came or its answer ended
        self._stream = stream
        self._reading = asyncio.create_task(self._read_on(stream))

    async def _read_on(self, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            if not (self.chunks and self.chunks[-1].finished):
                async for chunk in stream:
                    self.chunks.append(HeldChunk.of(chunk))
                    self._arrived.set()
                    if chunk.finished:
                        break
        finally:
            self._arrived.set()
            await stream.aclose()  # aborts the engine request if its answer is not over

    @property
    def has_failed(self) -> bool:
        """Whether its answer ended early with its engine's failure (as it was read on)."""
        reading = self._reading
        return reading.done() and not reading.cancelled() and reading.exception() is not None

    def answer(self, attempts: list[Attempt]) -> CascadeOutcome:
        # NOTE: its tokens so far are its answer's now, counted when that finishes.
        attempts[self.attempt] = dataclasses.replace(attempts[self.attempt], tokens_in=0,
                                                     tokens_out=0)
        return CascadeOutcome(self.tier, self._rest())

    async def drop(self, attempts: list[Attempt]) -> None:
        """Abort its answer, its attempt billed every token read of it."""
        await self._stop_reading()
        tokens_in, tokens_out = _used(self.chunks)
        attempts[self.attempt] = dataclasses.replace(attempts[self.attempt], tokens_in=tokens_in,
                                                     tokens_out=tokens_out)

    async def _rest(self) -> AsyncIterator[GenerationChunk]:
        """Its answer: the chunks read so far, then the rest as they come."""
        sent = 0
        try:
            while True:
                while sent < len(self.chunks):
                    yield self.chunks[sent]
                    sent += 1
                if self._reading.done():
                    self._reading.result()  # raises what ended its answer early (its engine failed)
                    return
                self._arrived.clear()
                await self._arrived.wait()
        finally:
            await self._stop_reading()

    async def _stop_reading(self) -> None:
        self._reading.cancel()  # NOTE: does nothing to a read already over
        # An engine failure that ended the read is the call's only once it answers (`_rest`).
        await asyncio.gather(self._reading, return_exceptions=True)
        # NOTE: a read cancelled before it began (dropped as soon as held: a later tier was
        # surer) never ran its `finally`; closing a closed stream does nothing.
        await self._stream.aclose()


def _surer(held: _PassedOver | None, new: _PassedOver) -> tuple[_PassedOver, _PassedOver | None]:
    """Of the tier held to fall back on and one just passed over, the one to hold and the one to
    drop: the surer of its answer (one that could not be judged, or whose engine failed since, is
    the least sure; on a tie the later tier, a stronger model)."""
    def sureness(tier: _PassedOver) -> float:
        return -math.inf if tier.score is None or tier.has_failed else tier.score

    if held is None:
        return new, None
    return (new, held) if sureness(new) >= sureness(held) else (held, new)


def _score(route: CascadeRoute, tier: Tier, chunks: list[GenerationChunk],
           limit: int | None) -> float | None:
    """How sure `tier` is of the answer in `chunks` (by its first `limit` tokens when set); None
    for an answer without its logprobs (an upstream that sends none), which cannot be judged:
    it is escalated, not taken as sure."""
    logprobs = [lp.logprob for chunk in chunks for lp in chunk.logprobs]
    if len(logprobs) < sum(len(chunk.token_ids) for chunk in chunks):
        logger.warning("route %s: %s answered without logprobs, so it cannot be judged; "
                       "escalating", route.name, tier.model)
        return None
    return confidence(logprobs[:limit] if limit else logprobs, route.measure, route.quantile)


async def run_with_fallback(tiers: list[Tier], ask: Ask, attempts: list[Attempt], *,
                            score: float | None, threshold: float | None, request_id: str,
                            tenant: str | None,
                            guard: Callable[[Awaitable], Awaitable]) -> CascadeOutcome:
    """Run the one prompt of `ask` on the first of `tiers` (those that can serve it),
    unless its engine fails or refuses before the first token: then on the next (a learned
    route's other tier). Each tier run goes into `attempts`, the one that answers too; the first
    with `score` and `threshold`, what the router judged of the prompt to pick it (None when
    the pick cannot serve the call: it was left out, so the first tier is not the one judged)."""
    for step, tier in enumerate(tiers):
        judged = (score, threshold) if step == 0 else (None, None)
        [(prompt, options)] = ask.read(tier)
        stream = ask.generate(tier, prompt, options, request_id=f"{request_id}-{step}",
                              tenant=tenant)
        chunks: list[GenerationChunk] = []
        if step == len(tiers) - 1 or await _first_chunks(tier, stream, 1, chunks, attempts,
                                                         *judged, guard):
            attempts.append(Attempt(tier.model, *judged, 0, 0))  # counted when it finishes
            return CascadeOutcome(tier, _replay(chunks, stream))
    raise AssertionError("the last tier always answers")  # pragma: no cover


async def _first_chunks(tier: Tier, stream: AsyncIterator[GenerationChunk], num_tokens: int | None,
                        chunks: list[GenerationChunk], attempts: list[Attempt], score: float | None,
                        threshold: float | None, guard: Callable[[Awaitable], Awaitable]) -> bool:
    """Collect the first `num_tokens` tokens of `tier`'s answer (all when None) into `chunks`;
    False, with the tier added to `attempts` (with `score` and `threshold`) and its request
    aborted, if its engine failed or refused the request (the next tier takes over). Raises what
    else ended the wait (the client left, the call's adapter cannot run), after the same."""
    try:
        await guard(_collect(stream, num_tokens, chunks))
        return True
    except BaseException as error:
        attempts.append(Attempt(tier.model, score, threshold, *_used(chunks)))
        await stream.aclose()  # aborts the engine request
        if isinstance(error, (EngineFailure, RequestRejected)) and not isinstance(error, AdapterCannotRun):
            return False
        raise


async def _collect(stream: AsyncIterator[GenerationChunk], num_tokens: int | None,
                   chunks: list[GenerationChunk]) -> None:
    """Add chunks to `chunks` until `num_tokens` tokens (all of them when None) or the end of the
    answer."""
    count = 0
    async for chunk in stream:
        chunks.append(HeldChunk.of(chunk))
        count += len(chunk.token_ids)
        if chunk.finished or (num_tokens is not None and count >= num_tokens):
            break


def _used(chunks: list[GenerationChunk]) -> tuple[int, int]:
    """The prompt and output tokens an answer has used, by the chunks it produced, counted as a
    call's choice counts them (Choice): its prompt once the engine read it (the first chunk came)."""
    choice = Choice(0, 0)
    for chunk in chunks:
        choice.add(chunk)
    return choice.num_prompt_tokens, choice.num_output_tokens


async def _replay(chunks: list[GenerationChunk],
                  rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
    """The chunks judging consumed, then the rest of the same engine stream."""
    try:
        for chunk in chunks:
            yield chunk
        if chunks and chunks[-1].finished:
            return
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()
