"""AsyncEngine on the demo model: concurrent streams, rejection, and abort on cancellation."""

import asyncio
import threading
import time

import pytest
import torch

from engine.async_engine import AsyncEngine, EngineStepError
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.request import SamplingParams
from kernels import sgmv_cpu
from tests.helpers import TINY_DIMS, save_peft_adapter, torch_threads


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory):
    from engine.demo import ensure_demo_model
    return ensure_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture
def async_engine(demo_folder):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(demo_folder), num_kv_blocks=256),
                                   show_progress=False))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, prompt, params, **kwargs):
    tokens, text, last = [], "", None
    async for output in engine.generate(prompt, params, **kwargs):
        tokens += output.new_token_ids
        text += output.new_text
        last = output
    return tokens, text, last


def test_concurrent_streams_equal_the_offline_api(demo_folder, async_engine):
    prompts = ["alpha", "a much longer prompt " * 5, "ü"]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    offline = LLM(str(demo_folder), show_progress=False).generate(prompts, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(collect(async_engine, p, params) for p in prompts))

    results = asyncio.run(main())
    for (tokens, text, last), expected in zip(results, offline):
        assert tokens == expected.output_token_ids
        assert text == expected.text
        assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 9


def test_invalid_request_raises_and_engine_keeps_serving(async_engine):
    async def main():
        with pytest.raises(ValueError, match="shorten the prompt"):
            await collect(async_engine, list(range(5)) * 1000, SamplingParams())
        return await collect(async_engine, "ok", SamplingParams(max_tokens=3, ignore_eos=True))

    tokens, _, last = asyncio.run(main())
    assert len(tokens) == 3 and last.finished


def test_cancelling_the_consumer_aborts_the_request(async_engine):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in async_engine.generate("long", SamplingParams(max_tokens=1000, ignore_eos=True),
                                                 request_id="victim"):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            await asyncio.sleep(0.02)
            metrics = async_engine.metrics()
            if metrics.num_running == 0 and metrics.kv_blocks_used == 0:
                return metrics
        return async_engine.metrics()

    metrics = asyncio.run(main())
    assert metrics.num_running == 0 and metrics.num_waiting == 0
    assert metrics.kv_blocks_used == 0
    assert metrics.num_generation_tokens < 1000


def test_abort_ends_the_requests_stream_with_an_abort_output(async_engine):
    async def main():
        started = asyncio.Event()
        outputs = []

        async def consume():
            async for output in async_engine.generate(
                    "long", SamplingParams(max_tokens=1000, ignore_eos=True), request_id="aborted"):
                outputs.append(output)
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        async_engine.abort("aborted")
        # Its consumer waited for good: the request left the engine, its stream got nothing.
        async with asyncio.timeout(30):
            await task
        return outputs

    outputs = asyncio.run(main())
    last = outputs[-1]
    assert last.finished and last.finish_reason == "abort" and last.new_token_ids == []
    assert last.num_output_tokens == sum(len(o.new_token_ids) for o in outputs) < 1000
    metrics = async_engine.metrics()
    assert (metrics.num_running, metrics.num_waiting, metrics.kv_blocks_used) == (0, 0, 0)


