"""Server: uvicorn's HTTP server, which tells its caller when a graceful shutdown begins.

uvicorn tells the app itself only once the shutdown is over (its lifespan ends after the requests
in flight finished, or were cancelled at the deadline). A worker must leave the pool as the
shutdown begins, so that gateways stop placing requests there while those in flight finish.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator

import uvicorn


class _DeadlineIsNoError(logging.Filter):
    """uvicorn logs the cancelling of the requests still running at a graceful shutdown's
    deadline as an ERROR. The deadline is the operator's setting, and each request it stops ends
    with an answer and a line of its own: a WARNING, not an alert on every rolling restart."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and str(record.msg).startswith("Cancel %s running task"):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


logging.getLogger("uvicorn.error").addFilter(_DeadlineIsNoError())


class Server(uvicorn.Server):
    """uvicorn.Server that awaits `on_shutdown()` as a graceful shutdown begins, before it stops
    taking connections and waits for the requests in flight."""

    def __init__(self, config: uvicorn.Config,
                 on_shutdown: Callable[[], Awaitable[None]] | None = None):
        super().__init__(config)
        self._on_shutdown = on_shutdown
        # Signals that came before uvicorn listened for them (see `run`): acted on once it does.
        self.early_signals: list[int] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            for sig in self.early_signals:
                self.handle_exit(sig, None)
            yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._on_shutdown is not None:
            await self._on_shutdown()
        await super().shutdown(sockets)
