"""Engines on remote workers: the pool of workers registered in Redis, and RemoteEngineClient, the
EngineClient of one model served by some of them.

The pool re-reads the registry every `poll_s`: a worker that stopped heartbeating leaves it within
its record's lifetime (a few heartbeats), and one that refuses connections leaves at once until
it heartbeats again. Each request is placed by routing.placement over the model's workers that
can serve it: for an adapter, those whose --max-lora-rank holds its rank (a pool may mix GPUs).

Which models the pool serves is decided from Redis alone, so that every gateway behind a load
balancer gives the same answers: a model is served while one of its workers is up or one sent a
heartbeat within `model_ttl_s` (the registry keeps each model's latest heartbeat), its calls
answering 503 `engine_unavailable` while no worker is up; past that it is no longer served (404).

Failover: until a request's first chunk arrives nothing has reached the client, so a worker that
cannot be reached, refuses for being busy or closing, drops the connection, or falls silent
(STREAM_SILENCE_S without even a keepalive) before the first chunk, is passed over and the
request placed again on another worker. A request queued on a busy worker waits there: its
stream carries keepalives. Once chunks flow, a cut
stream is an EngineFailure (the gateway ends the response with a clean error). A worker whose
engine failed the request (500 `engine_failure`) is not passed over: that is the request's
EngineFailure, with the engine's reason, as from a local engine.

A worker that shuts down gracefully is not a failed one: it leaves the registry as its shutdown
begins, and its requests in flight may finish; those still running at its deadline end with a
`stopped` line. A request stopped before its first chunk is placed again on another worker;
after, it is EngineStopped (the client is told to send it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec

from gateway.engine_client import (AdapterInfo, AdapterNotServedNow, AdapterRef, AdapterRejected,
                                   DamagedAdapterCopy, EngineClient, EngineFailure, EngineStats,
                                   EngineStopped, EngineUnavailable, GatewayOutOfFiles,
                                   GenerationChunk, RequestRejected, SamplingOptions,
                                   WorkersOutOfSpace, out_of_open_files)
from gateway.sse import sse_lines
from gateway.text_codec import TextCodec
from gateway.worker_api import (ADAPTERS_PATH, CHECK_ADAPTER_PATH, GENERATE_PATH, KEEPALIVE_S,
                                MAX_LORA_RANK_PARAM, GenerateBody, StreamLine, WorkerError)
from routing.placement import DEFAULT_SLACK, Candidate, place
from store.blobs import ADAPTER_FILES, UNUSED_BLOB_S
from store.redis import REDIS_FULL_ERRORS
from store.workers import ModelSeen, Periodic, WorkerRecord, WorkerRegistry, files_digest

logger = logging.getLogger(__name__)

DEFAULT_POLL_S = 0.5
DEFAULT_MODEL_TTL_S = 3600.0  # a model stays served this long after its last worker's heartbeat
DEFAULT_READ_TIMEOUT_S = 60.0  # adapter files and checks
_CONNECT_TIMEOUT_S = 2.0
# A generate stream is never silent for more than KEEPALIVE_S while its worker lives (queued
# requests included); this long without a byte, the worker is taken for hung.
STREAM_SILENCE_S = 6 * KEEPALIVE_S
_STREAM_TIMEOUT = httpx.Timeout(STREAM_SILENCE_S, connect=_CONNECT_TIMEOUT_S)
_MAX_PLACEMENTS = 3  # workers tried for one request before it fails
_MAX_IDLE_CONNECTIONS = 20  # connections to workers kept open for reuse (as httpx by default)
_MAX_OPENING = 32  # generate streams a gateway opens to one worker at once (WorkerPool.opening)


class WorkerPool:
    """The live workers, refreshed from the registry; one RemoteEngineClient per model served
    (see the module docstring).

    `load_tokenizer` reads a folder of tokenizer files (it may import transformers, so the
    caller passes it in). `models` are the gateway's served models: the pool adds each model it
    serves there, and removes it when it stops serving it, leaving alone a local engine or
    upstream of the same name. `ensure_intact_copy` is called with an adapter's digest when a
    worker refuses this gateway's copy of its files, as they do not hash to it: whether this
    gateway holds an intact copy now, a damaged one replaced (None: it cannot replace its copies).
    `on_serving` is called with each model the pool starts serving, once it does.
    `records_elsewhere`: this gateway keeps adapter records in a store other than the registry's
    Redis; each refresh says so there, so that workers keep adapter files by their use, not by
    the records there (gateway/worker.py).
    """

    def __init__(self, registry: WorkerRegistry, tokenizer_dir: Path,
                 load_tokenizer: Callable[[Path], Any], models: dict[str, EngineClient], *,
                 ensure_intact_copy: Callable[[str], Awaitable[bool]] | None = None,
                 on_serving: Callable[[str], Awaitable[None]] | None = None,
                 poll_s: float = DEFAULT_POLL_S, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 slack: int = DEFAULT_SLACK, model_ttl_s: float = DEFAULT_MODEL_TTL_S,
                 records_elsewhere: bool = False):
        self.registry = registry
        self._tokenizer_dir = tokenizer_dir
        self._load_tokenizer = load_tokenizer
        self._models = models
        self._ensure_intact_copy = ensure_intact_copy
        self._on_serving = on_serving
        self._poll_s = poll_s
        self.model_ttl_s = model_ttl_s
        self._records_elsewhere = records_elsewhere
        self.slack = slack
        self.workers: dict[str, WorkerRecord] = {}
        self.seen: dict[str, ModelSeen] = {}  # every model's latest heartbeat, as Redis has it
        # Each model's engine counters over its workers, taken up at every read of the registry:
        # a worker's counts since the last /metrics scrape were lost when it left before the next.
        self.totals: dict[str, _WorkerTotals] = {}
        self.clients: dict[str, RemoteEngineClient] = {}
        self.inflight: dict[str, int] = {}  # this gateway's requests placed on each worker
        self._inflight_at_beat: dict[str, int] = {}  # the same, when its last record was read
        self._down: dict[str, float] = {}  # worker id -> the beat_at it had when it failed
        # (worker id, adapter digest) -> the adapter's files on their way to that worker
        self._transfers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.internal_key = ""
        # NOTE: no limit of its own on connections to workers (httpx's default is 100): each
        # request holds its stream for its whole life, and workers queue what they cannot run
        # yet. Past a limit, requests waited for another's stream to end, and those that waited
        # too long took their worker for dead.
        self.http = httpx.AsyncClient(
            auth=_InternalKeyAuth(self),
            timeout=httpx.Timeout(read_timeout_s, connect=_CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=_MAX_IDLE_CONNECTIONS))
        self._polling: Periodic | None = None
        self._refreshing: asyncio.Task[None] | None = None
        # Generate streams being opened to each worker (connected, sent, until their answer's
        # headers) at once, by worker id. NOTE: a call of 2048 prompts opened them all at once: on
        # the gateway's busy event loop their connects timed out, and every worker was taken for
        # down, for every caller. Per worker: one that hangs with its port still open holds the
        # openings of the streams sent to it until they time out (STREAM_SILENCE_S); under one
        # bound for all, every other worker's calls waited for them.
        self._opening: dict[str, asyncio.Semaphore] = {}

    def opening(self, worker_id: str) -> asyncio.Semaphore:
        """The bound on generate streams being opened to `worker_id` at once."""
        return self._opening.setdefault(worker_id, asyncio.Semaphore(_MAX_OPENING))

    async def start(self) -> None:
        """Read the registry once (raising if Redis cannot be reached), then keep polling."""
        await self.refresh()
        self._polling = Periodic(self.refresh, self._poll_s,
                                 "reading the worker registry (workers known so far kept)")

    async def close(self) -> None:
        if self._polling is not None:
            await self._polling.stop()
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        for transfer in self._transfers.values():
            transfer.cancel()
        await self.http.aclose()
        await self.registry.close()

    async def refresh(self) -> None:
        """Take the registry's view of the workers and of the models to serve. A refresh asked
        for while one runs (the poll's, a call's or a health probe's that found no worker up)
        waits for that one: two at once each started serving a model new to both, and the one
        left serving it was never stopped (a model gone stayed listed, answering 503)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._refresh())
            self._refreshing.add_done_callback(_retrieve_exception)
        # NOTE: shielded: a caller that goes away stops waiting; the refresh goes on for others.
        await asyncio.shield(self._refreshing)

    def _take_up_stats(self, records: list[WorkerRecord]) -> None:
        """Each model's totals take up its workers registered now (none, for a model whose
        workers all left: its gauges read 0, its counters keep what they counted)."""
        now = time.monotonic()
        for model in {r.model for r in records} | set(self.totals):
            self.totals.setdefault(model, _WorkerTotals()).take_up(
                stats_by_worker(r for r in records if r.model == model), now)

    async def _refresh(self) -> None:
        if self._records_elsewhere:
            # NOTE: as long-lived as a worker's unused files: those of a gateway down meanwhile
            # would be dropped as unused anyway. A Redis out of its maxmemory refuses it: the
            # mark made before lasts until a later refresh renews it, and the reads go on.
            with contextlib.suppress(*REDIS_FULL_ERRORS):
                await self.registry.mark_adapter_records_elsewhere(UNUSED_BLOB_S)
        self.internal_key = await self.registry.internal_key()
        records = await self.registry.workers()
        # NOTE: Redis forgets no model it was told of, unless it lost its data (restarted without
        # persistence, or flushed): models seen before then are still served within the TTL of
        # their last heartbeat, until their workers' next ones tell it again.
        self.seen = {**self.seen, **await self.registry.models_seen()}
        reading = await self.registry.reading_tokenizers()
        for r in records:
            if r.id not in self.workers or self.workers[r.id].beat_at != r.beat_at:
                self._inflight_at_beat[r.id] = self.inflight.get(r.id, 0)
        self.workers = {r.id: r for r in records}
        self._take_up_stats(records)
        # NOTE: a stream still opening to a worker gone holds its own reference. Each worker
        # started takes a new id: those of workers gone are forgotten, but for requests still
        # placed on them (counted down as they end).
        self._opening = {i: bound for i, bound in self._opening.items() if i in self.workers}
        self._inflight_at_beat = {i: n for i, n in self._inflight_at_beat.items() if i in self.workers}
        self.inflight = {i: n for i, n in self.inflight.items() if n or i in self.workers}
        self._down = {i: beat for i, beat in self._down.items()
                      if i in self.workers and self.workers[i].beat_at <= beat}
        # The models to serve, each with the digest of the tokenizer to read its prompts with.
        horizon = time.time() - self.model_ttl_s
        served = {m: s.tokenizer for m, s in self.seen.items() if s.beat_at >= horizon}
        served |= {r.model: r.tokenizer for r in records}  # NOTE: up, whatever its clock says
        up_tokenizers: dict[str, set[str | None]] = {}  # each model's, over its workers up
        for r in records:
            up_tokenizers.setdefault(r.model, set()).add(r.tokenizer)
        agreed = {model: digest for model, (digest, *others) in up_tokenizers.items() if not others}
        for model in (up_tokenizers.keys() - agreed.keys()) & reading.keys():
            # Midway through a rolling upgrade of its tokenizer files: a gateway new to the
            # model reads its prompts as the others do, with those its workers last all had.
            served[model] = reading[model]
        for model, digest in agreed.items():
            if digest is not None and reading.get(model) != digest:
                await self.registry.set_reading_tokenizer(model, digest)
        for model in [m for m in self.clients if m not in served]:
            self._stop_serving(model)
        for model, tokenizer in served.items():
            if model not in self.clients:
                await self._start_serving(model, tokenizer)
        for model, digest in agreed.items():
            client = self.clients[model]
            if digest != client.tokenizer_digest:
                # Every worker of the model now has other tokenizer files (a rolling upgrade
                # done): prompts must be read as they read them.
                client.use_tokenizer(await self._tokenizer(digest), digest)
                logger.info("%s's workers have a new tokenizer (%s): reading prompts with it",
                            model, digest)

    async def _start_serving(self, model: str, tokenizer: str | None) -> None:
        self.clients[model] = client = RemoteEngineClient(
            model, self, await self._tokenizer(tokenizer), tokenizer)
        if self._models.setdefault(model, client) is not client:
            # NOTE: this gateway's own engine (or upstream) of that name serves it: not affected.
            logger.warning("engine workers of %s registered, but this gateway serves %s with its "
                           "own engine, so it sends them nothing", model, model)
            return
        logger.info("serving %s on the workers registered in Redis", model)
        if self._on_serving is not None:
            await self._on_serving(model)

    def _stop_serving(self, model: str) -> None:
        client = self.clients.pop(model)
        if self._models.get(model) is client:
            del self._models[model]
            logger.info("no longer serving %s: none of its workers has sent a heartbeat for "
                        "%.0f s", model, self.model_ttl_s)

    async def _tokenizer(self, digest: str | None) -> Any:
        if digest is None:
            return None
        folder = self._tokenizer_dir / digest
        if not await asyncio.to_thread(_holds_tokenizer, folder, digest):
            files = await self.registry.get_tokenizer(digest)
            if files is None:
                raise RuntimeError(f"the tokenizer {digest} is not in Redis")
            await asyncio.to_thread(_write_folder, folder, files)
        return await asyncio.to_thread(self._load_tokenizer, folder)

    def up(self, model: str) -> list[WorkerRecord]:
        """The model's workers that are up: registered, and not found failing since their last
        heartbeat."""
        return [r for r in self.workers.values() if r.model == model and r.id not in self._down]

    def candidates(self, model: str, exclude: set[str], *,
                   adapter_rank: int | None = None) -> list[Candidate]:
        """The model's workers that are up, less those in `exclude` (with `adapter_rank`, only
        those that serve adapters of that rank; 0: any adapter), with their load as this
        gateway best knows it."""
        return [Candidate(r.id, self.load_of(r), frozenset(r.adapters_device),
                          frozenset(r.adapters_host))
                for r in self.up(model)
                if r.id not in exclude and (adapter_rank is None or r.serves_rank(adapter_rank))]

    def load_of(self, record: WorkerRecord) -> int:
        """The worker's load now: other gateways' requests as of its last heartbeat, plus this
        gateway's requests now.

        NOTE: its heartbeat alone is up to a second old; placing a burst of requests by it sends
        them all to the worker that was idle then (and the next burst all to the other).
        """
        others = max(0, record.load - self._inflight_at_beat.get(record.id, 0))
        return others + self.inflight.get(record.id, 0)

    @contextlib.contextmanager
    def placed_on(self, worker_id: str) -> Iterator[None]:
        """Count a request against the worker's load while the block runs.

        NOTE: from the moment it is placed, not from its first token: queued on the worker, or
        in prefill, it loads the worker already, and a burst placed meanwhile must see it.
        """
        self.inflight[worker_id] = self.inflight.get(worker_id, 0) + 1
        try:
            yield
        finally:
            self.inflight[worker_id] -= 1

    def mark_down(self, worker_id: str) -> None:
        """Pass over this worker until it heartbeats again."""
        record = self.workers.get(worker_id)
        if record is not None:
            self._down[worker_id] = record.beat_at
            logger.warning("worker %s at %s failed; placing its requests elsewhere", worker_id,
                           record.url)

    async def send_adapter(self, worker: WorkerRecord, adapter: AdapterRef) -> None:
        """Send the adapter's files to the worker. Requests that need them there while they are
        on their way wait for that one transfer and share its outcome, instead of each reading
        and sending the files again."""
        key = (worker.id, adapter.digest)
        transfer = self._transfers.get(key)
        if transfer is None:
            transfer = asyncio.create_task(self._put_adapter(worker, adapter))
            self._transfers[key] = transfer
            transfer.add_done_callback(functools.partial(self._transfer_done, key))
        # NOTE: shielded: a request whose client goes away stops waiting, but the transfer goes
        # on for the others.
        await asyncio.shield(transfer)

    def _transfer_done(self, key: tuple[str, str], transfer: asyncio.Task[None]) -> None:
        del self._transfers[key]  # the next request that finds the files missing sends them anew
        _retrieve_exception(transfer)

    async def _put_adapter(self, worker: WorkerRecord, adapter: AdapterRef) -> None:
        response = await self._put_files(worker, adapter)
        # NOTE: a worker refuses (400) files that do not hash to their digest: this gateway's copy
        # was damaged on its disk, so every worker would refuse it. Sent again once replaced (by
        # this transfer, or by another worker's that found the same).
        if response.status_code == 400 and self._ensure_intact_copy is not None \
                and await self._ensure_intact_copy(adapter.digest):
            response = await self._put_files(worker, adapter)
        if response.status_code == 400:
            raise DamagedAdapterCopy(
                f"this gateway's copy of the files of adapter {adapter.digest} is damaged (worker "
                f"{worker.id} found they do not hash to it), and the store holds no good copy to "
                "replace it; upload the adapter again")
        if response.status_code == 507:
            raise _Retry(_worker_message(response), out_of_space=True)
        if response.status_code != 204:
            raise _Retry(f"the worker did not take the adapter's files: HTTP {response.status_code}")

    async def _put_files(self, worker: WorkerRecord, adapter: AdapterRef) -> httpx.Response:
        try:
            parts = await _adapter_parts(adapter.path)
        except FileNotFoundError:  # the adapter was deleted meanwhile, or its copy here lost
            raise EngineFailure(f"this gateway has no copy of the files of adapter "
                                f"{adapter.digest} to send to worker {worker.id}") from None
        return await self.http.put(f"{worker.url}{ADAPTERS_PATH}/{adapter.digest}", files=parts)


