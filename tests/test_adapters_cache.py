"""AdapterCache: LRU order in both tiers, refcounts, exact counters, identity by digest, prefetch."""

import threading
import time

import pytest
import torch

from adapters import AdapterCache, AdapterConfig, AdapterValidationError
from adapters.peft_format import load_adapter
from store.blobs import BlobStore
from kernels import sgmv_cpu
from tests.helpers import TEST_DEVICE, num_live_packed_adapters, save_peft_adapter, tiny_spec, torch_threads
from tests.test_adapters_slots import assert_slot_holds

SPEC = tiny_spec()
NUM_ADAPTERS = 6


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    """Six adapters of different ranks and targets in a blob store; returns (store, digests)."""
    root = tmp_path_factory.mktemp("cache")
    store = BlobStore(root / "blobs")
    targets = [["q_proj", "v_proj"], "all-linear", ["o_proj", "down_proj"]]
    digests = []
    for i in range(NUM_ADAPTERS):
        save_peft_adapter(root / f"src{i}", seed=i, r=2 + i, target_modules=targets[i % 3])
        digests.append(store.put(root / f"src{i}")[0])
    return store, digests


def make_cache(store: BlobStore, loader=None, **config) -> AdapterCache:
    config = AdapterConfig(**{"max_lora_rank": 8, "max_gpu_adapters": 2, "max_cpu_adapters": 8,
                              "num_load_threads": 0, **config})
    return AdapterCache(config, SPEC, torch.float32, TEST_DEVICE, loader or store.path)


def counts(cache: AdapterCache) -> tuple[int, int, int, int]:
    s = cache.stats
    return s.num_hits, s.num_misses, s.num_evictions, s.num_page_ins


def use(cache: AdapterCache, adapter_id: str) -> int:
    """One request's life: acquire, run, release."""
    slot = cache.acquire(adapter_id)
    cache.release(adapter_id)
    return slot


def test_acquire_pages_in_exact_weights(blobs):
    store, ids = blobs
    cache = make_cache(store)
    assert cache.can_acquire(ids[1])
    assert cache.acquire(ids[1]) == 0
    cache.wait_page_ins()
    assert_slot_holds(cache.slots, 0, load_adapter(store.path(ids[1]), SPEC, 8))
    assert counts(cache) == (0, 1, 0, 1) and cache.stats.num_loads == 1


def test_lru_order(blobs):
    store, (a, b, c, *_) = blobs
    cache = make_cache(store)
    assert [use(cache, a), use(cache, b), use(cache, a)] == [0, 1, 0]
    assert use(cache, c) == 1  # b is the least recently used
    assert cache.resident_ids() == [a, c] and cache.slot_of(b) is None
    assert counts(cache) == (1, 3, 1, 3)


def test_refcount_prevents_eviction(blobs):
    store, (a, b, c, *_) = blobs
    cache = make_cache(store)
    cache.acquire(a)
    cache.acquire(b)
    cache.acquire(b)
    assert not cache.can_acquire(c)
    with pytest.raises(RuntimeError, match="in use"):
        cache.acquire(c)
    assert cache.resident_ids() == [a, b]
    cache.release(b)
    assert not cache.can_acquire(c)  # b is still held once
    cache.release(a)
    assert cache.can_acquire(c)
    assert cache.acquire(c) == 0  # took a's slot although a is older than b: b is in use
    assert cache.resident_ids() == [b, c]
    assert_slot_holds(cache.slots, 0, load_adapter(store.path(c), SPEC, 8))
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        cache.release(a)


def test_two_slots_cycle_six_adapters(blobs):
    store, ids = blobs
    cache = make_cache(store, max_cpu_adapters=4)
    for _ in range(2):
        for adapter_id in ids:
            slot = use(cache, adapter_id)
            assert_slot_holds(cache.slots, slot, load_adapter(store.path(adapter_id), SPEC, 8))
    assert counts(cache) == (0, 12, 10, 12)
    assert (cache.stats.num_loads, cache.stats.num_host_evictions) == (12, 8)
    assert cache.host_ids() == ids[2:]

    # A skewed pattern: 0 and 3 stay hot.
    cache = make_cache(store)
    slots = [use(cache, ids[i]) for i in (0, 1, 0, 2, 0, 3, 1, 3)]
    assert slots == [0, 1, 0, 1, 0, 1, 0, 1]
    assert counts(cache) == (3, 5, 3, 5)
    assert cache.resident_ids() == [ids[1], ids[3]]


def test_new_version_under_same_name_gets_new_slot(blobs, tmp_path):
    store, _ = blobs
    names = {}  # what the store's adapter records do: name -> digest
    save_peft_adapter(tmp_path / "upload", seed=10, target_modules=["q_proj"])
    names["acme/support"] = v1 = store.put(tmp_path / "upload")[0]
    cache = make_cache(store)
    assert use(cache, names["acme/support"]) == 0
    save_peft_adapter(tmp_path / "upload", seed=11, target_modules=["q_proj"])
    names["acme/support"] = v2 = store.put(tmp_path / "upload")[0]
    assert v2 != v1
    assert use(cache, names["acme/support"]) == 1
    assert cache.resident_ids() == [v1, v2]
    assert_slot_holds(cache.slots, 0, load_adapter(store.path(v1), SPEC, 8))
    assert_slot_holds(cache.slots, 1, load_adapter(tmp_path / "upload", SPEC, 8))


