"""An engine worker: one model's engine behind the internal HTTP API (gateway/worker_api.py),
registered in Redis with a heartbeat (store/workers.py) so gateways find it and place requests.

Adapter files reach a worker from the gateways, by digest, the first time a request needs them;
the worker keeps them in its own blob folder, and drops those no request will need when it starts
and every SWEEP_PERIOD_S: those of deleted adapters, where the registry's Redis holds every
gateway's adapter records, else (gateways keeping them in stores of their own, which workers
cannot read) those no request used for UNUSED_BLOB_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from engine.tokenizer import has_tokenizer
from gateway.engine_client import (AdapterRef, AdapterRejected, EngineFailure,
                                   GenerationChunk, RequestRejected)
from gateway.errors import quoted, too_deep_message
from gateway.local_engine import LocalEngineClient
from gateway.middleware import InFlight
from gateway.remote import DEFAULT_POLL_S
from gateway.sse import EventStreamResponse, event
from gateway.worker_api import (ADAPTERS_PATH, CHECK_ADAPTER_PATH, DISK_FULL, GENERATE_PATH,
                                KEEPALIVE_S, MAX_LORA_RANK_PARAM, GenerateBody, StreamLine,
                                WorkerError)
from store import UNAVAILABLE_ERRORS, RedisStore
from store.blobs import (ADAPTER_FILES, SWEEP_PERIOD_S, UNUSED_BLOB_S, BlobStore, digest_files,
                         drop_deleted_adapters, drop_unused_adapters, is_out_of_space)
from store.errors import InvalidName
from store.models import validate_digest
from store.workers import Periodic, WorkerRecord, WorkerRegistry

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_LAPSE_BEATS = 3  # a record lives this many heartbeats: one or two missed do not drop it
# How long a worker that left the pool still takes connections: gateways read the registry every
# DEFAULT_POLL_S, and one that places a request here meanwhile is refused with 503 `unavailable`
# and places it elsewhere, where a closed port would have it take this worker for failed.
_LEAVING_S = 2 * DEFAULT_POLL_S
# How often a key a worker does not know may make it read the key from Redis again: a caller
# sending wrong keys costs Redis at most this many reads.
KEY_REREAD_S = 0.25
_ENDING_TIMEOUT_S = 10.0  # for the requests cancelled at a shutdown's deadline to answer
# What gateways need to load a worker's tokenizer (transformers reads config.json for its class).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                    "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "config.json")


@dataclass
class Worker:
    """What the worker's handlers share."""

    model: str
    engine: LocalEngineClient
    url: str  # where gateways reach this worker
    blobs: BlobStore
    registry: WorkerRegistry
    tokenizer_files: dict[str, bytes]
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    lapse_beats: int = DEFAULT_LAPSE_BEATS  # its record lapses this many beats after it is sent
    store_url: str | None = None  # the registry's Redis, as a store; None: blobs are never dropped
    blob_sweep_s: float = SWEEP_PERIOD_S  # how often it drops the files no request will need
    id: str = field(default_factory=lambda: secrets.token_hex(6))
    internal_key: str | None = None  # read from Redis at start, refreshed with each heartbeat
    is_closing: bool = False  # it has left the pool: it takes no more requests
    _beating: Periodic | None = field(default=None, init=False, repr=False)
    _key_read_at: float = field(default=-math.inf, init=False, repr=False)  # time.monotonic()

    def record(self, tokenizer: str | None) -> WorkerRecord:
        stats = self.engine.stats()
        device, host = self.engine.resident_adapters()
        return WorkerRecord(
            id=self.id, url=self.url, model=self.model, max_model_len=self.engine.max_model_len,
            max_loras=self.engine.max_loras, max_lora_rank=self.engine.max_adapter_rank,
            tokenizer=tokenizer, num_running=stats.num_running,
            num_waiting=stats.num_waiting, adapters_device=device, adapters_host=host,
            stats=msgspec.json.encode(stats), beat_at=time.time())

    async def beat(self) -> None:
        """Publish this worker's record (and what gateways need to reach it) once."""
        self.internal_key = await self.registry.internal_key()
        tokenizer = (await self.registry.put_tokenizer(self.tokenizer_files)
                     if self.tokenizer_files else None)
        await self.registry.heartbeat(self.record(tokenizer), self.heartbeat_s * self.lapse_beats)

    async def takes_key(self, authorization: bytes) -> bool:
        """Whether an Authorization header carries the internal key. One that does not has the
        key read again from Redis (at most every KEY_REREAD_S): a Redis restarted without its
        data holds a new key, which gateways may take up before this worker's next heartbeat."""
        if self._is_internal_key(authorization):
            return True
        if time.monotonic() - self._key_read_at < KEY_REREAD_S:
            return False
        self._key_read_at = time.monotonic()
        with contextlib.suppress(Exception):  # Redis down: the key this worker has stands
            self.internal_key = await self.registry.internal_key()
        return self._is_internal_key(authorization)

    def _is_internal_key(self, authorization: bytes) -> bool:
        return self.internal_key is not None and secrets.compare_digest(
            authorization, f"Bearer {self.internal_key}".encode())

    async def drop_unneeded_blobs(self) -> None:
        """Delete the blobs no request will need, and leftovers of crashed puts: where every
        gateway keeps its adapter records in the registry's Redis, those no record references
        (adapters deleted since they were sent here); else, as some adapters that exist have no
        record there, those no request used for UNUSED_BLOB_S. Keep them all if Redis cannot be
        reached."""
        if self.store_url is None:
            return
        try:
            if await self.registry.are_adapter_records_elsewhere():
                await drop_unused_adapters(self.blobs, UNUSED_BLOB_S)
                return
            store = await RedisStore.open(self.store_url)
            try:
                await drop_deleted_adapters(self.blobs, store)
            finally:
                await store.close()
        except UNAVAILABLE_ERRORS as error:
            logger.warning("kept the adapter files in %s: cannot ask the store which adapters were "
                           "deleted: %s", self.blobs.root, error)

    async def dropping_a_damaged_copy(self, answer: AsyncGenerator[GenerationChunk, None],
                                      adapter: AdapterRef | None) -> AsyncIterator[GenerationChunk]:
        """`answer`, whose failure also deletes this worker's copy of the adapter's files if they
        were damaged on its disk: the gateway's next request for it is then answered 409 and
        sends the files again, instead of failing the same way until the worker's disk is mended."""
        async with contextlib.aclosing(answer):
            try:
                async for chunk in answer:
                    yield chunk
            except EngineFailure:
                if adapter is not None:
                    async with self.blobs.locks.hold(adapter.digest):
                        await asyncio.to_thread(self.blobs.delete_if_damaged, adapter.digest)
                raise

    async def join_the_pool(self) -> None:
        """Register (raising if Redis cannot be reached), then heartbeat until it leaves the pool,
        riding out Redis outages."""
        await self.beat()
        self._beating = Periodic(self.beat, self.heartbeat_s, "heartbeating to Redis")

    async def begin_shutdown(self) -> None:
        """What the server awaits as its graceful shutdown begins, before it stops taking
        connections: leave the pool, and wait until gateways have read the registry since. The
        requests in flight go on until they finish or the shutdown's deadline ends them."""
        await self.leave_the_pool()
        await asyncio.sleep(_LEAVING_S)

    async def leave_the_pool(self) -> None:
        """Take no more requests and leave the registry at once (once is enough)."""
        if self.is_closing:
            return
        self.is_closing = True
        if self._beating is not None:
            # NOTE: stopped first: a heartbeat landing after the removal would put the record back.
            await self._beating.stop()
        with contextlib.suppress(Exception):  # Redis may be gone: the record lapses anyway
            await self.registry.remove(self.id)
        logger.info("worker %s left the pool", self.id)