class RemoteEngineClient(TextCodec):
    """One model served by the workers in a WorkerPool."""

    def use_tokenizer(self, tokenizer: Any | None, digest: str | None = None) -> None:
        super().use_tokenizer(tokenizer)
        self.tokenizer_digest = digest

    def __init__(self, model: str, pool: WorkerPool, tokenizer: Any, tokenizer_digest: str | None):
        super().__init__(tokenizer)
        self.tokenizer_digest = tokenizer_digest  # of the workers' tokenizer files it reads with
        self.model = model
        self._pool = pool

    def _records(self) -> list[WorkerRecord]:
        return [r for r in self._pool.workers.values() if r.model == self.model]

    @property
    def max_model_len(self) -> int:
        """The shortest context of the model's workers; while none is registered (say, during
        a restart), the one its latest heartbeat gave, so that no answer is sized for a context
        of 0, and every gateway says the same."""
        lengths = [r.max_model_len for r in self._records()]
        if lengths:
            return min(lengths)
        seen = self._pool.seen.get(self.model)
        return 0 if seen is None else seen.max_model_len

    @property
    def supports_adapters(self) -> bool:
        """Whether a worker of the model with adapter slots is registered, or sent a heartbeat
        within the model's TTL: one restarting (the only one, among workers without slots)
        leaves its adapters' calls and uploads a 503 to retry, not a 400 saying none runs them."""
        if any(r.supports_adapters for r in self._records()):
            return True
        seen = self._pool.seen.get(self.model)
        return seen is not None and seen.adapters_beat_at is not None and \
            seen.adapters_beat_at >= time.time() - self._pool.model_ttl_s

    @property
    def why_no_adapters(self) -> str:
        return ("is served by engine workers all started without adapter slots (--max-loras 0), so "
                "it runs no adapters: the operator must start a worker of it with --max-loras "
                "above 0")

    @property
    def max_adapter_rank(self) -> float:
        """No fixed limit: the model's workers come and go, each with its own --max-lora-rank.
        A request is placed on one that serves its adapter's rank (a 503 asking to retry while
        none does: see _unavailable)."""
        return math.inf

    @property
    def counts_text_bytes(self) -> bool:
        return False

    def check_options(self, options: SamplingOptions) -> None:
        """Nothing: workers run the local engine, which serves every option."""

    async def check_adapter(self, folder: str) -> AdapterInfo:
        """The adapter checked by a worker of the model that takes the highest ranks, so that it
        is accepted if any worker can serve it; one that cannot be reached is passed over for
        the next, as for a request. A worker of the model with a higher --max-lora-rank that
        sent a heartbeat within the model's TTL (one restarting) counts as up: the worker up
        checks the adapter against that limit, and its calls wait for such a worker (503)."""
        pool, tried, out_of_space = self._pool, set(), []
        parts = await _adapter_parts(folder)
        for _ in range(_MAX_PLACEMENTS):
            candidates = await self._candidates(tried, adapter_rank=0)
            if not candidates:
                break
            widest = max(pool.workers[c.id].rank_limit for c in candidates)
            worker = pool.workers[place([c for c in candidates
                                         if pool.workers[c.id].rank_limit == widest], "check").id]
            tried.add(worker.id)
            recent = self._widest_rank_seen()
            try:
                response = await pool.http.post(
                    worker.url + CHECK_ADAPTER_PATH, files=parts,
                    params={MAX_LORA_RANK_PARAM: recent} if recent > widest else None)
            except httpx.TransportError as error:
                if out_of_open_files(error):
                    raise _out_of_files(f"adapter check on worker {worker.id}", error)
                pool.mark_down(worker.id)
                logger.warning("adapter check not done on worker %s (%s); trying another",
                               worker.id, _describe(error))
                continue
            if response.status_code == 503:  # it is shutting down: another worker checks it
                continue
            if response.status_code == 507:  # it has no room for the files: another may have
                logger.warning("adapter check not done on worker %s (%s); trying another",
                               worker.id, _worker_message(response))
                out_of_space.append(worker.id)
                continue
            if response.status_code == 422:
                raise AdapterRejected(_worker_message(response))
            if response.status_code != 200:
                raise EngineFailure(f"worker {worker.id} could not check the adapter: "
                                    f"HTTP {response.status_code}")
            return msgspec.json.decode(response.content, type=AdapterInfo)
        raise self._none_took(tried, out_of_space, adapter_rank=0)

    def _widest_rank_seen(self) -> int:
        """The highest --max-lora-rank of the model's workers with adapter slots that sent a
        heartbeat within the model's TTL (0: none did)."""
        seen = self._pool.seen.get(self.model)
        return 0 if seen is None else seen.widest_rank_since(time.time() - self._pool.model_ttl_s)

    async def _candidates(self, tried: set[str], *,
                          adapter_rank: int | None) -> list[Candidate]:
        """The model's workers to place on (see WorkerPool.candidates), less those `tried`."""
        candidates = self._pool.candidates(self.model, tried, adapter_rank=adapter_rank)
        if not candidates and not tried:
            # NOTE: the pool's view is up to poll_s old: a worker may have (re)joined since.
            with contextlib.suppress(Exception):
                await self._pool.refresh()
            candidates = self._pool.candidates(self.model, tried, adapter_rank=adapter_rank)
        return candidates

    async def generate(self, prompt_token_ids: list[int], options: SamplingOptions, *,
                       request_id: str, tenant: str | None = None,
                       adapter: AdapterRef | None = None) -> AsyncIterator[GenerationChunk]:
        body = msgspec.json.encode(GenerateBody(
            model=self.model, prompt_token_ids=prompt_token_ids, options=options,
            request_id=request_id, tenant=tenant,
            adapter=None if adapter is None else adapter.digest))
        async with self._started(body, request_id, adapter) as (first, lines, worker_id):
            try:
                line = first
                while True:
                    if line.error is not None:
                        logger.warning("request %s: worker %s failed: %s", request_id, worker_id,
                                       line.error)
                        raise EngineFailure(f"worker {worker_id} failed: {line.error}")
                    if line.stopped is not None:
                        logger.warning("request %s: worker %s shut down before it finished",
                                       request_id, worker_id)
                        raise EngineStopped(f"engine worker {worker_id} shut down before this "
                                            "request finished")
                    yield line.chunk
                    if line.chunk.finished:
                        return
                    line = await anext(lines)
            except StopAsyncIteration:
                logger.warning("request %s: worker %s ended its stream early", request_id,
                               worker_id)
                raise EngineFailure(f"worker {worker_id} ended the stream early") from None
            except httpx.TransportError as error:
                logger.warning("request %s: lost worker %s mid-answer (%s)", request_id,
                               worker_id, _describe(error))
                self._pool.mark_down(worker_id)
                raise EngineFailure(f"lost worker {worker_id} mid-answer ({_describe(error)}); "
                                    "retry the request") from None

    @contextlib.asynccontextmanager
    async def _started(self, body: bytes, request_id: str, adapter: AdapterRef | None
                       ) -> AsyncIterator[tuple[StreamLine, AsyncIterator[StreamLine], str]]:
        """The first line and the rest of the stream of the first worker that starts the
        request, and that worker's id. The request counts against each worker's load from when
        it is placed there until that worker is passed over, or the block ends (which closes the
        stream, so that the worker aborts the request if it still runs)."""
        pool, tried, out_of_space = self._pool, set(), []
        digest = None if adapter is None else adapter.digest
        rank = None if adapter is None else adapter.rank
        for _ in range(_MAX_PLACEMENTS):
            candidates = await self._candidates(tried, adapter_rank=rank)
            if not candidates:
                break
            worker = pool.workers[place(candidates, digest or request_id, digest, pool.slack).id]
            tried.add(worker.id)
            with pool.placed_on(worker.id):
                lines = _stream_lines(pool, worker, body, adapter)
                try:
                    first = await anext(lines)
                    if first.stopped is not None:  # nothing came of it yet: nothing is lost
                        await lines.aclose()
                        raise _Retry(first.stopped)
                except (httpx.TransportError, StopAsyncIteration, _Retry) as error:
                    # NOTE: the generator raised (or was closed), so its connection is closed.
                    if out_of_open_files(error):  # every worker would fail the same way
                        raise _out_of_files(f"request {request_id} on worker {worker.id}", error)
                    if not isinstance(error, _Retry) or error.down:
                        pool.mark_down(worker.id)
                    if isinstance(error, _Retry) and error.out_of_space:
                        out_of_space.append(worker.id)
                    logger.warning("request %s not started on worker %s (%s); placing it again",
                                   request_id, worker.id, _describe(error))
                    continue
                try:
                    if first.rejected is not None:
                        raise RequestRejected(first.rejected.message, first.rejected.param)
                    yield first, lines, worker.id
                finally:
                    await lines.aclose()
                return
        raise self._none_took(tried, out_of_space, rank)

    async def ensure_available(self, adapter: AdapterRef | None = None) -> None:
        rank = None if adapter is None else adapter.rank
        if not await self._candidates(set(), adapter_rank=rank):
            raise self._unavailable(rank)

    def _none_took(self, tried: set[str], out_of_space: list[str],
                   adapter_rank: int | None) -> EngineFailure:
        """The failure of a request no worker took: WorkersOutOfSpace when every worker tried
        had no room for its adapter's files, else EngineUnavailable saying why (_unavailable)."""
        if out_of_space and len(out_of_space) == len(tried):
            return WorkersOutOfSpace(
                f"the engine workers of {self.model!r} that could run this adapter "
                f"({', '.join(out_of_space)}) have no disk space left to take its files; retrying "
                "will not help until their operator frees space there")
        return self._unavailable(adapter_rank)

    def _unavailable(self, adapter_rank: int | None = None) -> EngineUnavailable:
        """Why no worker took a request (for an adapter of `adapter_rank`): AdapterNotServedNow
        when workers of the model are up but none runs the adapter."""
        up = self._pool.up(self.model)
        limits = [r.rank_limit for r in up if r.supports_adapters]
        if adapter_rank is not None and up and not limits:
            return AdapterNotServedNow(
                f"no engine worker of {self.model!r} with adapter slots is up now (those up were "
                "started with --max-loras 0); retry shortly, or start one with --max-loras above 0")
        if adapter_rank is not None and limits and max(limits) < adapter_rank:
            # NOTE: its upload was checked by a worker that served it; that one has left.
            return AdapterNotServedNow(
                f"no engine worker of {self.model!r} that is up serves adapters of rank "
                f"{adapter_rank} (the highest rank they take is {max(limits):.0f}); start one "
                f"with --max-lora-rank {adapter_rank} or more, or retry shortly")
        return EngineUnavailable(
            f"no engine worker serving {self.model!r} is available now; start one with "
            f"`switchboard worker --model {self.model}=PATH --redis URL`, or retry shortly")

    def stats(self) -> EngineStats:
        """Over the model's workers as the pool last read them (WorkerPool._take_up_stats)."""
        return self._pool.totals.setdefault(self.model, _WorkerTotals()).total()

    def close(self) -> None:
        """Nothing to stop here: the pool's connections close with the gateway's lifespan."""


