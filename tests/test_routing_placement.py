"""Placement: adapter affinity within a load bound, stable rendezvous homes, least-loaded base."""

from __future__ import annotations

import collections

import pytest

from routing.placement import Candidate, home_of, place

WORKERS = ["w0", "w1", "w2", "w3"]


def idle(*, device: dict[str, set[str]] | None = None, host: dict[str, set[str]] | None = None,
         load: dict[str, int] | None = None) -> list[Candidate]:
    device, host, load = device or {}, host or {}, load or {}
    return [Candidate(w, load.get(w, 0), frozenset(device.get(w, ())), frozenset(host.get(w, ())))
            for w in WORKERS]


def test_an_adapter_held_nowhere_goes_to_its_home_whoever_asks():
    homes = {f"adapter-{i}": place(idle(), f"adapter-{i}", f"adapter-{i}").id for i in range(400)}
    assert all(home == home_of(a, WORKERS) for a, home in homes.items())
    per_worker = collections.Counter(homes.values())
    assert set(per_worker) == set(WORKERS) and min(per_worker.values()) > 60  # spread evenly


def test_when_a_worker_leaves_only_its_adapters_move():
    adapters = [f"adapter-{i}" for i in range(200)]
    before = {a: home_of(a, WORKERS) for a in adapters}
    after = {a: home_of(a, WORKERS[:-1]) for a in adapters}
    moved = {a for a in adapters if before[a] != after[a]}
    assert moved == {a for a in adapters if before[a] == WORKERS[-1]}


def test_a_worker_holding_the_adapter_wins_device_before_host_before_home():
    adapter = "adapter-x"
    home = home_of(adapter, WORKERS)
    others = [w for w in WORKERS if w != home]
    assert place(idle(host={others[0]: {adapter}}), adapter, adapter).id == others[0]
    both = idle(host={others[0]: {adapter}}, device={others[1]: {adapter}})
    assert place(both, adapter, adapter).id == others[1]
    # Among holders, the least loaded.
    two = idle(device={others[0]: {adapter}, others[1]: {adapter}}, load={others[0]: 2})
    assert place(two, adapter, adapter).id == others[1]


@pytest.mark.parametrize("slack", [0, 4])
def test_a_hot_adapter_spills_to_another_worker_beyond_the_slack(slack):
    adapter = "hot"
    holder = home_of(adapter, WORKERS)
    within = idle(device={holder: {adapter}}, load={holder: slack})
    assert place(within, adapter, adapter, slack).id == holder
    beyond = idle(device={holder: {adapter}}, load={holder: slack + 1})
    spilled = place(beyond, adapter, adapter, slack).id
    assert spilled != holder
    # Once it holds the adapter too, the two share it by load.
    shared = idle(device={holder: {adapter}, spilled: {adapter}}, load={holder: slack + 1})
    assert place(shared, adapter, adapter, slack).id == spilled


def test_base_requests_go_to_the_least_loaded_and_spread_ties():
    loads = {"w0": 3, "w1": 1, "w2": 1, "w3": 5}
    chosen = collections.Counter(place(idle(load=loads), f"req-{i}").id for i in range(200))
    assert set(chosen) == {"w1", "w2"} and min(chosen.values()) > 50


def test_no_candidate_is_an_error():
    with pytest.raises(ValueError):
        place([], "req")