def test_loader_folder_with_other_digest_is_rejected(blobs):
    store, (a, b, *_) = blobs
    cache = make_cache(store, loader=lambda _: store.path(b))
    with pytest.raises(AdapterValidationError, match=f"holds files of digest {b}, not {a}"):
        cache.acquire(a)
    assert cache.resident_ids() == [] and cache.host_ids() == []


def test_host_tier_lru(blobs):
    store, (a, b, c, *_) = blobs
    cache = make_cache(store, max_gpu_adapters=4, max_cpu_adapters=2)
    for adapter_id in (a, b, a, c):
        use(cache, adapter_id)
    assert cache.host_ids() == [b, c]  # a was only a device hit the second time
    assert (cache.stats.num_loads, cache.stats.num_host_evictions) == (3, 1)
    assert counts(cache) == (1, 3, 0, 3)


def test_prefetch_fills_unused_slots_and_never_evicts(blobs):
    store, (a, b, c, *_) = blobs
    cache = make_cache(store)
    cache.prefetch([a])
    assert cache.resident_ids() == [a]
    assert use(cache, a) == 0
    use(cache, b)
    cache.prefetch([c])
    assert cache.resident_ids() == [a, b] and cache.host_ids() == [a, b, c]
    assert use(cache, c) == 0
    assert counts(cache) == (0, 3, 1, 3)  # prefetch paged a in for the request that used it
    assert cache.stats.num_loads == 3


def test_an_adapter_paged_in_by_prefetch_is_a_miss_for_the_request_it_waited_for(blobs):
    """A hit is a request whose adapter was in a slot before it needed it: one that prefetch paged
    in while the request waited is a miss for that request (once), as is one evicted before its
    request started, and paged in again."""
    store, (a, b, c, *_) = blobs
    cache = make_cache(store)
    cache.prefetch([a])  # a request for a waits
    use(cache, a)
    use(cache, a)  # a later request: a was in its slot before it came
    assert counts(cache) == (1, 1, 0, 1)
    cache.prefetch([b])  # b's request leaves before it starts: the next one for b finds b in a slot
    cache.drop_load(b)
    use(cache, b)
    assert counts(cache) == (2, 1, 0, 2)

    cache = make_cache(store)
    use(cache, a)
    cache.prefetch([b])  # a request for b waits
    use(cache, a)
    use(cache, c)  # evicts b before b's request starts
    use(cache, b)  # b's request: b is paged in for it again
    use(cache, b)
    assert counts(cache) == (2, 3, 2, 4)


def test_prefetch_warms_no_more_adapters_than_the_host_tier_holds(blobs):
    """More adapters waiting than host entries: prefetch keeps the most urgent ones loaded rather
    than loading every one each step, each evicting one loaded the step before."""
    store, (a, b, c, d, e, f) = blobs
    cache = make_cache(store, max_gpu_adapters=1, max_cpu_adapters=3)
    use(cache, a)
    use(cache, b)  # the only slot now holds b; a is an idle host entry
    waiting = [c, d, e, f]  # most urgent first
    for _ in range(5):  # the queue does not move for five steps
        cache.prefetch(waiting)
    assert cache.host_ids() == [c, d, e]  # a and b made room
    assert cache.stats.num_loads == 2 + 3
    assert cache.can_acquire(c) and cache.acquire(c) == 0 and cache.stats.num_loads == 5


def test_adapters_loaded_for_waiting_requests_stay_within_the_host_tier_until_paged_in(blobs):
    """can_acquire and prefetch load no more adapters ahead than the host tier holds, the most
    urgent first, and the host tier keeps each until it is paged in: loading more would drop
    loaded ones, to be read from storage again."""
    store, (a, b, c, d, *_) = blobs
    cache = make_cache(store, max_gpu_adapters=1, max_cpu_adapters=2)
    num_packed_before = num_live_packed_adapters()
    cache.acquire(d)  # the only slot is in use: waiting requests wait for it
    for adapter_id in (a, b, c):  # admission looks at the waiting requests in queue order
        assert not cache.can_acquire(adapter_id)
    cache.prefetch([a, b, c])
    assert cache.host_ids() == [a, b] and cache.stats.num_loads == 3  # c waits for room
    cache.prefetch([c, a, b])  # a request for c, more urgent, arrived: b makes room for c
    assert cache.host_ids() == [a, c] and cache.stats.num_loads == 4
    assert num_live_packed_adapters() - num_packed_before == 2
    cache.release(d)
    for adapter_id in (c, a, b):
        assert cache.can_acquire(adapter_id)
        use(cache, adapter_id)
    assert cache.stats.num_loads == 5  # b again, as it made room for c