def stats_by_worker(records: Iterable[WorkerRecord]) -> dict[str, EngineStats]:
    """The engine stats of `records` by worker id, but for stats that do not read as this
    gateway's EngineStats (a worker of another version): they are left out of the totals, and
    the registry's reads (which take them up) go on."""
    stats = {}
    for r in records:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            stats[r.id] = msgspec.json.decode(r.stats, type=EngineStats)
    return stats


# EngineStats' cumulative counters; its other fields are gauges of the engines up now.
_COUNTERS = ("num_prompt_tokens", "num_generation_tokens", "num_preemptions", "adapter_hits",
             "adapter_misses", "adapter_evictions", "adapter_disk_loads",
             "prefix_cache_queried_tokens", "prefix_cache_hit_tokens")


class _WorkerTotals:
    """A model's engine stats over its workers. Its counters never go down as workers come and
    go (Prometheus reads a counter going down as a reset, and counts every other worker's whole
    total again): a worker gone still adds what it counted; one back under its id (its
    heartbeats lapsed while it hung) counts once. A worker started again takes a new id, counting
    from 0. The prefix cache's hit rate is their hits over their lookups, since start, as one
    engine's is (weighting their own rates by their prompt tokens computed weighed a worker
    whose cache served more the less)."""

    FOLD_AFTER_S = 3600.0  # a worker gone that long is not coming back under its id

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, EngineStats]] = {}  # by worker id: seen at, stats
        self._folded = dict.fromkeys(_COUNTERS, 0)  # those of workers gone for FOLD_AFTER_S
        self._live: list[EngineStats] = []  # of the workers registered now: their gauges

    def take_up(self, current: dict[str, EngineStats], now: float) -> None:
        """Keep the stats of `current`, the workers registered now (by id), read at monotonic
        time `now`: those of a worker that then leaves are its last."""
        self._live = list(current.values())
        self._latest |= {worker_id: (now, stats) for worker_id, stats in current.items()}
        for worker_id, (seen_at, stats) in list(self._latest.items()):
            if now - seen_at > self.FOLD_AFTER_S:
                for name in _COUNTERS:
                    self._folded[name] += getattr(stats, name)
                del self._latest[worker_id]

    def total(self) -> EngineStats:
        """The gauges of the workers last taken up, the counters of every worker ever taken up."""
        gauges = {f: sum(getattr(s, f) for s in self._live) for f in EngineStats.__struct_fields__
                  if f not in _COUNTERS and f != "prefix_cache_hit_rate"}
        counters = {f: self._folded[f] + sum(getattr(s, f) for _, s in self._latest.values())
                    for f in _COUNTERS}
        queried = counters["prefix_cache_queried_tokens"]
        rate = counters["prefix_cache_hit_tokens"] / queried if queried else 0.0
        return EngineStats(prefix_cache_hit_rate=rate, **gauges, **counters)


