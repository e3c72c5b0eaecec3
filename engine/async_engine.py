"""AsyncEngine: the step loop on a background thread, one async output stream per request.

Only the engine thread touches the LLMEngine; callers talk to it through a command inbox, so
adding, aborting and stepping never race. Torch releases the GIL inside its kernels, so the event
loop keeps serving HTTP while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass

from engine.engine import EngineMetrics, LLMEngine, RequestOutput
from engine.lora import LoraRequest
from engine.request import SamplingParams
from kernels.sgmv_cpu import pin_num_threads

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine failed while running this request; the request was aborted."""


@dataclass
class _AddCommand:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    tenant: str | None
    lora: LoraRequest | None
    stream: "_Stream"
    accepted: Future


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | Exception) -> bool:
        """Deliver to the consumer; False when its event loop is gone (nobody will ever read)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self._stop_lock = threading.Lock()  # NOTE: _send's check of _stopped and its put are one step
        self._metrics = engine.metrics()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def metrics(self) -> EngineMetrics:
        """The snapshot published after the latest step."""
        return self._metrics

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, priority: int = 0,
                       tenant: str | None = None,
                       lora: LoraRequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Raises ValueError if the engine rejects the request.

        Leaving the loop early (or cancelling the task) aborts the request in the engine.
        """
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        accepted: Future = Future()
        if not self._send(_AddCommand(request_id, prompt, params, priority, tenant, lora, stream,
                                      accepted)):
            raise RuntimeError("the engine is shut down")
        finished = False
        try:
            # NOTE: inside the try: a caller cancelled while the engine thread adds the request
            # (too late to take it back) still aborts it.
            await asyncio.wrap_future(accepted)
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send(("abort", request_id, stream))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id, None))

    def shutdown(self) -> None:
        with self._stop_lock:
            self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=30)

    def _send(self, command) -> bool:
        """Queue `command` for the engine thread; False once the engine is shut down. An abort
        then needs nothing: the engine thread fails every request it had as it stops (and a
        consumer leaving its stream must not get an error in place of its cancellation)."""
        with self._stop_lock:
            if self._stopped:
                return False
            self._inbox.put(command)
        self._wakeup.set()
        return True

    def _run(self) -> None:
        pin_num_threads(self.engine.num_threads)  # see kernels/sgmv_cpu.py's _one_thread
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # keep serving: fail what was in flight, not the process
                logger.exception("engine step failed; aborting %d requests", len(self._streams))
                self._fail_all(error)
                continue
            # NOTE: published before the outputs go out, and again after the aborts below: a
            # caller that reads the stats once its answer ended sees that request gone.
            self._metrics = self.engine.metrics()
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if output.finished:
                    self._streams.pop(output.request_id, None)
                if stream is not None and not stream.put(output) and not output.finished:
                    self._streams.pop(output.request_id, None)
                    self._abort(output.request_id)
            self._metrics = self.engine.metrics()
        self._fail_all(RuntimeError("the engine was shut down"))
        self._refuse_unread_adds()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _AddCommand):
                self._add(command)
                continue
            _, request_id, stream = command
            if stream is None:  # abort(): its consumer gets a last output saying so (it waited on)
                stream = self._streams.pop(request_id, None)
                output = self._abort(request_id)
                if stream is not None and output is not None:
                    self._metrics = self.engine.metrics()  # NOTE: published first, as in _run
                    stream.put(output)
            elif self._streams.get(request_id) is stream:  # not a request it never added
                self._streams.pop(request_id, None)
                self._abort(request_id)
        self._metrics = self.engine.metrics()

    def _refuse_unread_adds(self) -> None:
        """Fail the requests sent while the loop stopped: nothing else would answer their
        callers, which waited for good (nothing can be sent once _stopped is set)."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _AddCommand) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(RuntimeError("the engine was shut down"))

    def _add(self, command: _AddCommand) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the caller went away before the engine took its request: add nothing
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    command.priority, command.tenant, command.lora)
        except Exception as error:
            command.accepted.set_exception(error)
            return
        self._streams[command.request_id] = command.stream
        command.accepted.set_result(None)

    def _fail_all(self, error: Exception) -> None:
        failed = list(self._streams.items())
        self._streams.clear()
        for request_id, _ in failed:
            self._abort(request_id)
        self._metrics = self.engine.metrics()  # NOTE: before they are told (see _run)
        for request_id, stream in failed:
            stream.put(EngineStepError(f"request {request_id} failed in the engine: {error}"))

    def _abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request in the engine: its last output (None: it was not running). NOTE: this
        thread serves every request, so an abort that fails (that request's state is broken) is
        logged, never raised: it must not end the loop."""
        try:
            return self.engine.abort_request(request_id)
        except Exception:
            logger.exception("aborting request %s failed; serving the others", request_id)
            return None

