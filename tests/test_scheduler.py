"""Scheduler behaviour on CPU without a model: hand-built runner outputs drive it."""

import pytest

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from tests.helpers import create_request, create_scheduler, run_step


def run_to_end(scheduler: Scheduler) -> list[Request]:
    """Run every request to its end; the request of each chunk scheduled meanwhile, in order."""
    scheduled = []
    while scheduler.has_unfinished_requests():
        scheduled += [s.request for s in run_step(scheduler).scheduled]
    return scheduled


def queue_one_token_requests(scheduler: Scheduler, *tenants: str) -> list[Request]:
    """A request of one token from each of `tenants`, queued in that order."""
    requests = [create_request(max_tokens=1, tenant=tenant) for tenant in tenants]
    for request in requests:
        scheduler.add_request(request)
    return requests


def test_token_budget_and_max_num_seqs_are_respected():
    scheduler = create_scheduler(max_num_batched_tokens=20, max_num_seqs=3)
    for _ in range(5):
        scheduler.add_request(create_request(num_prompt_tokens=12, max_tokens=3))
    while scheduler.has_unfinished_requests():
        output = run_step(scheduler)
        assert output.num_batched_tokens <= 20
        assert len(scheduler.running) <= 3
        assert len(output.scheduled) <= 3


def test_long_prompt_is_chunked_alongside_decodes():
    scheduler = create_scheduler(max_num_batched_tokens=10, num_blocks=64)
    short = create_request(num_prompt_tokens=4, max_tokens=20)
    scheduler.add_request(short)
    run_step(scheduler)  # short prefilled, now decoding
    long = create_request(num_prompt_tokens=40, max_tokens=2)
    scheduler.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        output = run_step(scheduler)
        by_id = {s.request.request_id: s.num_tokens for s in output.scheduled}
        assert by_id[short.request_id] == 1  # the decode rides in every step
        chunks.append(by_id[long.request_id])
    assert chunks == [9, 9, 9, 9, 4]
    assert long.num_computed_tokens == 40


def test_step_output_lists_exact_chunk_sizes():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    a = create_request(num_prompt_tokens=10)
    b = create_request(num_prompt_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_tokens) for s in output.scheduled] == [
        (a.request_id, 10), (b.request_id, 6)]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0


def test_abort_frees_blocks_wherever_the_request_is():
    scheduler = create_scheduler(num_blocks=16, max_num_batched_tokens=8)
    running = create_request(num_prompt_tokens=8, max_tokens=50)
    waiting = create_request(num_prompt_tokens=8, max_tokens=50)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)
    assert running.block_ids and not waiting.block_ids
    assert scheduler.finish_request(running.request_id, RequestStatus.FINISHED_ABORTED) is running
    assert scheduler.finish_request(waiting.request_id, RequestStatus.FINISHED_ABORTED) is waiting
    assert scheduler.kv.num_free_blocks == 16
    assert running.block_ids == [] and running.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.finish_request(running.request_id, RequestStatus.FINISHED_ABORTED) is None
    assert not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preempted_request_comes_back_and_finishes(prefix_caching):
    # 6 blocks of 4 tokens; two requests that each grow to 12 tokens cannot both fit.
    scheduler = create_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64,
                                 enable_prefix_caching=prefix_caching)
    first = create_request(num_prompt_tokens=8, max_tokens=6)
    second = create_request(num_prompt_tokens=8, max_tokens=6)
    scheduler.add_request(first)
    scheduler.add_request(second)
    preempted = []
    while scheduler.has_unfinished_requests():
        preempted += run_step(scheduler).preempted_ids
        assert scheduler.kv.num_used_blocks <= 6
    assert preempted and set(preempted) == {second.request_id}  # the later arrival yields
    assert second.num_preemptions >= 1 and scheduler.stats.num_preemptions == len(preempted)
    for request in (first, second):
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == 6
    assert scheduler.kv.num_free_blocks == 6
    # Each prompt is queried once: coming back after a preemption finds the request's own blocks,
    # which says nothing of how often clients' prompts share a prefix.
    assert scheduler.kv.prefix_stats.num_queried_tokens == 16


def test_a_request_for_prompt_logprobs_is_no_prefix_cache_lookup():
    """It never looks (it needs the logits of every prompt position): counted, it lowered the hit
    rate with misses that say nothing of how prompts share prefixes."""
    scheduler = create_scheduler(enable_prefix_caching=True)
    for request in (create_request(prompt_logprobs=0), create_request()):
        scheduler.add_request(request)
    assert len(run_step(scheduler).scheduled) == 2
    assert scheduler.kv.prefix_stats.num_queried_tokens == 8


