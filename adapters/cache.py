"""AdapterCache: adapter residency in two tiers, host memory and device slots, both LRU.

    storage --load (loader threads)--> host tier (packed, pinned on CUDA) --page-in--> device slot

An adapter is addressed by its digest (DESIGN.md, "Adapter identity"): a new version under the same
name has a new digest, so it never shares an entry or a slot with the old one. A load checks that
the files the loader returns hash to the digest asked for.

The scheduler uses `can_acquire` / `acquire` as a check/commit pair and `release` when a request
stops running; device slots held by running requests (refcount > 0) are never evicted. A True from
`can_acquire` keeps the packed adapter it found for the `acquire` that follows, so a loader thread
evicting it from the host tier in between cannot send `acquire` to storage on the engine thread.
`prefetch` warms both tiers for waiting requests without evicting anything, and `drop_load` forgets
a load that no waiting request needs any more.

Adapters loaded (or loading) for waiting requests are staged: the host tier keeps them until they
are paged in, and at most `max_cpu_adapters` are staged at once, the most urgent first. Loading
more would have the host tier evict loaded ones for them, and read those from storage again.

On CUDA, page-ins run on a side stream. A page-in into a slot that held another adapter first
waits for the compute already queued (it may still read that slot); the runner calls
`wait_page_ins()` before a forward so the compute stream waits for the copies.

NOTE: every method runs on the engine thread; only `_load` runs on loader threads, and it touches
nothing but the host tier and its counters, and reads which adapters are staged, under `_lock`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.config import AdapterConfig
from adapters.errors import AdapterValidationError
from adapters.peft_format import load_adapter
from adapters.slots import PackedAdapter, SlotBuffers, pack_adapter
from engine.model.spec import ModelSpec
from kernels.sgmv_cpu import pin_num_threads

Loader = Callable[[str], Path]  # adapter digest -> folder holding its files


@dataclass
class AdapterCacheStats:
    # Counted acquires (a request's first: see acquire) whose adapter was in a device slot before
    # their request needed it, and those whose adapter was paged in for them (by acquire or by
    # prefetch).
    num_hits: int = 0
    num_misses: int = 0
    num_evictions: int = 0  # device slots taken from an idle adapter
    num_page_ins: int = 0  # copies into a device slot, by acquire or prefetch
    num_loads: int = 0  # adapters read from storage, validated and packed into the host tier
    num_host_evictions: int = 0  # host-tier entries dropped for room


class AdapterCache:
    """Host tier and device slots of one engine. `acquire` returns the slot the kernels index."""

    def __init__(self, config: AdapterConfig, spec: ModelSpec, dtype: torch.dtype,
                 device: torch.device | str, loader: Loader):
        self.config, self.spec, self.dtype, self.loader = config, spec, dtype, loader
        self.device = torch.device(device)
        self.slots = SlotBuffers(spec, config.max_gpu_adapters, config.max_lora_rank, dtype, self.device)
        self.stats = AdapterCacheStats()
        self._resident: OrderedDict[str, int] = OrderedDict()  # digest -> slot, least recent first
        self._refcounts: dict[str, int] = {}  # only adapters in use (count > 0)
        # NOTE: a slot leaves this list once and never returns (eviction hands it over directly), so
        # no queued kernel can be reading a slot taken from here.
        self._unused_slots = list(range(config.max_gpu_adapters - 1, -1, -1))
        self._host: OrderedDict[str, PackedAdapter] = OrderedDict()  # least recent first
        self._lock = threading.Lock()
        # Staged adapters: loads that can_acquire / prefetch started (or host-tier entries they kept)
        # for waiting requests, until paged in, unstaged for more urgent ones, or `drop_load`; a
        # failed load until can_acquire or acquire reports its error. At most max_cpu_adapters.
        # NOTE: changed under `_lock` only: loader threads read it to evict none of them.
        self._staged: dict[str, Future[PackedAdapter]] = {}
        # Loads dropped while running (they cannot be cancelled): until they end, their loader
        # thread may still ask the loader for the adapter's folder.
        self._dropped_running: dict[str, Future[PackedAdapter]] = {}
        # What can_acquire found for the adapters it said True for, until their acquire, the next
        # prefetch (admission is over by then) or drop_load.
        self._promised: dict[str, PackedAdapter] = {}
        # Adapters that prefetch paged in for waiting requests, until the first of them acquires it
        # (a miss: it was paged in for that request), it is evicted, or `drop_load`.
        self._paged_in_ahead: set[str] = set()
        # NOTE: loader threads keep the intra-op threads of the one building the cache (the engine's):
        # one started inside another thread's LoRA decode would otherwise keep one thread for good.
        self._executor = (ThreadPoolExecutor(config.num_load_threads, thread_name_prefix="adapter-load",
                                             initializer=pin_num_threads,
                                             initargs=(torch.get_num_threads(),))
                          if config.num_load_threads else None)
        self._copy_stream = None
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
            # NOTE: the slot buffers' zero fill was queued on the current stream; copies must follow it.
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._pending_copies: list[torch.cuda.Event] = []

    def can_acquire(self, adapter_id: str) -> bool:
        """Whether `acquire(adapter_id)` would succeed now without waiting for storage.

        Stages the adapter if fewer than max_cpu_adapters are (starting its load if it is not in
        the host tier). Raises the load's error (AdapterValidationError for a bad adapter) once, if
        its load failed. After True, `acquire` pages in the packed adapter found here, whatever the
        host tier has dropped since.
        """
        if adapter_id in self._resident:
            return True
        packed = self._promised.get(adapter_id) or self._loaded_or_staged(adapter_id)
        if packed is None:
            self._raise_if_failed(adapter_id)
            return False
        if not self._unused_slots and self._idle_adapter() is None:
            return False
        self._promised[adapter_id] = packed
        return True

    def is_loaded(self, adapter_id: str) -> bool:
        """Whether the adapter is in host memory, ready to page in: a request for it that cannot
        be admitted waits for a device slot, not for storage."""
        return adapter_id in self._promised or self._loaded(adapter_id) is not None

    def acquire(self, adapter_id: str, counted: bool = True) -> int:
        """Pin the adapter in a device slot (paging it in if needed) and return the slot.

        Unless `can_acquire` said True just before, blocks on storage if the adapter is not loaded
        yet. Evicts the least recently used idle adapter if no slot is free. Raises
        AdapterValidationError for an adapter that cannot be served, leaving every tier as it was.
        `counted`: whether it counts as a hit or a miss, which count requests: not for a request
        admitted again after preemption (its adapter, released only just now, would mostly be a
        hit, making the cache look better the more requests are preempted).
        """
        slot = self._resident.get(adapter_id)
        is_hit = slot is not None and adapter_id not in self._paged_in_ahead
        if slot is None:
            packed = self._packed(adapter_id)
            slot, is_reused = self._take_slot()
            self._page_in(adapter_id, slot, packed, wait_for_compute=is_reused)
        self._paged_in_ahead.discard(adapter_id)  # prefetch paged it in while this request waited
        if counted:
            if is_hit:
                self.stats.num_hits += 1
            else:
                self.stats.num_misses += 1
        self._resident.move_to_end(adapter_id)
        self._refcounts[adapter_id] = self._refcounts.get(adapter_id, 0) + 1
        return slot

    def release(self, adapter_id: str) -> None:
        """Undo one acquire; at zero the adapter stays resident but may be evicted."""
        count = self._refcounts.get(adapter_id, 0)
        if count == 0:
            raise RuntimeError(f"release({adapter_id!r}) without a matching acquire")
        if count == 1:
            del self._refcounts[adapter_id]
        else:
            self._refcounts[adapter_id] = count - 1

    def prefetch(self, adapter_ids: Iterable[str]) -> None:
        """Warm the tiers for adapters that waiting requests need, most urgent first: stage them
        (loading those not in the host tier), page those loaded into unused slots. Never evicts a
        device slot and never blocks on storage; load errors surface later in can_acquire or acquire.

        Only as many adapters as the host tier holds are staged, the most urgent ones: staged
        adapters less urgent than them are unstaged to make room, except loads still running,
        which keep theirs until they finish.
        """
        self._promised.clear()  # NOTE: prefetch follows admission: no acquire is coming for them
        waiting = [a for a in adapter_ids if a not in self._resident]
        urgent = waiting[:self.config.max_cpu_adapters]
        self._make_room_to_stage(urgent, waiting)
        for adapter_id in urgent:
            packed = self._loaded_or_staged(adapter_id)
            if packed is not None and self._unused_slots:
                self._unstage(adapter_id)
                self._page_in(adapter_id, self._unused_slots.pop(), packed, wait_for_compute=False)
                self._paged_in_ahead.add(adapter_id)

    def wait_page_ins(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for every page-in issued so far. Call
        before each forward; a no-op on CPU, where page-ins are synchronous."""
        if not self._pending_copies:
            return
        stream = stream or torch.cuda.current_stream(self.device)
        for event in self._pending_copies:
            stream.wait_event(event)
        self._pending_copies.clear()

    def wait_for_loads(self, timeout: float) -> None:
        """Block until some load from storage finishes (or `timeout` seconds pass).

        NOTE: an engine with nothing to run but requests waiting on loads calls this instead of
        spinning: a spinning step loop holds the GIL and starves the loader thread (seconds per load).
        """
        # NOTE: only loads still running: a finished one would end the wait at once.
        running = [future for future in self._staged.values() if not future.done()]
        if running:
            wait(running, timeout=timeout, return_when=FIRST_COMPLETED)

    def drop_load(self, adapter_id: str) -> None:
        """No waiting request needs the adapter any more: unstage it. A load still queued never
        runs, one running finishes into the host tier, and a failed one is never reported (a later
        request loads the adapter again)."""
        self._promised.pop(adapter_id, None)
        self._paged_in_ahead.discard(adapter_id)
        future = self._unstage(adapter_id)
        if future is not None and not future.cancel() and not future.done():
            self._dropped_running[adapter_id] = future

    def slot_of(self, adapter_id: str) -> int | None:
        return self._resident.get(adapter_id)

    def resident_ids(self) -> list[str]:
        """Adapters in device slots, least recently acquired first."""
        return list(self._resident)

    def loading_ids(self) -> set[str]:
        """Adapters whose load from storage has not finished (its loader thread may still ask
        the loader for their folder)."""
        self._dropped_running = {adapter_id: future for adapter_id, future
                                 in self._dropped_running.items() if not future.done()}
        staged = {adapter_id for adapter_id, future in self._staged.items() if not future.done()}
        return staged | self._dropped_running.keys()

    def in_use(self) -> dict[str, int]:
        """Adapters that requests hold (acquired, not yet released), with how many hold each."""
        return dict(self._refcounts)

    def host_ids(self) -> list[str]:
        """Adapters in the host tier, least recently used first."""
        with self._lock:
            return list(self._host)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _idle_adapter(self) -> str | None:
        """The least recently acquired resident adapter that no request holds."""
        return next((a for a in self._resident if a not in self._refcounts), None)

    def _take_slot(self) -> tuple[int, bool]:
        """A slot for a new adapter and whether it held another one before."""
        if self._unused_slots:
            return self._unused_slots.pop(), False
        victim = self._idle_adapter()
        if victim is None:
            raise RuntimeError(
                f"all {self.config.max_gpu_adapters} adapter slots hold adapters in use; "
                "check can_acquire before acquire")
        self.stats.num_evictions += 1
        self._paged_in_ahead.discard(victim)
        return self._resident.pop(victim), True

    def _page_in(self, adapter_id: str, slot: int, packed: PackedAdapter, wait_for_compute: bool) -> None:
        if self._copy_stream is None:
            self.slots.write(slot, packed)
        else:
            if wait_for_compute:
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            # NOTE: packed tensors are pinned by the caching host allocator, which keeps their
            # memory from reuse until these copies finish even if the host tier drops them.
            with torch.cuda.stream(self._copy_stream):
                self.slots.write(slot, packed)
                self._pending_copies.append(self._copy_stream.record_event())
        self._resident[adapter_id] = slot
        self.stats.num_page_ins += 1

    def _loaded_or_staged(self, adapter_id: str) -> PackedAdapter | None:
        """The packed adapter if it is loaded; otherwise None, after staging the adapter (starting
        its load) if fewer than max_cpu_adapters are staged."""
        if adapter_id not in self._staged and len(self._staged) < self.config.max_cpu_adapters:
            self._stage(adapter_id)
        return self._loaded(adapter_id)

    def _loaded(self, adapter_id: str) -> PackedAdapter | None:
        """The packed adapter if its staged load finished well or the host tier holds it."""
        future = self._staged.get(adapter_id)
        if future is not None and future.done() and future.exception() is None:
            return future.result()
        with self._lock:
            return self._host.get(adapter_id)

    def _stage(self, adapter_id: str) -> None:
        """Keep the adapter's host-tier entry for a waiting request, or start loading it."""
        with self._lock:
            packed = self._host.get(adapter_id)
            if packed is not None:
                self._staged[adapter_id] = _finished(packed)
                return
        future = self._submit(adapter_id)
        with self._lock:
            self._staged[adapter_id] = future

    def _unstage(self, adapter_id: str) -> Future[PackedAdapter] | None:
        with self._lock:
            return self._staged.pop(adapter_id, None)

    def _make_room_to_stage(self, urgent: list[str], waiting: list[str]) -> None:
        """Unstage adapters outside `urgent` until all of `urgent` can be staged, the least urgent
        first: those not in `waiting` (in queue order), then the latest in it. A running load
        keeps its room until it finishes: unstaged, the read under way would be wasted, its adapter
        dropped at once from a host tier full of staged ones."""
        num_over = len(self._staged.keys() | set(urgent)) - self.config.max_cpu_adapters
        if num_over <= 0:
            return
        position = {adapter_id: i for i, adapter_id in enumerate(waiting)}
        spare = sorted(self._staged.keys() - set(urgent), key=lambda a: -position.get(a, len(waiting)))
        for adapter_id in spare:
            future = self._staged[adapter_id]
            if num_over > 0 and (future.done() or future.cancel()):
                self._unstage(adapter_id)
                num_over -= 1

    def _raise_if_failed(self, adapter_id: str) -> None:
        future = self._staged.get(adapter_id)
        if future is not None and future.done() and (error := future.exception()) is not None:
            self._unstage(adapter_id)
            raise error

    def _packed(self, adapter_id: str) -> PackedAdapter:
        """The packed adapter, unstaged: the one can_acquire promised, else the host tier's, else
        waiting for its staged load, else loading it here."""
        packed = self._promised.pop(adapter_id, None)
        future = self._unstage(adapter_id)
        with self._lock:
            if adapter_id in self._host:
                self._host.move_to_end(adapter_id)
                packed = packed or self._host[adapter_id]
        if packed is not None:
            return packed
        return future.result() if future is not None else self._load(adapter_id)

    def _submit(self, adapter_id: str) -> Future[PackedAdapter]:
        if self._executor is not None:
            return self._executor.submit(self._load, adapter_id)
        future: Future[PackedAdapter] = Future()
        try:
            future.set_result(self._load(adapter_id))
        except Exception as e:  # kept for can_acquire / acquire, as a loader thread would
            future.set_exception(e)
        return future

    def _load(self, adapter_id: str) -> PackedAdapter:
        """Storage -> validated, packed host-tier entry. Runs on a loader thread under prefetch."""
        folder = self.loader(adapter_id)
        adapter = load_adapter(folder, self.spec, self.config.max_lora_rank)
        if adapter.digest != adapter_id:
            raise AdapterValidationError(
                f"{folder} holds files of digest {adapter.digest}, not {adapter_id}: they were "
                "damaged after they were stored, or the loader returned another adapter's folder; "
                "upload the adapter again")
        packed = pack_adapter(adapter, self.spec, self.dtype, pin_memory=self.device.type == "cuda")
        with self._lock:
            self._host[adapter_id] = packed
            self.stats.num_loads += 1
            while len(self._host) > self.config.max_cpu_adapters:
                # NOTE: staged adapters are kept, and as at most max_cpu_adapters are staged, one
                # that is not always remains here to drop.
                del self._host[next(a for a in self._host if a not in self._staged)]
                self.stats.num_host_evictions += 1
        return packed


def _finished(packed: PackedAdapter) -> Future[PackedAdapter]:
    """A load that is already done: a staged host-tier entry."""
    future: Future[PackedAdapter] = Future()
    future.set_result(packed)
    return future