def tokenizer_files(model_dir: Path) -> dict[str, bytes]:
    """The model folder's tokenizer files, by name (empty: the model has no tokenizer)."""
    if not has_tokenizer(model_dir):
        return {}
    return {name: (model_dir / name).read_bytes() for name in _TOKENIZER_FILES
            if (model_dir / name).is_file()}


def _worker(request: Request) -> Worker:
    return request.app.state.worker


def _error(status: int, kind: str, message: str, param: str | None = None) -> Response:
    return Response(msgspec.json.encode(WorkerError(kind, message, param)), status,
                    media_type="application/json")


async def _gateway_left(request: Request, error: ClientDisconnect) -> Response:
    """A gateway that hung up partway through a body (its client left, or it stopped): nobody
    reads the answer, and the call kept nothing (a PUT's files are in a temporary folder), so
    this is one line of log where it would be a 500 with a traceback, as if the worker failed."""
    logger.info("%s %s: the gateway closed the connection before sending its whole body",
                request.method, request.url.path)
    return _error(499, "client_closed", "the gateway closed the connection")


def _stopping() -> Response:
    return _error(503, "unavailable", "this worker is shutting down")


async def _unauthorized(request: Request) -> Response | None:
    # NOTE: as bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500),
    # and a header is read as latin-1, so any caller can send them.
    given = request.headers.get("authorization", "").encode("latin-1")
    if not await _worker(request).takes_key(given):
        return _error(401, "unauthorized", "this is a Switchboard worker's internal API: send "
                      "the internal key from Redis")
    return None


