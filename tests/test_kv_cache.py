"""Block pool: allocation, refcounts, prefix sharing, eviction, and no leaks under random traffic."""

import random

from engine.kv_cache import KVCacheManager, hash_block
from engine.request import RequestStatus
from tests.helpers import create_request, create_scheduler, run_step


def compute_prompt(kv: KVCacheManager, request) -> None:
    """Admit `request` and mark its whole prompt computed, as a prefill step would."""
    kv.allocate(request, request.num_tokens, kv.get_computed_blocks(request))
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)


def test_allocate_and_free_round_trip():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    request = create_request(num_prompt_tokens=9)
    assert kv.can_allocate(request, 9)
    kv.allocate(request, 9, kv.get_computed_blocks(request))
    assert len(request.block_ids) == 3 and kv.num_free_blocks == 7
    kv.free(request)
    assert request.block_ids == [] and kv.num_free_blocks == 10


def test_full_blocks_are_shared_by_requests_with_the_same_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prefix = list(range(100, 112))  # three full blocks
    first = create_request(prompt=prefix + [1, 2])
    compute_prompt(kv, first)

    second = create_request(prompt=prefix + [3])
    hits = kv.get_computed_blocks(second)
    assert hits == first.block_ids[:3]
    kv.allocate(second, 1, hits)
    assert second.num_computed_tokens == 12
    assert [kv.ref_counts[b] for b in hits] == [2, 2, 2]
    assert kv.prefix_stats.num_hit_tokens == 12 and kv.prefix_stats.num_queried_tokens == 14 + 13


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = create_request(prompt=list(range(8)))
    compute_prompt(kv, first)
    same = create_request(prompt=list(range(8)))
    assert kv.get_computed_blocks(same) == first.block_ids[:1]


def test_adapter_identity_is_part_of_the_block_hash():
    assert hash_block(b"", None, None, [1, 2]) != hash_block(b"", None, "adapter-sha", [1, 2])
    assert hash_block(b"", None, "a", [1, 2]) != hash_block(b"", None, "b", [1, 2])
    kv = KVCacheManager(num_blocks=8, block_size=4)
    base = create_request(prompt=list(range(9)))
    compute_prompt(kv, base)
    tuned = create_request(prompt=list(range(9)))
    tuned.adapter_id = "sha256:abc"
    assert kv.get_computed_blocks(tuned) == []


def test_tenants_never_share_cached_blocks():
    """A hit would tell one tenant that another sent the same prefix."""
    assert hash_block(b"", "ab", "c", [1]) != hash_block(b"", "a", "bc", [1])
    kv = KVCacheManager(num_blocks=8, block_size=4)
    alice = create_request(prompt=list(range(9)))
    alice.tenant = "alice"
    compute_prompt(kv, alice)
    bob = create_request(prompt=list(range(9)))
    bob.tenant = "bob"
    assert kv.get_computed_blocks(bob) == []
    alice_again = create_request(prompt=list(range(9)))
    alice_again.tenant = "alice"
    assert kv.get_computed_blocks(alice_again) == alice.block_ids[:2]


def test_freed_cached_blocks_are_reused_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = create_request(prompt=list(range(9)))
    compute_prompt(kv, first)
    first_blocks = list(first.block_ids)
    kv.free(first)
    assert kv.num_free_blocks == 4
    again = create_request(prompt=list(range(9)))
    assert kv.get_computed_blocks(again) == first_blocks[:2]
    # Filling the pool with other content evicts them.
    other = create_request(prompt=list(range(500, 516)))
    kv.allocate(other, 16, kv.get_computed_blocks(other))
    assert kv.num_free_blocks == 0
    assert kv.get_computed_blocks(again) == []


def test_no_block_leaks_after_1000_random_add_abort_finish_sequences():
    rng = random.Random(7)
    scheduler = create_scheduler(num_blocks=48, block_size=4, max_num_batched_tokens=24,
                                 max_num_seqs=6)
    kv = scheduler.kv
    shared_prefix = list(range(900, 916))
    live = []
    for _ in range(1000):
        action = rng.random()
        if action < 0.45:
            prompt = (shared_prefix[: rng.randrange(0, 17)]
                      + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))])
            request = create_request(prompt=prompt, max_tokens=rng.randrange(1, 12),
                                     priority=rng.randrange(3))
            scheduler.add_request(request)
            live.append(request)
        elif action < 0.6 and live:
            victim = live.pop(rng.randrange(len(live)))
            scheduler.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED)
        else:
            run_step(scheduler, token_id=rng.randrange(1000))
        live = [r for r in live if not r.is_finished]
        held = [b for r in scheduler.requests.values() for b in r.block_ids]
        # Every reference is accounted for by exactly one live request's block table.
        assert sum(kv.ref_counts) == len(held)
        assert kv.num_free_blocks == sum(1 for c in kv.ref_counts if c == 0)
        assert all(kv.ref_counts[b] > 0 for b in held)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert kv.num_free_blocks == 48 and sum(kv.ref_counts) == 0
