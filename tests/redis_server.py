"""A throwaway `redis-server` for tests, as pytest fixtures.

Use in a test module with `from tests.redis_server import redis_server, redis_url  # noqa: F401`
(both names: pytest finds fixtures by name in the module). `redis_url` is a flushed server's URL.
Tests of persistence start their own PersistentRedisServer, which keeps its data across restarts.
"""

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from tests.processes import free_port

_START_TIMEOUT_S = 10.0


def _wait_for_ping(url: str, proc: subprocess.Popen) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=1.0)
    deadline = time.monotonic() + _START_TIMEOUT_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                return bool(client.ping())
            # NOTE: a Redis making its append-only files takes connections but answers none for
            # a while (past 1 s on a loaded disk): a timeout, not a refusal, and tried again too.
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.05)
        return False
    finally:
        client.close()


def start_redis_server(data_dir: Path | None = None,
                       port: int | None = None) -> tuple[subprocess.Popen, str]:
    """Start redis-server on a loopback port (`port`, else a free one); return it and its URL.

    Without `data_dir` it keeps nothing on disk. With it, it persists there as production should
    (appendonly yes, appendfsync everysec), so a server stopped with stop_redis_server and started
    again with the same `data_dir` and `port` has the same data at the same URL.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: run `apt-get install -y redis-server` "
                    "(bash .ci/run does this)")
    persistence = ["--appendonly", "no"] if data_dir is None else [
        "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data_dir)]
    for _ in range(3 if port is None else 1):  # a free port can be taken before redis binds it
        bound = port or free_port()
        cmd = [exe, "--save", "", *persistence, "--port", str(bound), "--bind", "127.0.0.1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{bound}/0"
        try:
            answered = _wait_for_ping(url, proc)
        except BaseException:  # not left running
            stop_redis_server(proc)
            raise
        if answered:
            return proc, url
        stop_redis_server(proc)
    raise RuntimeError(f"redis-server did not answer PING ({cmd})")


def stop_redis_server(proc: subprocess.Popen) -> None:
    """Stop a server from start_redis_server: SIGTERM, on which Redis writes its append-only file
    to disk and exits; killed if it has not exited in 5 s."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class PersistentRedisServer:
    """A redis-server persisting to `data_dir`, which can be stopped and started again on the same
    port with the data it had, as a production Redis restarts."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.process, self.url = start_redis_server(data_dir)

    def stop(self) -> None:
        """Stop it gracefully (Redis writes its data to disk first); harmless when stopped."""
        stop_redis_server(self.process)

    def start(self) -> None:
        """Start it again after stop(), at the same URL, with the data it saved."""
        self.process, _ = start_redis_server(self.data_dir, urlsplit(self.url).port)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """URL of a redis-server kept for the whole run (one per importing module)."""
    proc, url = start_redis_server()
    yield url
    stop_redis_server(proc)


@pytest.fixture
def redis_url(redis_server: str) -> str:
    """URL of the test server, flushed for this test."""
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server