async def generate(request: Request) -> Response:
    worker = _worker(request)
    if (refused := await _unauthorized(request)) is not None:
        return refused
    if worker.is_closing:
        return _stopping()
    try:
        body = msgspec.json.decode(await request.body(), type=GenerateBody)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as error:
        return _error(400, "rejected", f"malformed request: {error}")
    except RecursionError:  # msgspec's, for arrays and objects nested past Python's depth limit
        return _error(400, "rejected", f"malformed request: {too_deep_message('the body')}")
    if body.model != worker.model:
        return _error(404, "unknown_model", f"this worker serves {worker.model!r}, not {quoted(body.model)}")
    adapter = None
    if body.adapter is not None:
        # NOTE: marked used under its lock, so that drop_unused_adapters keeps it for this request.
        async with worker.blobs.locks.hold(body.adapter):
            folder = worker.blobs.mark_used(body.adapter)
        if folder is None:
            return _error(409, "adapter_missing", f"send the files of adapter {body.adapter}")
        adapter = AdapterRef(body.adapter, str(folder))
    answer = _KeptAlive(worker.dropping_a_damaged_copy(
        worker.engine.generate(body.prompt_token_ids, body.options, request_id=body.request_id,
                               tenant=body.tenant, adapter=adapter), adapter))
    # NOTE: answered at once, not after the first chunk: a request queued behind others for
    # minutes is not a silent worker (the keepalives say so).
    return EventStreamResponse(answer.lines(), on_close=answer.close, at_shutdown=_STOPPED_STREAM_END)


# How a stream still running at the shutdown's deadline ends: the request is gone.
_STOPPED_STREAM_END = event(StreamLine(stopped="the worker shut down before the request finished"))


