"""A lean HTTP/1.1 load generator: raw keep-alive connections on one asyncio loop.

An HTTP client library costs more CPU per request than the gateway under test would like to share
its 2 cores with; this one pre-encodes the request bytes and parses only the status line and
Content-Length of each reply.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def encode_request(method: str, path: str, host: str, body: bytes = b"",
                   headers: dict[str, str] | None = None) -> bytes:
    """The bytes of one HTTP/1.1 request (keep-alive is HTTP/1.1's default)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Connection:
    """One keep-alive connection; requests go one at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> "Connection":
        return cls(*await asyncio.open_connection(host, port))  # asyncio sets TCP_NODELAY

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """Send encoded request bytes; the reply's status and body."""
        self._writer.write(request)
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        start = head.lower().find(b"\r\ncontent-length:")
        if start < 0:
            raise ValueError(f"reply without Content-Length (status {status}): {head!r}")
        end = head.index(b"\r\n", start + 2)
        body = await self._reader.readexactly(int(head[start + 17:end]))
        return status, body

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()


@dataclass
class LoadResult:
    """What a closed-loop run measured inside its window (after the warm-up)."""

    concurrency: int
    seconds: float
    latencies: list[float]  # seconds, of the requests sent and answered inside the window
    num_completed: int = 0  # replies that arrived inside the window
    statuses: collections.Counter = field(default_factory=collections.Counter)
    num_sent_total: int = 0  # warm-up and window together: what the server counted
    num_ok_total: int = 0
    cpu_seconds: float = 0.0  # the load generator's own CPU time inside the window
    probe_seconds: float = 0.0  # how much `probe` grew inside the window (the server's CPU)

    @property
    def rate(self) -> float:
        return self.num_completed / self.seconds


async def closed_loop(host: str, port: int, request: bytes | Sequence[bytes], concurrency: int,
                      warmup_s: float, duration_s: float,
                      probe: Callable[[], float] = lambda: 0.0) -> LoadResult:
    """`concurrency` connections, each sending its request again as soon as its reply arrived,
    for `warmup_s` untimed and then `duration_s` timed; `probe` is read as the window opens and
    closes. With several requests, connection i sends request i modulo their number."""
    requests = [request] if isinstance(request, bytes) else list(request)
    connections = [await Connection.open(host, port) for _ in range(concurrency)]
    started = time.perf_counter()
    window_start, window_end = started + warmup_s, started + warmup_s + duration_s
    result = LoadResult(concurrency, duration_s, [])

    async def worker(connection: Connection, request: bytes) -> None:
        while (sent_at := time.perf_counter()) < window_end:
            status, _ = await connection.send(request)
            done_at = time.perf_counter()
            result.num_sent_total += 1
            result.num_ok_total += status == 200
            if window_start <= done_at <= window_end:
                result.num_completed += 1
                result.statuses[status] += 1
                if window_start <= sent_at:
                    result.latencies.append(done_at - sent_at)

    async def window() -> None:
        await asyncio.sleep(window_start - time.perf_counter())
        cpu, probed = time.process_time(), probe()
        await asyncio.sleep(window_end - time.perf_counter())
        result.cpu_seconds, result.probe_seconds = time.process_time() - cpu, probe() - probed

    try:
        await asyncio.gather(window(), *(worker(c, requests[i % len(requests)])
                                         for i, c in enumerate(connections)))
    finally:
        for connection in connections:
            await connection.close()
    return result


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank on the sorted values; NaN of none (a window
    too short for any reply: it raised an IndexError)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    # NOTE: ceil, the nearest rank's definition: round() takes halves to even, one rank low
    # (the p50 of 1..5 was 2).
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]