class _InternalKeyAuth(httpx.Auth):
    """Signs each request to a worker with the internal key. A worker's 401 re-reads the key
    from Redis and sends the request once more if it changed: a Redis restarted without its data
    holds a new key (made by the first gateway or worker to ask for one), which the others take
    up at their next poll or heartbeat; until then every call was refused, and the gateway
    answered 503 "start a worker" with its workers up."""

    def __init__(self, pool: WorkerPool):
        self._pool = pool

    def sync_auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        raise RuntimeError("workers are reached with an httpx.AsyncClient only")

    async def async_auth_flow(self, request: httpx.Request) -> AsyncIterator[httpx.Request]:
        sent_key = self._pool.internal_key
        request.headers["Authorization"] = f"Bearer {sent_key}"
        response = yield request
        if response.status_code != 401:
            return
        with contextlib.suppress(Exception):  # Redis down: the worker's refusal stands
            self._pool.internal_key = await self._pool.registry.internal_key()
        if self._pool.internal_key != sent_key:
            request.headers["Authorization"] = f"Bearer {self._pool.internal_key}"
            yield request


class _Retry(Exception):
    """The worker refused the request in a way another worker may not; `down`: it is not a
    working worker at all (pass over it until it heartbeats again); `out_of_space`: it has no
    disk space left for the request's adapter files."""

    def __init__(self, message: str, *, down: bool = False, out_of_space: bool = False):
        super().__init__(message)
        self.down = down
        self.out_of_space = out_of_space


