"""Server-sent events for streamed completions: `data: <json>` events ending in `data: [DONE]`;
written by the gateway and its workers, read back from workers and upstreams."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
_LINE_BREAK = re.compile(rb"\r\n|\r|\n")


def event(payload: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """Streams `content`, then awaits `on_close` however the stream ended. A graceful shutdown
    whose deadline passes while the stream runs ends it with `at_shutdown` (events that tell its
    reader why it ends there) and one line of log, where a cut connection would tell the reader
    nothing and uvicorn would log a traceback.

    NOTE: when the client disconnects, Starlette cancels the task that iterates `content`, maybe
    before it started or while it is suspended at a `yield`, where no `finally` of the iterator
    runs. `on_close` runs here instead, outside that cancelled task, so it can stop the engine
    requests and bill what they produced.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 at_shutdown: bytes, headers: dict[str, str] | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                           **(headers or {})})
        self._on_close = on_close
        self._at_shutdown = at_shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        is_streaming = False  # the response has started and has more to send

        async def send_tracked(message: Message) -> None:
            nonlocal is_streaming
            is_streaming = message["type"] == "http.response.start" or message.get("more_body", False)
            await send(message)

        try:
            await super().__call__(scope, receive, send_tracked)
        except asyncio.CancelledError:
            # NOTE: a client that leaves ends the stream without cancelling this task: only a
            # server's shutdown does, once its deadline has passed.
            if not is_streaming:
                raise
            asyncio.current_task().uncancel()  # NOTE: handled: the stream ends here
            logger.warning("%s %s: the server's shutdown ended this stream before its answer did",
                           scope["method"], scope["path"])
            await send({"type": "http.response.body", "body": self._at_shutdown, "more_body": False})
        finally:
            await self._on_close()


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a server-sent event stream read from its raw bytes, split where the format
    says: at CR, LF or CRLF, and nowhere else.

    NOTE: not httpx's `aiter_lines`, which also splits at U+2028, U+0085 and other characters
    that JSON strings carry unescaped, so a token's text could cut an event in two.
    """
    # NOTE: the line not ended yet is kept as the pieces it came in, joined once it ends: read
    # again with each piece, a line of megabytes (an echoed prompt's logprobs) cost its length
    # times the number of its pieces.
    pending: list[bytes] = []
    after_cr = False  # the last byte read was a CR, which ended a line: an LF next is its CRLF's
    async for chunk in chunks:
        if not chunk:
            continue
        if after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        after_cr = chunk.endswith(b"\r")
        *ended, rest = _LINE_BREAK.split(chunk)
        for line in ended:  # NOTE: CR and LF bytes never occur inside a UTF-8 sequence
            pending.append(line)
            yield b"".join(pending).decode()
            pending.clear()
        if rest:
            pending.append(rest)
    if pending:
        yield b"".join(pending).decode()
