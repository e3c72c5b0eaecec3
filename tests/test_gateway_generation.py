"""Generation: the engine requests of one call, merged; what it counts when a call ends early."""

import asyncio

import pytest

from gateway.engine_client import GenerationChunk
from gateway.generation import Generation
from gateway.metrics import GatewayMetrics


pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def chunk(token: int, *, done: bool = False) -> GenerationChunk:
    return GenerationChunk(token_ids=[token], text=chr(token), logprobs=[], finished=done,
                           finish_reason="length" if done else None, num_prompt_tokens=3,
                           num_output_tokens=0, num_cached_tokens=0)


async def answer(tokens: list[int], produced: list[int]):
    """An engine stream of `tokens`, noting in `produced` each token it handed out."""
    for i, token in enumerate(tokens):
        produced.append(token)
        yield chunk(token, done=i == len(tokens) - 1)
        await asyncio.sleep(0)


async def test_chunks_produced_but_never_read_are_still_counted_when_the_call_closes():
    """A client that leaves (or a choice that fails) closes the call with chunks still queued:
    the engine generated them, so usage, which bills them, counts them."""
    produced: list[int] = []
    streams = [answer(list(range(65, 75)), produced), answer(list(range(97, 100)), produced)]
    generation = Generation(streams, [0, 0], GatewayMetrics().latency("m"), arrived_at=0.0)
    await generation.start()  # the first chunk of each, kept but not read
    for _ in range(4):  # the engine goes on while nobody reads
        await asyncio.sleep(0)
    assert len(produced) > 2
    generation.close()
    await asyncio.sleep(0)
    assert generation.num_output_tokens == len(produced)
    assert generation.num_prompt_tokens == 3  # one prompt, counted once for its two choices
    assert [c.text for c in generation.choices] == \
        ["".join(chr(t) for t in produced if t < 97), "".join(chr(t) for t in produced if t >= 97)]
    assert generation.choices[1].finish_reason == "length"  # its three tokens all came