def test_priority_runs_first_and_fcfs_within_priority():
    scheduler = create_scheduler(max_num_seqs=1)
    low = create_request(priority=5, max_tokens=1)
    high_early = create_request(priority=0, max_tokens=1)
    high_late = create_request(priority=0, max_tokens=1)
    for request in (low, high_early, high_late):
        scheduler.add_request(request)
    assert run_to_end(scheduler) == [high_early, high_late, low]


def test_a_tenant_that_queues_many_requests_does_not_hold_back_another_tenant():
    scheduler = create_scheduler(max_num_seqs=2)
    flood = [create_request(max_tokens=2, tenant="noisy") for _ in range(12)]
    for request in flood:
        scheduler.add_request(request)
    first = [s.request for s in run_step(scheduler).scheduled]
    other, other_second = (create_request(max_tokens=2, tenant="other") for _ in range(2))
    scheduler.add_request(other)
    scheduler.add_request(other_second)
    order = list(dict.fromkeys(first + run_to_end(scheduler)))  # requests in admission order
    # The other tenant's requests take turns with the flood's instead of waiting for all of it.
    assert order == flood[:2] + [other, flood[2], other_second] + flood[3:]


def test_an_idle_tenant_saves_up_no_turns():
    scheduler = create_scheduler(max_num_seqs=1)
    for _ in range(4):  # tenant "busy" is served four turns while "idle" sends nothing
        queue_one_token_requests(scheduler, "busy")
        run_step(scheduler)
    queued = queue_one_token_requests(scheduler, "busy", "busy", "idle", "idle")
    order = run_to_end(scheduler)
    # The idle tenant starts at the turn admission reached (that of busy's last), not at 0:
    # it alternates with busy rather than going first twice.
    assert order == [queued[2], queued[0], queued[3], queued[1]]


def test_choices_waiting_one_step_for_their_prompt_keep_their_turns():
    scheduler = create_scheduler(max_num_seqs=8)
    # Two prompts of more than a block, six choices each: the first choice of each computes its
    # prompt's blocks, and the other choices wait one step to read them from the prefix cache.
    flood = [create_request(prompt=[p] * 9, max_tokens=2, tenant="noisy") for p in (5, 7) for _ in range(6)]
    for request in flood:
        scheduler.add_request(request)
    first = [s.request for s in run_step(scheduler).scheduled]
    other = create_request(max_tokens=2, tenant="other")
    scheduler.add_request(other)
    order = list(dict.fromkeys(first + run_to_end(scheduler)))  # requests in admission order
    # Admission passed over the first prompt's choices, which still wait: it has not reached the
    # second prompt's turns, and the other tenant's request waits for about one round of choices.
    assert order == [flood[0], flood[6], flood[1], other] + flood[2:6] + flood[7:]


def test_a_tenant_owes_no_turns_for_queued_requests_it_aborted():
    scheduler = create_scheduler(max_num_seqs=1)
    flood = queue_one_token_requests(scheduler, *["noisy"] * 10)
    run_step(scheduler)  # flood[0] runs and finishes; then its client aborts the rest
    for request in flood[1:]:
        scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
    queued = queue_one_token_requests(scheduler, "other", "other", "other", "noisy")
    order = run_to_end(scheduler)
    # noisy takes the turn after its last one served, not one behind the nine it aborted.
    assert order == [queued[0], queued[1], queued[3], queued[2]]


def test_tenant_turns_are_forgotten_once_a_tenant_has_no_request_left():
    scheduler = create_scheduler(max_num_seqs=64)
    for i in range(3000):  # a request each from 3000 tenants, never more than 20 queued at once
        scheduler.add_request(create_request(max_tokens=1, tenant=f"tenant-{i}"))
        if i % 20 == 19:
            while scheduler.has_unfinished_requests():
                run_step(scheduler)
    assert scheduler.tenant_rounds.num_tenants <= 1024
    waiting = create_request(max_tokens=1, tenant="tenant-0")
    scheduler.add_request(waiting)  # a forgotten tenant starts at the turn admission reached
    assert waiting.fair_round == scheduler.tenant_rounds.reached


def test_preemption_picks_the_lowest_priority_victim():
    scheduler = create_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    important = create_request(num_prompt_tokens=8, max_tokens=8, priority=0)
    background = create_request(num_prompt_tokens=8, max_tokens=8, priority=9)
    scheduler.add_request(background)
    run_step(scheduler)
    scheduler.add_request(important)
    preempted = []
    while important.num_output_tokens < 8:
        preempted += run_step(scheduler).preempted_ids
    assert preempted and set(preempted) == {background.request_id}
    assert important.num_preemptions == 0