def test_a_consumer_whose_event_loop_closed_does_not_kill_the_engine(async_engine):
    async def start():
        stream = async_engine.generate("orphan", SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        return stream

    loop = asyncio.new_event_loop()
    orphan = loop.run_until_complete(start())
    loop.close()  # the consumer vanishes without closing its stream
    tokens, _, last = asyncio.run(collect(async_engine, "ok", SamplingParams(max_tokens=3, ignore_eos=True)))
    assert len(tokens) == 3 and last.finished
    # The metrics snapshot is published just after outputs are delivered: give it a moment.
    for _ in range(100):
        metrics = async_engine.metrics()
        if metrics.num_running == 0:
            break
        time.sleep(0.02)
    assert metrics.num_running == 0 and metrics.kv_blocks_used == 0  # the orphan was aborted
    assert metrics.num_generation_tokens < 500
    del orphan


@pytest.mark.parametrize("while_adding", [False, True])
def test_a_request_cancelled_before_the_engine_took_it_leaves_the_engine_serving(async_engine, while_adding):
    """A caller that goes away before the engine thread took its request (a disconnect, a failed
    sibling prompt) leaves nothing behind, and the engine thread keeps running. With
    `while_adding`, it goes away while the thread is adding it: too late to take it back, so the
    request is aborted instead."""
    gate, inner = threading.Event(), async_engine.engine
    gated = "add_request" if while_adding else "step"
    original = getattr(inner, gated)

    def wait_then(*args, **kwargs):
        gate.wait()
        return original(*args, **kwargs)

    setattr(inner, gated, wait_then)
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def main():
        first = None
        if not while_adding:  # the thread is inside a step of this one when the others arrive
            first = asyncio.create_task(collect(async_engine, "first", params))
            await asyncio.sleep(0.2)
        long = SamplingParams(max_tokens=2000, ignore_eos=True)  # runs on unless aborted
        gone = [asyncio.create_task(collect(async_engine, "gone", long)) for _ in range(3)]
        await asyncio.sleep(0.2)
        for task in gone:
            task.cancel()
        gate.set()
        if first is not None:
            assert len((await asyncio.wait_for(first, 30))[0]) == 3
        return await asyncio.wait_for(collect(async_engine, "after", params), 30)

    tokens, _, last = asyncio.run(main())
    assert len(tokens) == 3 and last.finished
    deadline = time.monotonic() + 1
    while inner.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not inner.has_unfinished_requests()
    assert inner.kv_manager.num_free_blocks == inner.kv_manager.num_blocks


def _break_a_step_when_set(engine: LLMEngine) -> threading.Event:
    """An event that, once set, makes the engine's next step raise "the step broke" (then clears)."""
    step, break_next_step = engine.step, threading.Event()

    def step_that_breaks():
        if break_next_step.is_set():
            break_next_step.clear()
            raise RuntimeError("the step broke")
        return step()

    engine.step = step_that_breaks
    return break_next_step


def test_a_failed_step_fails_every_stream_even_if_an_abort_fails_too(async_engine):
    """A step that raises fails the requests in flight, and one whose abort raises as well (its
    state broken by the failure) fails like the rest: the engine thread lives on and serves."""
    inner = async_engine.engine
    break_next_step = _break_a_step_when_set(inner)
    abort = inner.abort_request

    def abort_that_fails_for_broken(request_id):
        if request_id == "broken":
            raise ValueError("list.remove(x): x not in list")
        return abort(request_id)

    inner.abort_request = abort_that_fails_for_broken
    long = SamplingParams(max_tokens=2000, ignore_eos=True)

    async def main():
        tasks = [asyncio.create_task(collect(async_engine, "a", long, request_id=request_id))
                 for request_id in ("broken", "other")]
        while async_engine.metrics().num_running < 2:
            await asyncio.sleep(0.01)
        break_next_step.set()
        failures = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        short = SamplingParams(max_tokens=3, ignore_eos=True)
        after = await asyncio.wait_for(collect(async_engine, "after", short), 10)
        return failures, after

    failures, (tokens, _, last) = asyncio.run(main())
    assert [str(f) for f in failures] == [f"request {request_id} failed in the engine: the step broke"
                                          for request_id in ("broken", "other")]
    assert all(isinstance(f, EngineStepError) for f in failures)
    assert len(tokens) == 3 and last.finished


def test_the_stats_no_longer_count_a_request_by_the_time_its_end_is_delivered(async_engine,
                                                                             monkeypatch):
    """Published after its end went out, the stats could still count a request its caller had
    seen end (a gateway's test read num_waiting 1 after a refused call's 500)."""
    from engine import async_engine as module

    seen_at_end = []
    put = module._Stream.put

    def put_noting_the_stats(stream, item):
        if isinstance(item, Exception) or item.finished:
            stats = async_engine.metrics()
            seen_at_end.append((stats.num_running, stats.num_waiting))
        return put(stream, item)

    monkeypatch.setattr(module._Stream, "put", put_noting_the_stats)
    break_next_step = _break_a_step_when_set(async_engine.engine)

    async def main():
        await collect(async_engine, "a", SamplingParams(max_tokens=3, ignore_eos=True))
        failed = asyncio.create_task(collect(async_engine, "b", SamplingParams(max_tokens=2000,
                                                                          ignore_eos=True)))
        while async_engine.metrics().num_running < 1:
            await asyncio.sleep(0.01)
        break_next_step.set()
        with pytest.raises(EngineStepError):
            await asyncio.wait_for(failed, 10)

    asyncio.run(main())
    assert seen_at_end == [(0, 0), (0, 0)]


def test_a_request_sent_as_the_engine_shuts_down_is_refused_not_left_waiting(async_engine):
    """A request sent while the engine thread runs a step, shutdown() called meanwhile: the
    thread left its loop without reading its inbox, and the caller waited for good."""
    inner = async_engine.engine
    step, in_step, finish_step = inner.step, threading.Event(), threading.Event()

    def held_step():
        in_step.set()
        finish_step.wait(10)
        return step()

    inner.step = held_step
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def main():
        running = asyncio.create_task(collect(async_engine, "a", params))
        while not in_step.is_set():
            await asyncio.sleep(0.01)
        late = asyncio.create_task(collect(async_engine, "b", params))
        await asyncio.sleep(0.1)  # sent: in the inbox the held step keeps the thread from
        stopping = threading.Thread(target=async_engine.shutdown)
        stopping.start()
        while not async_engine._stopped:
            await asyncio.sleep(0.01)
        finish_step.set()
        results = await asyncio.wait_for(asyncio.gather(running, late, return_exceptions=True), 10)
        stopping.join(10)
        return results

    running, late = asyncio.run(main())
    assert isinstance(running, EngineStepError) and "shut down" in str(running)
    assert isinstance(late, RuntimeError) and str(late) == "the engine was shut down"
    with pytest.raises(RuntimeError, match="the engine is shut down"):
        asyncio.run(collect(async_engine, "after", params))


def test_a_consumer_leaving_its_stream_after_shutdown_is_not_given_an_error(async_engine):
    # Its abort was refused ("the engine is shut down") and replaced the GeneratorExit or
    # CancelledError its leaving raised: an error from aclose(), or no cancellation.
    async def main():
        stream = async_engine.generate("a", SamplingParams(max_tokens=50, ignore_eos=True))
        first = await stream.__anext__()
        await asyncio.to_thread(async_engine.shutdown)
        await stream.aclose()
        return first

    assert not asyncio.run(main()).finished


def test_the_engine_thread_keeps_its_thread_count_through_another_engines_lora_decode(demo_folder):
    """Another engine's LoRA decode narrows torch to one thread for a moment (kernels/sgmv_cpu.py):
    this engine's thread, starting inside that window, still runs every step on the thread count
    the engine was built with, then and after."""
    with torch_threads(2):
        inner = LLMEngine(EngineConfig(model=str(demo_folder), num_kv_blocks=256), show_progress=False)
    step, seen = inner.step, []  # the step thread's intra-op threads, after each step

    def recording_step():
        outputs = step()
        seen.append(torch.get_num_threads())
        return outputs

    inner.step = recording_step
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with sgmv_cpu._one_thread():
        engine = AsyncEngine(inner)
        asyncio.run(collect(engine, "first", params))
    asyncio.run(collect(engine, "after", params))
    engine.shutdown()
    assert len(seen) >= 6 and set(seen) == {2}


def test_adapter_checks_keep_the_engine_s_thread_count_whatever_window_their_thread_starts_in(
        demo_folder, tmp_path, monkeypatch):
    """An upload's adapter is checked on an executor thread, which may make its first torch call
    inside another engine's one-thread LoRA decode window: it still checks on the engine's count."""
    from adapters import AdapterConfig
    from engine.demo import demo_config
    from gateway import local_engine

    with torch_threads(2):
        client = local_engine.LocalEngineClient.load(EngineConfig(
            model=str(demo_folder), num_kv_blocks=64, lora=AdapterConfig(max_lora_rank=8)),
            show_progress=False)
    save_peft_adapter(tmp_path / "adapter", model_overrides={
        name: getattr(demo_config(), name) for name in TINY_DIMS}, r=4, lora_alpha=8)
    seen, load_adapter = [], local_engine.load_adapter

    def recording_load(*args):
        seen.append(torch.get_num_threads())
        return load_adapter(*args)

    monkeypatch.setattr(local_engine, "load_adapter", recording_load)
    try:
        with sgmv_cpu._one_thread():  # asyncio.run's new loop starts its executor thread inside
            asyncio.run(client.check_adapter(str(tmp_path / "adapter")))
        asyncio.run(client.check_adapter(str(tmp_path / "adapter")))
    finally:
        client.close()
    assert seen == [2, 2]
