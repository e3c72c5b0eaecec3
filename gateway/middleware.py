"""AccessLog: one INFO line per request, and the request counter of the /v1 API; InFlight: the
requests being handled.

Handlers leave what they learn in `request.state` (tenant, model as sent and as metrics label it,
token counts); AccessLog reads it when the response is complete, so a stream is logged once, with
its final counts.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import server_shutdown
from gateway.metrics import GatewayMetrics

logger = logging.getLogger("gateway.access")
_logger = logging.getLogger(__name__)

_COUNTED_PREFIX = "/v1/"
# Line breaks and other control characters, which a client could put in a path or a model name
# to forge log lines of its own.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escaped(text: str) -> str:
    return _CONTROL.sub(lambda match: ascii(match.group())[1:-1], text)


class AccessLog:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # NOTE: shared with the handler's request.state
        started = state["arrived_at"] = time.monotonic()
        status = 500  # what the client sees if the app fails before starting a response

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self._record(scope, status, time.monotonic() - started)

    def _record(self, scope: Scope, status: int, elapsed: float) -> None:
        state = scope["state"]
        tenant, model = state.get("tenant", "-"), state.get("model", "-")
        path = scope["path"]
        if path.startswith(_COUNTED_PREFIX):
            self.metrics.requests.inc(tenant=tenant, model=state.get("model_label", "-"),
                                      status=str(status))
        tokens = ""
        if "completion_tokens" in state:
            tokens = f" prompt_tokens={state['prompt_tokens']} " \
                     f"completion_tokens={state['completion_tokens']}"
        logger.info("%s %s %d tenant=%s model=%s%s %.3fs", scope["method"], _escaped(path), status,
                    tenant, _escaped(model), tokens, elapsed)


class InFlight:
    """Keeps the tasks of the requests being handled in `tasks`, so that a shutdown can wait for
    those it cancelled at its deadline: they settle their calls on the way out. One cancelled
    before it answered gets `stopped()` (telling its client to retry, in the app's error shape),
    where uvicorn would log a traceback and send a plain-text 500."""

    def __init__(self, app: ASGIApp, tasks: set[asyncio.Task],
                 stopped: Callable[[], Response] = lambda: _STOPPED.response()):
        self.app = app
        self.tasks = tasks
        self.stopped = stopped

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        if scope["type"] != "http" or task is None:
            await self.app(scope, receive, send)
            return
        self.tasks.add(task)
        has_answered = has_ended = False

        async def send_tracked(message: Message) -> None:
            nonlocal has_answered, has_ended
            has_answered = has_answered or message["type"] == "http.response.start"
            has_ended = has_ended or (message["type"] == "http.response.body"
                                      and not message.get("more_body", False))
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except asyncio.CancelledError:
            if has_ended:  # cancelled as it recorded the call (the store is slow, or locked)
                task.uncancel()  # NOTE: handled: the client has its whole answer
                _logger.warning("%s %s: the server's shutdown deadline passed while this call's "
                                "usage was recorded; it is recorded if the store answers before "
                                "it closes", scope["method"], scope["path"])
                return
            if has_answered:
                raise
            task.uncancel()  # NOTE: handled: the request ends with the answer below
            answer = self.stopped()
            answer.headers["Connection"] = "close"  # the server is going away
            await answer(scope, receive, send)
        finally:
            self.tasks.discard(task)


# NOTE: uvicorn cancels a request's task only when a shutdown's deadline has passed.
_STOPPED = server_shutdown()