def test_a_load_under_way_keeps_its_room_until_it_finishes(blobs):
    """A request for another adapter, more urgent, arrives while a waiting request's adapter loads
    into a host tier of one: its load starts once that one finishes (whose read would be wasted,
    dropped from the host tier for it, were it given up at once)."""
    store, (a, b, c, *_) = blobs
    loads = []
    a_started, a_files = threading.Event(), threading.Event()

    def loader(adapter_id):
        loads.append(adapter_id)
        if adapter_id == a:
            a_started.set()
            assert a_files.wait(10)
        return store.path(adapter_id)

    cache = make_cache(store, loader=loader, max_gpu_adapters=1, max_cpu_adapters=1, num_load_threads=1)
    try:
        cache.acquire(c)  # the only slot is in use
        assert not cache.can_acquire(a)  # starts its load
        # Running, not merely queued: a queued load is given up (on a loaded host the loader
        # thread may not have picked it up yet).
        assert a_started.wait(10)
        cache.prefetch([b, a])
        a_files.set()
        cache.wait_for_loads(timeout=10)
        assert loads == [c, a] and cache.host_ids() == [a]
        cache.prefetch([b, a])  # a is loaded: it makes room for b
        cache.wait_for_loads(timeout=10)
        assert loads == [c, a, b] and cache.host_ids() == [b]
    finally:
        cache.close()


def test_prefetch_loads_in_background(blobs):
    store, (a, *_) = blobs
    gate = threading.Event()

    def slow_loader(adapter_id):
        assert gate.wait(10)
        return store.path(adapter_id)

    cache = make_cache(store, loader=slow_loader, num_load_threads=1)
    try:
        cache.prefetch([a])
        assert not cache.can_acquire(a) and cache.host_ids() == []
        gate.set()
        deadline = time.monotonic() + 10
        while not cache.can_acquire(a):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cache.prefetch([a])
        assert cache.acquire(a) == 0
        assert counts(cache) == (0, 1, 0, 1) and cache.stats.num_loads == 1
    finally:
        cache.close()


def test_failed_prefetch_surfaces_in_can_acquire(blobs, tmp_path):
    store, _ = blobs
    bad = "f" * 64
    cache = make_cache(store, loader=lambda _: tmp_path / "nowhere")
    cache.prefetch([bad])
    with pytest.raises(AdapterValidationError, match="does not exist"):
        cache.can_acquire(bad)
    assert cache.resident_ids() == [] and cache.host_ids() == [] and counts(cache) == (0, 0, 0, 0)


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_gpu_adapters must be >= 1"):
        AdapterConfig(max_gpu_adapters=0)


def test_acquire_after_can_acquire_never_reads_storage(blobs):
    """A loader thread can drop an adapter from the host tier between can_acquire saying True and
    the acquire that follows (when it found the adapter in the host tier, no longer staged):
    acquire still pages in the adapter can_acquire found, and storage is read on loader threads
    only."""
    store, (a, b, *_) = blobs
    loads = []  # (adapter, thread) of each read from storage
    b_files = threading.Event()

    def loader(adapter_id):
        loads.append((adapter_id, threading.current_thread().name))
        assert adapter_id != b or b_files.wait(10)
        return store.path(adapter_id)

    cache = make_cache(store, loader=loader, max_cpu_adapters=1, num_load_threads=1)
    try:
        cache.can_acquire(a)  # starts its load
        cache.wait_for_loads(timeout=10)
        cache.drop_load(a)  # its request left: a is a host entry like any other
        cache.can_acquire(b)  # another waiting request's adapter starts loading
        assert cache.can_acquire(a)
        b_files.set()
        cache.wait_for_loads(timeout=10)
        assert cache.host_ids() == [b]  # a was dropped for b
        assert cache.acquire(a) == 0
        assert_slot_holds(cache.slots, 0, load_adapter(store.path(a), SPEC, 8))
        assert [adapter_id for adapter_id, _ in loads] == [a, b] and cache.stats.num_loads == 2
        assert all(thread.startswith("adapter-load") for _, thread in loads)
    finally:
        cache.close()


def test_loader_threads_keep_the_thread_count_the_cache_was_built_with(blobs):
    """A loader thread that starts while another thread's LoRA decode has narrowed torch to one
    thread (kernels/sgmv_cpu.py) still loads with the count the cache was built with."""
    store, (a, b, *_) = blobs
    seen = []  # the loading thread's intra-op threads, at each load

    def loader(adapter_id):
        seen.append(torch.get_num_threads())
        return store.path(adapter_id)

    with torch_threads(2):
        cache = make_cache(store, loader=loader, num_load_threads=1)
    try:
        with sgmv_cpu._one_thread():  # the loader thread starts inside the window
            cache.can_acquire(a)  # starts its load
            cache.wait_for_loads(timeout=10)
        cache.can_acquire(b)
        cache.wait_for_loads(timeout=10)
        assert seen == [2, 2]
    finally:
        cache.close()
