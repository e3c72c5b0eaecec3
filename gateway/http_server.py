"""Server: uvicorn's HTTP server, which tells its caller when a graceful shutdown begins.

uvicorn tells the app itself only once the shutdown is over (its lifespan ends after the requests
in flight finished, or were cancelled at the deadline). A worker must leave the pool as the
shutdown begins, so that gateways stop placing requests there while those in flight finish.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import uvicorn


class Server(uvicorn.Server):
    """uvicorn.Server that awaits `on_shutdown()` as a graceful shutdown begins, before it stops
    taking connections and waits for the requests in flight."""

    def __init__(self, config: uvicorn.Config,
                 on_shutdown: Callable[[], Awaitable[None]] | None = None):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._on_shutdown is not None:
            await self._on_shutdown()
        await super().shutdown(sockets)