def _out_of_files(what: str, error: BaseException) -> GatewayOutOfFiles:
    """The failure of a connection this gateway had no open file left for: the worker is not
    passed over (nothing says it failed), and the operator is told what to raise."""
    logger.error("%s not sent: this gateway is out of open files (%s); raise its open-files "
                 "limit (ulimit -n, LimitNOFILE= in systemd) or run more gateways", what,
                 _describe(error))
    return GatewayOutOfFiles()


def _retrieve_exception(task: asyncio.Task) -> None:
    """Mark a shared task's exception as retrieved, so that asyncio does not warn of it when every
    caller waiting for it went away (each that waits gets it)."""
    if not task.cancelled():
        task.exception()


def _worker_message(response: httpx.Response) -> str:
    """The message of a worker's WorkerError answer (read already), or its status."""
    try:
        return msgspec.json.decode(response.content, type=WorkerError).message
    except (msgspec.DecodeError, msgspec.ValidationError):
        return f"HTTP {response.status_code}"


async def _stream_lines(pool: WorkerPool, worker: WorkerRecord, body: bytes,
                        adapter: AdapterRef | None) -> AsyncIterator[StreamLine]:
    """The worker's answer to one generate request, line by line (sending the adapter's files
    first if the worker lacks them). Refusals before the stream are RequestRejected (the request
    is wrong), EngineFailure (its engine failed it) or _Retry."""
    for attempt in range(2):
        async with contextlib.AsyncExitStack() as stack:
            async with pool.opening(worker.id):
                response = await stack.enter_async_context(pool.http.stream(
                    "POST", worker.url + GENERATE_PATH, content=body, timeout=_STREAM_TIMEOUT))
            if response.status_code == 200:
                async for line in sse_lines(response.aiter_bytes()):
                    if line.startswith("data: "):
                        yield msgspec.json.decode(line[6:], type=StreamLine)
                return
            try:
                error = msgspec.json.decode(await response.aread(), type=WorkerError)
            except (msgspec.DecodeError, msgspec.ValidationError):
                # Not a worker's answer (a proxy's error page, a port reused by another server).
                raise _Retry(f"HTTP {response.status_code} that is not a worker's answer",
                             down=True) from None
        if response.status_code == 409 and adapter is not None and attempt == 0:
            await pool.send_adapter(worker, adapter)
            continue
        if response.status_code == 400:
            raise RequestRejected(error.message, error.param)
        if error.kind == "engine_failure":
            raise EngineFailure(f"worker {worker.id} failed: {error.message}")
        raise _Retry(f"HTTP {response.status_code} {error.kind}: {error.message}")


