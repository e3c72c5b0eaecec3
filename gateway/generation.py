"""Generation: the engine requests behind one API call, run at once and merged as they stream.

Each engine request is pumped by its own task into one queue, so the n choices of a call decode in
the same engine batch. Cancelling the tasks (close(), or the HTTP task being cancelled when the
client disconnects) closes the engine streams, which aborts the requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.engine_client import EngineFailure, GenerationChunk, TokenLogprob
from gateway.metrics import LatencyMetrics


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
    last_chunk_at: float | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.text += chunk.text
        self.logprobs.extend(chunk.logprobs)
        self.finish_reason = chunk.finish_reason
        self.num_prompt_tokens = chunk.num_prompt_tokens
        self.num_cached_tokens = chunk.num_cached_tokens


class Generation:
    """Runs `streams` (choice i comes from prompt `prompt_indices[i]`) and merges their chunks.

    Latencies (to the first token, between tokens, to the last) are observed as chunks arrive.
    """

    def __init__(self, streams: list[AsyncIterator[GenerationChunk]], prompt_indices: list[int],
                 latency: LatencyMetrics, arrived_at: float):
        self.choices = [Choice(i, p) for i, p in enumerate(prompt_indices)]
        self._latency = latency
        self._arrived_at = arrived_at  # time.monotonic() when the HTTP request came in
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: list[tuple[int, GenerationChunk, float]] = []
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
            self._buffer.append((index, item, at))

    async def __aiter__(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """(choice index, chunk) in arrival order, each already added to `self.choices`."""
        for index, chunk, at in self._buffer:
            yield index, self._record(index, chunk, at)
        self._buffer.clear()
        while self._num_finished < len(self.choices):
            index, item, at = await self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise EngineFailure(str(item)) from item
            yield index, self._record(index, item, at)

    def close(self) -> None:
        """Abort the requests still running (a no-op for finished ones)."""
        for task in self._tasks:
            task.cancel()

    @property
    def is_done(self) -> bool:
        """Whether every engine request has finished."""
        return self._num_finished == len(self.choices)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens of the call, each prompt counted once however many choices it has."""
        per_prompt = {c.prompt_index: c.num_prompt_tokens for c in self.choices}
        return sum(per_prompt.values())

    @property
    def num_cached_tokens(self) -> int:
        per_prompt = {c.prompt_index: c.num_cached_tokens for c in self.choices}
        return sum(per_prompt.values())

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def _record(self, index: int, chunk: GenerationChunk, now: float) -> GenerationChunk:
        choice = self.choices[index]
        if choice.last_chunk_at is None:
            self._latency.time_to_first_token.observe(now - self._arrived_at)
        elif chunk.token_ids:
            self._latency.time_per_output_token.observe((now - choice.last_chunk_at)
                                                        / len(chunk.token_ids))
        choice.last_chunk_at = now
        choice.add(chunk)
        if chunk.finished:
            self._num_finished += 1
            self._latency.e2e_request_latency.observe(now - self._arrived_at)
        return chunk

    async def _pump(self, index: int, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                self._queue.put_nowait((index, chunk, time.monotonic()))
        except Exception as error:  # handed to the consumer, which decides what the client sees
            self._queue.put_nowait((index, error, time.monotonic()))