class _KeptAlive:
    """An engine answer as generate-stream lines, read ahead by a task of its own so that a
    keepalive comment goes out whenever the next line takes longer than KEEPALIVE_S."""

    def __init__(self, stream: AsyncIterator[GenerationChunk]):
        self._stream = stream
        self._lines: asyncio.Queue[StreamLine | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for chunk in self._stream:
                self._lines.put_nowait(StreamLine(chunk=chunk))
        except RequestRejected as error:
            self._lines.put_nowait(StreamLine(rejected=WorkerError("rejected", str(error),
                                                                   error.param)))
        except EngineFailure as error:
            self._lines.put_nowait(StreamLine(error=str(error)))
        finally:
            self._lines.put_nowait(None)

    async def lines(self) -> AsyncIterator[bytes]:
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    line = await self._lines.get()
            except TimeoutError:
                yield b": keepalive\n\n"
                continue
            if line is None:
                return
            yield event(line)

    async def close(self) -> None:
        """Stop reading; an answer still running is aborted (its stream closes)."""
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._stream.aclose()


async def put_adapter(request: Request) -> Response:
    """Keep an adapter's files under their digest (checked against the files)."""
    worker = _worker(request)
    if (refused := await _unauthorized(request)) is not None:
        return refused
    digest = request.path_params["digest"]
    try:
        validate_digest(digest)
    except InvalidName as error:
        return _error(400, "rejected", str(error))
    try:
        async with _received_files(request) as folder:
            if folder is None or await asyncio.to_thread(digest_files, folder) != digest:
                return _error(400, "rejected", f"the files sent are not those of adapter {digest}")
            await asyncio.to_thread(worker.blobs.put, folder)
    except OSError as error:
        return _out_of_space(worker, error)
    return Response(status_code=204)


async def check_adapter(request: Request) -> Response:
    """Validate adapter files against this worker's model (for the gateway's upload API), up to
    the rank limit the gateway asks for if that is above this worker's."""
    worker = _worker(request)
    if (refused := await _unauthorized(request)) is not None:
        return refused
    asked_rank = request.query_params.get(MAX_LORA_RANK_PARAM)
    if asked_rank is not None and not (asked_rank.isascii() and asked_rank.isdecimal()):
        return _error(400, "rejected", f"{MAX_LORA_RANK_PARAM} must be a whole number, got "
                      f"{quoted(asked_rank)}")
    try:
        async with _received_files(request) as folder:
            if folder is None:
                return _error(400, "rejected", f"send the files {', '.join(ADAPTER_FILES)}")
            try:
                info = await worker.engine.check_adapter(
                    str(folder), max_lora_rank=None if asked_rank is None else int(asked_rank))
            except AdapterRejected as error:
                return _error(422, "adapter_rejected", str(error))
    except OSError as error:
        return _out_of_space(worker, error)
    return Response(msgspec.json.encode(info), media_type="application/json")


def _out_of_space(worker: Worker, error: OSError) -> Response:
    """507 `disk_full` for adapter files this worker has no disk space left to take (in TMPDIR,
    where they arrive, or its data folder, where they are kept): the gateway places the request
    on another worker, or tells its caller that only an operator can mend it. Any other OSError
    is raised again."""
    if not is_out_of_space(error):
        raise error
    logger.warning("refused adapter files: no disk space left for them: %s", error)
    return _error(507, DISK_FULL, f"worker {worker.id} has no disk space left to take adapter "
                  f"files ({error}): free space in its data folder or TMPDIR")


@contextlib.asynccontextmanager
async def _received_files(request: Request) -> AsyncIterator[Path | None]:
    """The request's adapter files in a temporary folder (None if one is missing), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="sb-worker-"))
    try:
        async with request.form() as form:
            parts = [form.get(name) for name in ADAPTER_FILES]
            if not all(isinstance(p, UploadFile) for p in parts):
                yield None
                return
            await asyncio.to_thread(_save_parts, parts, folder)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _save_parts(parts: list[UploadFile], folder: Path) -> None:
    for name, part in zip(ADAPTER_FILES, parts):
        with open(folder / name, "wb") as out:
            shutil.copyfileobj(part.file, out)


async def health(request: Request) -> Response:
    worker = _worker(request)
    status = "closing" if worker.is_closing else "ok"
    return Response(msgspec.json.encode({"status": status, "id": worker.id, "model": worker.model}),
                    503 if worker.is_closing else 200, media_type="application/json")


def create_worker_app(worker: Worker) -> Starlette:
    """The worker's internal API; its lifespan drops the blobs no request will need (then every
    `worker.blob_sweep_s`), registers the worker and heartbeats until shutdown (failing to start
    if Redis cannot be reached). The server should await `worker.begin_shutdown()` as its
    shutdown begins: the lifespan's end comes only once the requests in flight have ended."""

    requests: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # NOTE: before serving: a request handed a blob's folder must not see it deleted.
        await worker.drop_unneeded_blobs()
        await worker.join_the_pool()
        logger.info("worker %s serves %s at %s", worker.id, worker.model, worker.url)
        sweeping = Periodic(worker.drop_unneeded_blobs, worker.blob_sweep_s,
                            "dropping the adapter files no request will need")
        try:
            yield
        finally:
            if requests:  # cancelled at the deadline: they abort their engine requests, and answer
                await asyncio.wait(set(requests), timeout=_ENDING_TIMEOUT_S)
            await worker.leave_the_pool()
            await sweeping.stop()
            await worker.registry.close()

    routes = [Route(GENERATE_PATH, generate, methods=["POST"]),
              Route(ADAPTERS_PATH + "/{digest}", put_adapter, methods=["PUT"]),
              Route(CHECK_ADAPTER_PATH, check_adapter, methods=["POST"]),
              Route("/health", health, methods=["GET"])]
    # NOTE: a request its shutdown's deadline stopped before it answered (a PUT of files, a
    # check, a generate still reading its body) gets the refusal of a stopping worker, which
    # gateways send to another worker, where uvicorn would log a traceback and send a 500.
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ClientDisconnect: _gateway_left},
                    middleware=[Middleware(InFlight, tasks=requests, stopped=_stopping)])
    app.state.worker = worker
    return app
