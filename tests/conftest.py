"""Shared fixtures: the demo model, one engine for the session, and real gateway servers.

A gateway server is the real app under uvicorn on a free loopback port, on its own thread, so
tests talk to it over HTTP exactly as clients do.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: set before anything imports triton's JIT: without a GPU, kernels run interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEMO_MODEL = "switchboard-demo"
ADMIN_KEY = "sb-admin-test-key"
DEMO_MAX_LORA_RANK = 16
NARROW_MAX_LORA_RANK = 4  # the largest adapter rank narrow_engine serves
_START_TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.demo import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("demo") / DEMO_MODEL)


@pytest.fixture(scope="session")
def demo_engine(demo_model_dir: Path) -> Iterator:
    """One LocalEngineClient over the demo model, shared by every gateway test; it serves LoRA
    adapters up to rank DEMO_MAX_LORA_RANK, with 2 device slots so tests exercise paging."""
    import torch

    from adapters import AdapterConfig
    from engine.config import EngineConfig
    from gateway.local_engine import LocalEngineClient

    # NOTE: one intra-op thread: the tiny demo model gains nothing from more, and on a busy
    # 2-core machine OpenMP threads spinning against each other make each step 100x slower.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lora = AdapterConfig(max_lora_rank=DEMO_MAX_LORA_RANK, max_gpu_adapters=2, max_cpu_adapters=4)
    engine = LocalEngineClient.load(
        EngineConfig(model=str(demo_model_dir), num_kv_blocks=512, lora=lora), show_progress=False)
    yield engine
    engine.close()
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def narrow_engine(demo_engine, demo_model_dir: Path) -> Iterator:
    """An engine over the demo model that serves adapters up to rank NARROW_MAX_LORA_RANK only (a
    worker on a smaller GPU, a server restarted with a lower --max-lora-rank), where demo_engine
    serves them up to DEMO_MAX_LORA_RANK; built, as demo_engine, with one intra-op thread."""
    from adapters import AdapterConfig
    from engine.config import EngineConfig
    from gateway.local_engine import LocalEngineClient

    lora = AdapterConfig(max_lora_rank=NARROW_MAX_LORA_RANK, max_gpu_adapters=2, max_cpu_adapters=4)
    engine = LocalEngineClient.load(EngineConfig(model=str(demo_model_dir), num_kv_blocks=512,
                                                 lora=lora), show_progress=False)
    yield engine
    engine.close()


@dataclass
class GatewayServer:
    """A running gateway: its URL, its admin key, and helpers for the admin API."""

    url: str
    admin_key: str
    app: object

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def new_tenant(self, name: str, **limits) -> str:
        """Create a tenant with `limits` and return a fresh API key for it."""
        created = self.admin("POST", "/admin/tenants", json={"name": name, **limits})
        assert created.status_code == 201, created.text
        key = self.admin("POST", f"/admin/tenants/{name}/keys")
        assert key.status_code == 201, key.text
        return key.json()["key"]

    def settled_usage(self, tenant: str, timeout_s: float = 10.0) -> dict:
        """`tenant`'s usage once no call holds budget: a stream is billed as its response closes,
        after its last byte went out, so a client that read it whole may ask before then."""
        deadline = time.monotonic() + timeout_s
        while True:
            usage = self.admin("GET", f"/admin/tenants/{tenant}").json()["usage"]
            if not usage["reserved_tokens"] or time.monotonic() > deadline:
                return usage
            time.sleep(0.02)

    def engine_metrics(self):
        return self.app.state.gateway.engines[DEMO_MODEL].stats()

    def leave_while_sending(self, path: str, headers: dict[str, str], sent: bytes,
                            length: int) -> None:
        leave_while_sending(self.url, path, headers, sent, length)


def leave_while_sending(url: str, path: str, headers: dict[str, str], sent: bytes,
                        length: int, method: str = "POST") -> None:
    """Send `method` `path` to the server at `url` with a body said to be `length` bytes long, send only
    `sent` of it, and close the connection: a client that leaves halfway through its body."""
    with send_partly(url, path, headers, sent, length, method):
        pass


def send_partly(url: str, path: str, headers: dict[str, str], sent: bytes,
                length: int, method: str = "POST") -> socket.socket:
    """The connection of a request to the server at `url` whose body is said to be `length` bytes
    long, of which only `sent` went: the server waits for the rest (or its answer comes first)."""
    host, port = url.removeprefix("http://").split(":")
    lines = "".join(f"{name}: {value}\r\n" for name, value in
                    {**headers, "Host": host, "Content-Length": str(length)}.items())
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode() + sent)
    return sock


def logged_status(caplog: pytest.LogCaptureFixture, method: str, path: str) -> int:
    """The status of the access log's first line for `method` `path` (it is written once the call
    ends, on the server's thread: waited for); needs INFO of `gateway.access` captured."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for record in caplog.records:
            words = record.getMessage().split()
            if record.name == "gateway.access" and words[:2] == [method, path]:
                return int(words[2])
        time.sleep(0.01)
    raise AssertionError(f"the access log has no line for {method} {path}")


@contextmanager
def run_server(app, shutdown_timeout_s: float = 5,
               on_shutdown: Callable[[], Awaitable[None]] | None = None,
               on_bound: Callable[[str], None] | None = None) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port until the block ends, then shut it down
    gracefully (awaiting `on_shutdown()` first; calls still running after `shutdown_timeout_s` are
    cancelled), as `switchboard serve` and `worker` do; yields its URL. `on_bound(url)` runs
    before the app starts, as a worker must know its URL before it joins the pool."""
    import uvicorn

    from gateway.http_server import Server

    # NOTE: with IPPROTO_TCP given, asyncio sets TCP_NODELAY; without it every keep-alive request
    # waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if on_bound is not None:
        on_bound(f"http://127.0.0.1:{port}")
    server = Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                   log_level="warning", timeout_graceful_shutdown=shutdown_timeout_s),
                    on_shutdown)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start; see the log above")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def serve_gateway(engines: dict, data_dir: Path, admin_key: str = ADMIN_KEY,
                  shutdown_timeout_s: float = 5, **app_options) -> Iterator[GatewayServer]:
    """A gateway serving `engines` (by served name), with its store in `data_dir`;
    `app_options` go to create_app. The caller keeps the engines (and closes them)."""
    from gateway.app import create_app

    app = create_app(engines, data_dir=data_dir, admin_key=admin_key, **app_options)
    with run_server(app, shutdown_timeout_s) as url:
        yield GatewayServer(url, admin_key, app)


def gateway_server(engine, data_dir: Path, store_url: str | None = None,
                   admin_key: str = ADMIN_KEY, **app_options):
    """serve_gateway over the demo engine as `switchboard-demo`."""
    return serve_gateway({DEMO_MODEL: engine}, data_dir, admin_key, store_url=store_url,
                         **app_options)


@pytest.fixture(scope="module")
def server(demo_engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    """One SQLite-backed gateway per test module."""
    with gateway_server(demo_engine, tmp_path_factory.mktemp("gateway")) as running:
        yield running
