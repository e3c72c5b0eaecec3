"""Multi-LoRA in one continuous batch, against PEFT's own greedy output for each adapter."""

import collections
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from adapters.config import AdapterConfig
from engine.config import EngineConfig
from engine.engine import _IDLE_LOAD_WAIT_S, LLMEngine
from engine.lora import LoraRequest
from engine.request import SamplingParams
from store.blobs import digest_files
from tests.helpers import (TEST_DEVICE, make_hf_model, num_live_packed_adapters, random_prompts,
                           save_hf_model, save_peft_adapter)

NUM_NEW_TOKENS = 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS = [  # different ranks, alphas, rslora and targets
    dict(r=4, lora_alpha=8, target_modules=ATTENTION),
    dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
    dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    dict(r=4, lora_alpha=4, target_modules=["q_proj", "up_proj", "down_proj"], layers_to_transform=[1]),
    dict(r=8, lora_alpha=32, target_modules=["gate_proj", "up_proj"]),
    dict(r=2, lora_alpha=2, target_modules=r".*\.(k|o)_proj"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_hf_model(make_hf_model("llama"), root / "base")
    prompts = random_prompts([5, 23, 9, 41, 14, 30], 384, seed=4)
    adapters, references = [], {}
    for i, kwargs in enumerate(ADAPTERS):
        folder = root / f"adapter{i}"
        peft_model = save_peft_adapter(folder, "llama", seed=10 + i, **kwargs)
        adapters.append(LoraRequest(digest_files(folder), str(folder)))
        references[i] = [_peft_greedy(peft_model, p) for p in prompts]
    base_model = make_hf_model("llama")
    references[None] = [_peft_greedy(base_model, p) for p in prompts]
    return base, prompts, adapters, references


def _peft_greedy(model, prompt):
    input_ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask, or generate reads a 0 in the prompt as padding
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def lora_engine(base, engine_options: dict | None = None, **lora_options) -> LLMEngine:
    """An engine over `base` serving adapters of rank up to 16; `lora_options` go to AdapterConfig,
    `engine_options` to EngineConfig."""
    return LLMEngine(EngineConfig(model=str(base), device=TEST_DEVICE, **(engine_options or {}),
                                  lora=AdapterConfig(max_lora_rank=16, **lora_options)),
                     show_progress=False)


def greedy(max_tokens: int = NUM_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_mixed(engine, prompts, adapters, assignment, arrivals):
    params = greedy()
    tokens = {i: [] for i in range(len(assignment))}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, (adapter_index, prompt_index) in enumerate(assignment):
            if arrivals[i] == step:
                lora = adapters[adapter_index] if adapter_index is not None else None
                engine.add_request(str(i), prompts[prompt_index], params, lora=lora)
        for output in engine.step():
            assert output.finish_reason != "error", output.error
            tokens[int(output.request_id)] += output.new_token_ids
        step += 1
    return tokens


def test_base_and_three_adapters_in_one_batch_match_peft(setup):
    base, prompts, adapters, references = setup
    engine = lora_engine(base, dict(block_size=4), max_gpu_adapters=4, num_load_threads=0)
    assignment = [(a, p) for p in range(4) for a in (None, 0, 1, 2)]
    tokens = run_mixed(engine, prompts, adapters, assignment, [i // 4 for i in range(len(assignment))])
    for i, (adapter_index, prompt_index) in enumerate(assignment):
        assert tokens[i] == references[adapter_index][prompt_index], (adapter_index, prompt_index)
    # The adapters really changed the output (PEFT's B is random here, not zero).
    assert references[0][0] != references[None][0] and references[1][0] != references[None][0]
    metrics = engine.metrics()
    assert metrics.adapter_page_ins == 3 and metrics.adapter_evictions == 0
    assert metrics.adapter_disk_loads == 3  # each adapter read from its files once
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_two_slots_six_adapters_stay_exact_and_count_evictions(setup):
    base, prompts, adapters, references = setup
    engine = lora_engine(base, dict(block_size=4, max_num_seqs=6), max_gpu_adapters=2,
                         max_cpu_adapters=3, num_load_threads=0)
    assignment = [(a, (a + k) % len(prompts)) for k in range(2) for a in range(6)] + [(None, 3)]
    tokens = run_mixed(engine, prompts, adapters, assignment, [0] * len(assignment))
    for i, (adapter_index, prompt_index) in enumerate(assignment):
        assert tokens[i] == references[adapter_index][prompt_index], (adapter_index, prompt_index)
    metrics = engine.metrics()
    assert metrics.adapters_resident == 2
    assert metrics.adapter_page_ins >= 6 and metrics.adapter_evictions == metrics.adapter_page_ins - 2
    # Three host entries for six adapters: every adapter was read from its files at least once.
    assert metrics.adapter_disk_loads >= 6
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_adapter_requests_do_not_block_base_requests(setup):
    base, prompts, adapters, _ = setup
    engine = lora_engine(base, max_gpu_adapters=1, num_load_threads=0)
    params = greedy(30)
    engine.add_request("a0", prompts[0], params, lora=adapters[0])
    engine.add_request("a1", prompts[1], params, lora=adapters[1])
    engine.add_request("base", prompts[2], params)
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"a0", "base"}  # a1 waits for the only slot; base goes ahead of it


def test_prefix_cache_is_not_shared_across_adapters(setup):
    base, prompts, adapters, references = setup
    engine = lora_engine(base, dict(block_size=4), max_gpu_adapters=2, num_load_threads=0)
    tokens = run_mixed(engine, prompts, adapters, [(None, 3), (0, 3), (0, 3)], [0, 10, 20])
    assert tokens[1] == tokens[2] == references[0][3]
    assert tokens[0] == references[None][3]
    # Only the second request of adapter 0 hit the cache: the base run's blocks are not its own.
    assert engine.metrics().prefix_cache_hit_tokens == (len(prompts[3]) - 1) // 4 * 4


def test_lora_request_on_an_engine_without_lora_is_refused(setup):
    base, prompts, adapters, _ = setup
    engine = LLMEngine(EngineConfig(model=str(base), device=TEST_DEVICE), show_progress=False)
    with pytest.raises(ValueError, match="without LoRA support"):
        engine.add_request("x", prompts[0], SamplingParams(), lora=adapters[0])
    assert not engine.has_unfinished_requests()


def test_offline_generate_names_adapters_by_folder_and_says_why_a_request_failed(setup, tmp_path,
                                                                                   monkeypatch):
    """LLM.generate: LoraRequest.of_folder names an adapter by its files, as the engine checks
    them; an id named freely (as vLLM's LoRARequest takes) is refused at once, saying so (its
    requests once failed as if the files were damaged, and the result said nothing of why)."""
    from engine.llm import LLM

    base, prompts, adapters, references = setup
    llm = LLM(str(base), device=TEST_DEVICE, show_progress=False, lora=AdapterConfig(max_lora_rank=16))
    folders = [adapters[0].path, adapters[1].path]
    outputs = llm.generate(prompts[:2], greedy(), use_tqdm=False,
                           lora=[LoraRequest.of_folder(f) for f in folders])
    assert [o.output_token_ids for o in outputs] == [references[0][0], references[1][1]]
    assert [o.error for o in outputs] == [None, None]
    # Files checked once are not hashed again on every call while they stay as they were.
    hashed = []
    monkeypatch.setattr("engine.llm.digest_files", lambda folder: hashed.append(folder) or
                        digest_files(folder))
    copy = LoraRequest.of_folder(shutil.copytree(adapters[0].path, tmp_path / "copy"))
    for _ in range(2):
        assert llm.generate(prompts[:1], greedy(), use_tqdm=False, lora=copy)[0].output_token_ids \
            == references[0][0]
        llm.generate(prompts[:1], greedy(), use_tqdm=False, lora=LoraRequest.of_folder(folders[1]))
    assert hashed == [Path(copy.path)]
    with open(Path(copy.path) / "adapter_config.json", "a") as config:  # rewritten on disk
        config.write("\n")
    with pytest.raises(ValueError, match="is not the digest of the files"):
        llm.generate(prompts[:1], greedy(), use_tqdm=False, lora=copy)
    with pytest.raises(ValueError, match=r"the adapter id 'my-adapter' is not the digest of the files"
                                         r" in .*: LoraRequest.of_folder\(path\)"):
        llm.generate(prompts[:1], greedy(), use_tqdm=False,
                     lora=LoraRequest("my-adapter", folders[0]))
    assert not llm.engine.has_unfinished_requests()
    missing = llm.generate(prompts[:1], greedy(), use_tqdm=False,
                           lora=LoraRequest("0" * 64, str(tmp_path / "nothing-here")))[0]
    assert missing.finish_reason == "error"
    assert missing.error.startswith(f"adapter {'0' * 64} could not be loaded: ")
    assert "nothing-here does not exist" in missing.error


def test_an_adapter_that_fails_to_load_fails_only_its_request(setup, tmp_path):
    base, prompts, adapters, references = setup
    engine = lora_engine(base, num_load_threads=0)
    missing = LoraRequest("0" * 64, str(tmp_path / "nothing-here"))
    params = greedy()
    engine.add_request("bad", prompts[0], params, lora=missing)
    engine.add_request("good", prompts[0], params, lora=adapters[0])
    outputs = {}
    first_step = {request_id: 0 for request_id in ("bad", "good")}  # the step of each one's first output
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
            first_step[output.request_id] = first_step[output.request_id] or step
    assert outputs["bad"][-1].finish_reason == "error" and "could not be loaded" in outputs["bad"][-1].error
    assert first_step == {"bad": 1, "good": 1}  # the request behind the failed one is not held back
    assert [t for o in outputs["good"] for t in o.new_token_ids] == references[0][0]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_a_waiting_adapter_is_not_starved_by_a_busy_one(setup):
    base, prompts, adapters, references = setup
    engine = lora_engine(base, dict(max_num_seqs=8), max_gpu_adapters=1, num_load_threads=0)
    busy = greedy(4)
    engine.add_request("busy-0", prompts[0], busy, lora=adapters[0])
    engine.step()
    params = greedy()
    engine.add_request("patient", prompts[1], params, lora=adapters[1])
    patient = []
    for step in range(1, 60):  # adapter 0 gets a new request every step, forever
        engine.add_request(f"busy-{step}", prompts[step % 6], busy, lora=adapters[0])
        for output in engine.step():
            if output.request_id == "patient":
                patient += output.new_token_ids
        if len(patient) == NUM_NEW_TOKENS:
            break
    assert patient == references[1][1]
    assert step < 20


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_arrivals_aborts_and_preemptions_stay_exact_and_leak_nothing(setup, seed):
    """Many adapters over 2 slots, a KV cache that forces preemptions, and requests aborted at random
    (waiting, running or preempted): every request that finishes says exactly what PEFT says, the
    engine never wedges, and afterwards no KV block or adapter reference is left behind."""
    base, prompts, adapters, references = setup
    engine = lora_engine(base, dict(block_size=4, num_kv_blocks=16, max_num_seqs=6,
                                    max_num_batched_tokens=32),
                         max_gpu_adapters=2, max_cpu_adapters=3, num_load_threads=0)
    rng = random.Random(seed)
    params = greedy()
    requests = [(rng.choice([None, *range(len(adapters))]), rng.randrange(len(prompts)))
                for _ in range(30)]
    arrivals = {i: rng.randrange(40) for i in range(len(requests))}
    aborts = {i: arrivals[i] + rng.randrange(12) for i in rng.sample(range(len(requests)), 8)}
    tokens = {i: [] for i in range(len(requests))}
    finished, aborted = set(), set()
    step = 0
    while step <= 60 or engine.has_unfinished_requests():
        assert step < 1000, "the engine stopped making progress"
        for i, (adapter_index, prompt_index) in enumerate(requests):
            if arrivals[i] == step:
                lora = adapters[adapter_index] if adapter_index is not None else None
                engine.add_request(str(i), prompts[prompt_index], params, lora=lora)
        for i, at in aborts.items():
            if at == step and engine.abort_request(str(i)):
                aborted.add(i)
        for output in engine.step():
            assert output.finish_reason != "error", output.error
            tokens[int(output.request_id)] += output.new_token_ids
            if output.finished:
                finished.add(int(output.request_id))
        step += 1
    assert finished | aborted == set(range(len(requests))) and aborted and not finished & aborted
    for i in finished:
        adapter_index, prompt_index = requests[i]
        assert tokens[i] == references[adapter_index][prompt_index], (i, adapter_index, prompt_index)
    metrics = engine.metrics()
    assert metrics.num_preemptions > 0 and metrics.adapter_evictions > 0  # both were exercised
    # Six adapters over three host entries: reloads happen, but not a reload of each waiting adapter
    # on every step (prefetch warms no more adapters than the host tier holds).
    assert metrics.adapter_disk_loads <= 2 * metrics.adapter_page_ins
    assert metrics.kv_blocks_free == metrics.kv_blocks_total and metrics.num_running == 0
    assert engine.adapter_cache.in_use() == {}
    # Nor the folder of an adapter no request uses (kept, every adapter ever run was).
    assert engine._adapter_paths == {}


def _hold_loads(engine: LLMEngine, only: str | None = None) -> threading.Event:
    """Make the engine's adapter loads (of adapter `only`, if given) wait for the returned event
    (slow storage)."""
    gate = threading.Event()
    load_from_storage = engine.adapter_cache.loader

    def slow_loader(adapter_id):
        if only in (None, adapter_id):
            assert gate.wait(10)
        return load_from_storage(adapter_id)

    engine.adapter_cache.loader = slow_loader
    return gate


def _count_loads(engine: LLMEngine) -> collections.Counter:
    """A counter of the engine's reads of each adapter (by id) from storage, from now on."""
    loads: collections.Counter = collections.Counter()
    load_from_storage = engine.adapter_cache.loader

    def counting_loader(adapter_id):
        loads[adapter_id] += 1
        return load_from_storage(adapter_id)

    engine.adapter_cache.loader = counting_loader
    return loads


def _run_to_end(engine: LLMEngine) -> tuple[dict[str, list[int]], list[str]]:
    """Step until every request finished, none with an error: the tokens of each request, and the
    requests in the order they finished."""
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    finished = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.finish_reason != "error", output.error
            tokens[output.request_id] += output.new_token_ids
            finished += [output.request_id] if output.finished else []
    return tokens, finished


@pytest.mark.parametrize("max_cpu_adapters, num_load_threads", [(1, 0), (1, 1), (3, 1)])
def test_an_adapter_that_runs_once_is_read_from_storage_once(setup, max_cpu_adapters, num_load_threads):
    """The only slot is held by a long request; requests for three other adapters wait for it.
    However few adapters the host tier holds, each is read from storage once: the engine loads
    no more adapters ahead than the host tier keeps, and keeps them until they run."""
    base, prompts, adapters, references = setup
    engine = lora_engine(base, max_gpu_adapters=1, max_cpu_adapters=max_cpu_adapters,
                         num_load_threads=num_load_threads)
    loads = _count_loads(engine)
    engine.add_request("holder", prompts[0], greedy(4 * NUM_NEW_TOKENS), lora=adapters[0])
    engine.step()
    for i in (1, 2, 3):
        engine.add_request(str(i), prompts[i], greedy(), lora=adapters[i])
    tokens, _ = _run_to_end(engine)
    assert {i: tokens[str(i)] for i in (1, 2, 3)} == {i: references[i][i] for i in (1, 2, 3)}
    assert loads == {adapters[i].adapter_id: 1 for i in range(4)}
    engine.adapter_cache.close()


def test_a_more_urgent_adapter_takes_the_host_tier_from_a_waiting_one(setup):
    """A host tier of one adapter, loaded for a waiting request, when a more urgent request for
    another adapter arrives: the urgent one is loaded in its place and runs first, and the first
    is read again once, then runs (neither waits forever for the other)."""
    base, prompts, adapters, references = setup
    engine = lora_engine(base, max_gpu_adapters=1, max_cpu_adapters=1, num_load_threads=0)
    loads = _count_loads(engine)
    engine.add_request("holder", prompts[0], greedy(2 * NUM_NEW_TOKENS), lora=adapters[0])
    engine.step()
    engine.add_request("first", prompts[1], greedy(), lora=adapters[1])
    engine.step()  # adapter 1 is loaded for it
    engine.add_request("urgent", prompts[2], greedy(), priority=-1, lora=adapters[2])
    tokens, finished = _run_to_end(engine)
    assert finished == ["holder", "urgent", "first"]
    assert (tokens["urgent"], tokens["first"]) == (references[2][2], references[1][1])
    assert loads == {adapters[0].adapter_id: 1, adapters[1].adapter_id: 2, adapters[2].adapter_id: 1}


def test_an_adapter_paged_in_while_its_request_waits_is_a_miss(setup):
    """A request for a new adapter waits for the only batch seat, and meanwhile its adapter is read
    and paged into a free slot: that request is a cache miss, and the next one for it a hit."""
    base, prompts, adapters, references = setup
    engine = lora_engine(base, dict(max_num_seqs=1), max_gpu_adapters=2, num_load_threads=0)
    engine.add_request("base", prompts[0], greedy())
    engine.step()
    engine.add_request("new", prompts[1], greedy(), lora=adapters[1])
    tokens, _ = _run_to_end(engine)
    metrics = engine.metrics()
    assert (metrics.adapter_disk_loads, metrics.adapter_page_ins) == (1, 1)
    assert (metrics.adapter_hits, metrics.adapter_misses) == (0, 1)
    engine.add_request("again", prompts[2], greedy(), lora=adapters[1])
    tokens.update(_run_to_end(engine)[0])
    assert (tokens["new"], tokens["again"]) == (references[1][1], references[1][2])
    assert (engine.metrics().adapter_hits, engine.metrics().adapter_misses) == (1, 1)


def test_hits_and_misses_count_requests_however_often_they_are_preempted(setup):
    """A request preempted and admitted again acquires its adapter again: it once counted again,
    as a hit (the adapter released only just now), so preemptions made the hit rate look better."""
    base, prompts, adapters, references = setup
    engine = lora_engine(base, dict(block_size=4, num_kv_blocks=14, max_num_seqs=4),
                         max_gpu_adapters=1, num_load_threads=0)
    for i in range(4):
        engine.add_request(str(i), prompts[2], greedy(20), lora=adapters[0])
    tokens, _ = _run_to_end(engine)
    metrics = engine.metrics()
    assert metrics.num_preemptions > 0
    assert (metrics.adapter_hits, metrics.adapter_misses) == (3, 1)
    assert all(t[:NUM_NEW_TOKENS] == references[0][2] for t in tokens.values())


def test_loads_of_aborted_requests_stay_within_the_host_tier_and_idle_steps_wait(setup):
    """Requests aborted while their adapters load leave no load behind: host memory holds no more
    adapters than max_cpu_adapters, and an idle step still sleeps on the next load."""
    base, prompts, adapters, references = setup
    engine = lora_engine(base, max_gpu_adapters=1, max_cpu_adapters=2, num_load_threads=1)
    cache = engine.adapter_cache
    num_packed_before = num_live_packed_adapters()
    params = greedy()
    engine.add_request("holder", prompts[0], params, lora=adapters[0])  # keeps the only slot
    engine.step()
    for i in range(1, 5):
        engine.add_request(f"gone-{i}", prompts[i], params, lora=adapters[i])
        engine.step()  # its load starts
        cache.wait_for_loads(timeout=10)
        engine.abort_request(f"gone-{i}")  # the client leaves while it waits for the slot
        engine.step()
    engine.abort_request("holder")
    engine.step()
    assert num_live_packed_adapters() - num_packed_before <= 2

    gate = _hold_loads(engine)
    engine.add_request("next", prompts[5], params, lora=adapters[5])
    start = time.monotonic()
    assert engine.step() == []  # nothing to run while adapter 5 loads: the step waits for it
    assert time.monotonic() - start >= 0.8 * _IDLE_LOAD_WAIT_S
    gate.set()
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for output in engine.step() for t in output.new_token_ids]
    assert tokens == references[5][5]
    cache.close()


def test_an_adapter_still_loading_holds_back_no_request_of_a_resident_adapter(setup):
    """Slow storage for one tenant's adapter delays that adapter's requests alone: a request for
    an adapter already in a slot, arriving behind it, runs to the end meanwhile."""
    base, prompts, adapters, references = setup
    engine = lora_engine(base, max_gpu_adapters=4, num_load_threads=1)
    params = greedy()
    engine.add_request("warm-up", prompts[0], params, lora=adapters[0])
    while engine.has_unfinished_requests():
        engine.step()
    gate = _hold_loads(engine, only=adapters[1].adapter_id)
    engine.add_request("slow", prompts[1], params, lora=adapters[1])
    engine.step()  # its load starts, and waits for storage
    engine.add_request("resident", prompts[2], params, lora=adapters[0])
    tokens = {"slow": [], "resident": []}
    for _ in range(4 * NUM_NEW_TOKENS):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        if len(tokens["resident"]) == NUM_NEW_TOKENS:
            break
    assert tokens == {"slow": [], "resident": references[0][2]}
    gate.set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens["slow"] == references[1][1]
    engine.adapter_cache.close()


def test_a_load_failure_reaches_no_request_that_arrives_after_its_waiters_left(setup, tmp_path):
    base, prompts, adapters, references = setup
    engine = lora_engine(base, num_load_threads=1)
    cache = engine.adapter_cache
    gate = _hold_loads(engine)
    late = LoraRequest(adapters[0].adapter_id, str(tmp_path / "fetching"))  # files not there yet
    params = greedy()
    engine.add_request("gone", prompts[0], params, lora=late)
    engine.step()  # its load starts
    engine.abort_request("gone")
    gate.set()
    cache.wait_for_loads(timeout=10)  # the load fails: the files are missing
    shutil.copytree(adapters[0].path, late.path)
    engine.add_request("later", prompts[0], params, lora=late)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.error for o in outputs if o.finished] == [None]
    assert [t for o in outputs for t in o.new_token_ids] == references[0][0]
    cache.close()


def test_the_folder_of_an_adapter_whose_request_left_mid_load_is_forgotten_after_the_load(setup):
    """The engine keeps an adapter's folder only while a request or a load may read it: a request
    aborted while its adapter loads leaves the folder to the load, and the first step after the
    load ends forgets it."""
    base, prompts, adapters, _ = setup
    engine = lora_engine(base, num_load_threads=1)
    gate = _hold_loads(engine)
    engine.add_request("gone", prompts[0], greedy(), lora=adapters[0])
    engine.step()  # its load starts
    engine.abort_request("gone")
    engine.step()
    assert adapters[0].adapter_id in engine._adapter_paths  # the load still needs it
    gate.set()
    deadline = time.monotonic() + 10
    while engine.adapter_cache.loading_ids() and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.step()
    assert engine._adapter_paths == {} and not engine.has_unfinished_requests()
    assert engine.adapter_cache.host_ids() == [adapters[0].adapter_id]  # the load was not wasted
    engine.adapter_cache.close()


def test_a_loaded_adapter_waits_in_host_memory_for_its_request(setup, tmp_path):
    """Adapter x is loaded for a request that waits for the only slot, then x's files are deleted.
    A more urgent request takes the slot first, and its adapter and another one's are loaded
    meanwhile, into a host tier of two where x is the least recently used: x is kept for its
    request, which runs on the load that finished (storage is not read again)."""
    base, prompts, adapters, references = setup
    engine = lora_engine(base, max_gpu_adapters=1, max_cpu_adapters=2, num_load_threads=0)
    cache = engine.adapter_cache
    shutil.copytree(adapters[0].path, tmp_path / "x")
    x = LoraRequest(adapters[0].adapter_id, str(tmp_path / "x"))
    engine.add_request("holder", prompts[2], greedy(), lora=adapters[2])
    engine.step()
    engine.add_request("x", prompts[0], greedy(), lora=x)
    engine.step()  # x is loaded
    shutil.rmtree(x.path)  # the tenant deletes adapter x
    engine.add_request("urgent", prompts[1], greedy(), priority=-1, lora=adapters[1])
    engine.add_request("later", prompts[3], greedy(), lora=adapters[3])
    tokens, finished = _run_to_end(engine)
    assert finished == ["holder", "urgent", "x", "later"]
    assert [tokens[r] for r in ("urgent", "x", "later")] == [references[i][i] for i in (1, 0, 3)]
    assert cache.stats.num_loads == 4
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks and cache.in_use() == {}


def test_a_failed_load_fails_every_request_waiting_on_it_at_once(setup, tmp_path):
    base, prompts, adapters, references = setup
    engine = lora_engine(base, num_load_threads=1)
    cache = engine.adapter_cache
    storage = _hold_loads(engine)
    missing = LoraRequest("0" * 64, str(tmp_path / "nothing-here"))
    params = greedy()
    engine.add_request("bad-1", prompts[0], params, lora=missing)
    engine.add_request("good", prompts[1], params, lora=adapters[0])
    engine.add_request("bad-2", prompts[2], params, lora=missing)
    engine.step()  # the loads start
    storage.set()
    cache.wait_for_loads(timeout=10)  # the missing adapter's load fails
    failed_at, tokens, step = {}, [], 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step():
            tokens += output.new_token_ids
            if output.finish_reason == "error":
                assert "could not be loaded" in output.error and "does not exist" in output.error
                failed_at[output.request_id] = step
    assert failed_at == {"bad-1": 1, "bad-2": 1}
    assert tokens == references[0][1]
    cache.close()


def test_an_adapter_failing_at_admission_fails_its_requests_and_leaves_nothing_behind(setup):
    """An acquire that raises (a page-in that fails, say) fails that adapter's requests in the step
    where it happens; the step goes on, and no KV block, slot reference or request is left over."""
    base, prompts, adapters, references = setup
    engine = lora_engine(base, num_load_threads=0)
    cache = engine.adapter_cache
    acquire, broken = cache.acquire, adapters[0].adapter_id

    def acquire_failing_for_broken(adapter_id, counted=True):
        if adapter_id == broken:
            raise RuntimeError("the page-in failed")
        return acquire(adapter_id, counted)

    cache.acquire = acquire_failing_for_broken
    params = greedy()
    engine.add_request("bad-1", prompts[0], params, lora=adapters[0])
    engine.add_request("good", prompts[1], params, lora=adapters[1])
    engine.add_request("bad-2", prompts[2], params, lora=adapters[0])
    engine.add_request("base", prompts[3], params)
    failed_at, tokens, step = {}, {"good": [], "base": []}, 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step():
            if output.finish_reason == "error":
                failed_at[output.request_id] = (step, output.error)
            else:
                tokens[output.request_id] += output.new_token_ids
    error = f"adapter {broken} could not be loaded: the page-in failed"
    assert failed_at == {"bad-1": (1, error), "bad-2": (1, error)}
    assert tokens == {"good": references[1][1], "base": references[None][3]}
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks and cache.in_use() == {}
    assert not engine.abort_request("bad-1")  # it left the engine with its error
