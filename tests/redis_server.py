"""A throwaway `redis-server` for tests, as pytest fixtures.

Use in a test module with `from tests.redis_server import redis_server, redis_url  # noqa: F401`
(both names: pytest finds fixtures by name in the module). `redis_url` is a flushed server's URL.
"""

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

_START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_ping(url: str, proc: subprocess.Popen) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=1.0)
    deadline = time.monotonic() + _START_TIMEOUT_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                time.sleep(0.05)
        return False
    finally:
        client.close()


def start_redis_server() -> tuple[subprocess.Popen, str]:
    """Start redis-server (no persistence) on a free loopback port; return it and its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: run `apt-get install -y redis-server` "
                    "(bash .ci/run does this)")
    for _ in range(3):  # the free port can be taken between probing and binding
        port = _free_port()
        cmd = [exe, "--save", "", "--appendonly", "no", "--port", str(port), "--bind", "127.0.0.1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        if _wait_for_ping(url, proc):
            return proc, url
        stop_redis_server(proc)
    raise RuntimeError("redis-server did not answer PING on any of 3 ports")


def stop_redis_server(proc: subprocess.Popen) -> None:
    """Stop a server from start_redis_server, killing it if it does not exit in 5 s."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