def test_an_urgent_request_preempts_the_least_urgent_one_for_a_batch_slot():
    scheduler = create_scheduler(max_num_seqs=2)
    early = create_request(priority=9, max_tokens=6)
    late = create_request(priority=9, max_tokens=6)
    scheduler.add_request(early)
    scheduler.add_request(late)
    run_step(scheduler)
    same = create_request(priority=9, max_tokens=1)  # as urgent as the running ones: it waits
    urgent = create_request(priority=0, max_tokens=2)
    scheduler.add_request(same)
    scheduler.add_request(urgent)
    output = run_step(scheduler)
    assert output.preempted_ids == [late.request_id]  # the latest arrival among the least urgent
    assert [(s.request.request_id, s.num_tokens) for s in output.scheduled] == [
        (early.request_id, 1), (urgent.request_id, 8)]
    preempted = []
    while scheduler.has_unfinished_requests():
        preempted += run_step(scheduler).preempted_ids
    assert preempted == []
    assert [r.num_output_tokens for r in (early, late, same, urgent)] == [6, 6, 1, 2]
    assert (late.num_preemptions, scheduler.stats.num_preemptions) == (1, 1)


def test_an_urgent_request_preempts_the_least_urgent_one_for_kv_blocks():
    scheduler = create_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = create_request(num_prompt_tokens=12, max_tokens=4, priority=5)
    second = create_request(num_prompt_tokens=12, max_tokens=4, priority=5)
    scheduler.add_request(first)
    scheduler.add_request(second)
    run_step(scheduler)  # 6 of the 8 blocks
    urgent = create_request(num_prompt_tokens=8, max_tokens=1, priority=0)
    scheduler.add_request(urgent)
    output = run_step(scheduler)
    # The two decodes take the last two blocks; the urgent prompt needs two more.
    assert output.preempted_ids == [second.request_id]
    assert [(s.request.request_id, s.num_tokens) for s in output.scheduled] == [
        (first.request_id, 1), (urgent.request_id, 8)]
    assert urgent.status == RequestStatus.FINISHED_LENGTH
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert [r.num_output_tokens for r in (first, second)] == [4, 4]
    assert scheduler.kv.num_free_blocks == 8


def test_no_starvation_under_a_steady_stream_of_arrivals():
    # An early long request must finish although short requests keep arriving every step.
    scheduler = create_scheduler(num_blocks=64, max_num_batched_tokens=12, max_num_seqs=4)
    long = create_request(num_prompt_tokens=60, max_tokens=5)
    scheduler.add_request(long)
    for step in range(200):
        scheduler.add_request(create_request(num_prompt_tokens=6, max_tokens=3))
        run_step(scheduler)
        if long.is_finished:
            break
    assert long.is_finished and long.num_output_tokens == 5
    assert step < 40


def test_waiting_head_that_does_not_fit_keeps_its_place():
    scheduler = create_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64,
                                 enable_prefix_caching=False)
    big = create_request(num_prompt_tokens=12, max_tokens=2)
    blocker = create_request(num_prompt_tokens=4, max_tokens=8)
    small = create_request(num_prompt_tokens=4, max_tokens=1)
    scheduler.add_request(blocker)
    run_step(scheduler)
    scheduler.add_request(big)
    scheduler.add_request(small)
    output = run_step(scheduler)
    # blocker's decode takes a second block; big needs 3 of the 2 left, and FCFS keeps small
    # (which would fit) behind it rather than letting it jump the queue.
    assert [s.request.request_id for s in output.scheduled] == [blocker.request_id]
    assert scheduler.waiting == [big, small]
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert big.num_output_tokens == 2 and small.num_output_tokens == 1


def test_stop_token_and_min_tokens():
    scheduler = create_scheduler()
    request = create_request(max_tokens=10, stop_token_ids=(7,), min_tokens=3)
    scheduler.add_request(request)
    for _ in range(10):
        run_step(scheduler, token_id=7)
        if request.is_finished:
            break
    assert request.output_token_ids == [7, 7, 7]
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_eos_is_ignored_when_asked():
    scheduler = create_scheduler()
    stops = create_request(max_tokens=5)
    ignores = create_request(max_tokens=5, ignore_eos=True)
    stops.eos_token_ids = ignores.eos_token_ids = frozenset({2})
    scheduler.add_request(stops)
    scheduler.add_request(ignores)
    while scheduler.has_unfinished_requests():
        run_step(scheduler, token_id=2)
    assert stops.output_token_ids == [2] and stops.status == RequestStatus.FINISHED_STOPPED
    assert ignores.output_token_ids == [2] * 5 and ignores.status == RequestStatus.FINISHED_LENGTH


def test_max_model_len_ends_generation():
    scheduler = create_scheduler(max_model_len=12)
    request = create_request(num_prompt_tokens=8, max_tokens=100)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert request.num_tokens == 12 and request.status == RequestStatus.FINISHED_LENGTH