async def _adapter_parts(folder: str) -> dict[str, tuple[str, bytes]]:
    """An adapter folder's files as multipart parts."""
    def read() -> dict[str, tuple[str, bytes]]:
        return {name: (name, (Path(folder) / name).read_bytes()) for name in ADAPTER_FILES}
    return await asyncio.to_thread(read)


def _holds_tokenizer(folder: Path, digest: str) -> bool:
    """Whether this gateway's copy of the tokenizer files `digest` is in `folder`, intact. A
    damaged one (a disk error, a crash as it was written) is removed, to be fetched again: it
    once kept the gateway from starting until removed by hand."""
    if not folder.is_dir():
        return False
    try:
        files = {path.name: path.read_bytes() for path in folder.iterdir()}
    except OSError as error:
        files, why = {}, str(error)
    else:
        why = "they do not hash to it"
    if files and files_digest(files) == digest:
        return True
    logger.warning("the copy of tokenizer %s in %s is damaged (%s): fetching it again from Redis",
                   digest, folder, why)
    shutil.rmtree(folder, ignore_errors=True)
    return False


def _write_folder(folder: Path, files: dict[str, bytes]) -> None:
    """Write `files` as `folder` at once (gateways sharing a data folder may race to write it)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        for name, data in files.items():
            path = tmp / Path(name).name  # NOTE: base names only, never a path
            with open(path, "wb") as out:
                out.write(data)
                os.fsync(out.fileno())  # else a power cut can leave the folder with cut files
        try:
            tmp.rename(folder)
        except OSError:
            if not folder.is_dir():  # else another process wrote the same files first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__
