"""Running a cascade route: each tier answers unless its confidence is below the route's threshold.

A judged tier runs with logprobs on. A whole (non-streamed) answer is judged on all its tokens;
a streamed one on its first `prefix_tokens`, before any byte reaches the client, and if it is
kept the stream goes on from there with nothing run twice. An escalated tier is aborted, and its
tokens are still billed. A tier whose engine fails is escalated past too (and so is one that
refuses the request, say for a prompt longer than its context), so the last tier is the fallback;
only the last tier's failure reaches the client. Each tier reads the prompt with its own tokenizer
(gateway/generation.py Ask), so a route may mix local models and upstreams.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from gateway.engine_client import EngineFailure, GenerationChunk, RequestRejected
from gateway.generation import Ask, Tier
from routing.confidence import confidence
from routing.routes import CascadeRoute


@dataclass(frozen=True)
class Attempt:
    """A tier that ran: how sure it was, the bar it had to clear, and the tokens it used."""

    model: str
    score: float | None  # None when its engine failed before it could be judged
    threshold: float | None  # None for the last tier, which answers whatever its score
    tokens_in: int
    tokens_out: int


@dataclass
class CascadeOutcome:
    """The tier that answers (its stream replays what judging it consumed) and every attempt."""

    tier: Tier
    stream: AsyncIterator[GenerationChunk]
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def escalated(self) -> bool:
        return len(self.attempts) > 1


async def run_cascade(route: CascadeRoute, tiers: list[Tier], ask: Ask, *, streamed: bool,
                      request_id: str, tenant: str | None,
                      guard: Callable[[Awaitable], Awaitable]) -> CascadeOutcome:
    """Run `route` over `tiers` (cheapest first) for the one prompt of `ask`; see the module
    docstring.

    `guard` wraps each wait on a judged tier (the caller cancels it when the client leaves).
    """
    attempts: list[Attempt] = []
    for step, tier in enumerate(tiers):
        threshold = route.threshold(step)
        [(prompt, options)] = ask.read(tier)
        if threshold is not None:  # judged on its logprobs
            options = msgspec.structs.replace(options, logprobs=options.logprobs or 0)
        stream = ask.generate(tier, prompt, options, request_id=f"{request_id}-{step}",
                              tenant=tenant)
        if threshold is None:
            attempts.append(Attempt(tier.model, None, None, 0, 0))  # counted when it finishes
            return CascadeOutcome(tier, stream, attempts)
        limit = route.prefix_tokens if streamed else None
        try:
            chunks = await guard(_collect(stream, limit))
        except (EngineFailure, RequestRejected):  # the next tier is the fallback
            await stream.aclose()
            attempts.append(Attempt(tier.model, None, threshold, 0, 0))
            continue
        except BaseException:
            await stream.aclose()
            raise
        logprobs = [lp.logprob for chunk in chunks for lp in chunk.logprobs]
        score = confidence(logprobs[:limit] if limit else logprobs, route.measure, route.quantile)
        used_in = chunks[-1].num_prompt_tokens if chunks else len(prompt)
        used_out = sum(len(chunk.token_ids) for chunk in chunks)
        if score >= threshold:
            attempts.append(Attempt(tier.model, score, threshold, 0, 0))  # counted when it finishes
            return CascadeOutcome(tier, _replay(chunks, stream), attempts)
        await stream.aclose()  # aborts the engine request
        attempts.append(Attempt(tier.model, score, threshold, used_in, used_out))
    raise AssertionError("the last tier always answers")  # pragma: no cover


async def _collect(stream: AsyncIterator[GenerationChunk],
                   num_tokens: int | None) -> list[GenerationChunk]:
    """Chunks until `num_tokens` tokens (all of them when None) or the end of the answer."""
    chunks, count = [], 0
    async for chunk in stream:
        chunks.append(chunk)
        count += len(chunk.token_ids)
        if chunk.finished or (num_tokens is not None and count >= num_tokens):
            break
    return chunks


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
