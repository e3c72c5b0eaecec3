"""Generation: the engine requests of one call, merged; what it counts when a call ends early;
and Ask, how a tier reads a call's prompts."""

import asyncio

import pytest

from gateway.engine_client import GenerationChunk, RequestRejected, SamplingOptions
from gateway.generation import Ask, Generation, Prompt, Tier
from gateway.metrics import GatewayMetrics
from tests.conftest import DEMO_MODEL


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


async def test_a_call_stopped_while_it_hands_out_first_chunks_counts_each_chunk_once():
    """A stream cut (a shutdown's deadline) while it sends the first chunks of its choices: those
    sent were counted again when the call closed, and billed twice."""
    produced: list[int] = []
    streams = [answer([65 + i], produced) for i in range(4)]  # four choices of one token each
    generation = Generation(streams, [0] * 4, GatewayMetrics().latency("m"), arrived_at=0.0)
    await generation.start()
    reading = generation.__aiter__()
    await anext(reading)  # one first chunk sent; the reader is stopped there
    await anext(reading)
    generation.close()
    await reading.aclose()
    assert generation.num_output_tokens == len(produced) == 4
    assert sorted(c.text for c in generation.choices) == ["A", "B", "C", "D"]
    assert generation.is_done


async def test_reading_stops_at_the_first_prompt_too_long_for_the_context(demo_engine):
    """A prompt the model's context cannot hold is refused as the engine refuses it, as soon as
    it is tokenized: the prompts after it are never read (a call of many over-long prompts
    costs one prompt's tokenizing)."""
    def never_read(engine):
        raise AssertionError("a prompt after the one refused was read")

    too_long = "x" * demo_engine.max_model_len  # <s> and a token a byte: one token too many
    ask = Ask([Prompt.of_text("hi"), Prompt.of_text(too_long), Prompt(never_read)],
              SamplingOptions(), max_tokens=1)
    with pytest.raises(RequestRejected) as refused:
        ask.read(Tier(DEMO_MODEL, demo_engine))
    with pytest.raises(RequestRejected) as by_engine:
        async for _ in demo_engine.generate(demo_engine.tokenize(too_long), SamplingOptions(),
                                            request_id="too-long"):
            pass
    assert (str(refused.value), refused.value.param) == (str(by_engine.value), "prompt")
    assert "shorten the prompt" in str(refused.value)
