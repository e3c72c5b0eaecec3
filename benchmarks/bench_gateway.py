"""Gateway overhead: the latency the gateway adds over the engine, and the rate it sustains.

1. Added latency. One process holds the demo model's AsyncEngine and the real gateway over it
   (create_app under uvicorn on a loopback port, on its own thread, SQLite store in a temp data
   dir, a tenant and key made through the admin API). The same short greedy requests go through
   HTTP (POST /v1/completions, text prompt) and straight to `AsyncEngine.generate` (the prompt's
   token ids), sequentially and interleaved, from one client event loop; the difference per pair
   is what the gateway adds.
2. Gateway throughput. The gateway runs in a child process over an engine that answers at once
   (benchmarks/instant_engine.py), and a closed-loop load generator on raw keep-alive HTTP/1.1
   connections (benchmarks/loadgen.py) keeps N requests in flight; both share the machine's cores,
   so the output gives each one's CPU use.

Run from the repository root:

    python -m benchmarks.bench_gateway
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import pstats
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from benchmarks.common import (DEFAULT_WORK_DIR, load_summary, machine_summary, non_negative_float,
                               positive_float, positive_int)
from benchmarks.instant_engine import INSTANT_MODEL
from benchmarks.loadgen import Connection, LoadResult, closed_loop, encode_request, percentile

if TYPE_CHECKING:  # NOTE: the engine imports torch; part 2 and --help do without it
    from starlette.applications import Starlette

    from engine.async_engine import AsyncEngine
    from engine.request import SamplingParams

HOST = "127.0.0.1"
TENANT = "bench"
# Limits far above what a run uses, but set: every request pays into its tenant's rpm and tpm
# buckets and holds budget, as a limited tenant's requests do (unlimited ones skip those writes).
TENANT_LIMITS = {"rpm": 10**9, "tpm": 10**12, "monthly_token_budget": 10**15}
TARGET_ADDED_P50_MS = 2.0
TARGET_RATE = 1000.0
_START_TIMEOUT_S = 60.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "latency", "throughput"), default="all",
                        help="which part to run")
    parser.add_argument("--pairs", type=positive_int, default=400,
                        help="part 1: timed request pairs (HTTP and direct), after 20 warm-up pairs")
    parser.add_argument("--max-tokens", type=positive_int, default=4,
                        help="part 1: requests cycle through max_tokens 1..this (greedy, EOS ignored)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="part 1: torch threads of the demo engine (more only spin on 2 cores)")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 32, 64],
                        help="part 2: requests kept in flight, one run per value")
    parser.add_argument("--duration", type=positive_float, default=10.0,
                        help="part 2: timed seconds per concurrency, after --warmup")
    parser.add_argument("--warmup", type=non_negative_float, default=2.0,
                        help="part 2: untimed seconds first")
    parser.add_argument("--log-level", default="info", choices=("info", "warning"),
                        help="gateway log level; info writes the access log (one line per request) "
                             "to a file in the temp data dir")
    parser.add_argument("--pin", action="store_true",
                        help="part 2: pin the gateway to CPU 0 and the load generator to CPU 1")
    parser.add_argument("--profile", choices=("cprofile", "py-spy"),
                        help="part 2: profile the gateway process (cProfile wraps it; py-spy "
                             "attaches for the last concurrency run)")
    parser.add_argument("--profile-out", type=Path,
                        help="where the profile goes (default: in --work-dir)")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR,
                        help="where the demo model is cached")
    return parser.parse_args()


# Shared by both parts.


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


async def wait_until_up(port: int, is_alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline and is_alive():
        with contextlib.suppress(OSError):
            connection = await Connection.open(HOST, port)
            status, _ = await connection.send(encode_request("GET", "/health", HOST))
            await connection.close()
            if status == 200:
                return
        await asyncio.sleep(0.1)
    raise RuntimeError("the gateway did not start; see its log")


async def new_tenant_key(port: int, admin_key: str) -> str:
    """Create the benchmark's tenant through the admin API and return a new key of it."""
    connection = await Connection.open(HOST, port)
    auth = {"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"}
    tenant = msgspec.json.encode({"name": TENANT, **TENANT_LIMITS})
    for path, body in (("/admin/tenants", tenant), (f"/admin/tenants/{TENANT}/keys", b"")):
        status, reply = await connection.send(encode_request("POST", path, HOST, body, auth))
        if status != 201:
            raise RuntimeError(f"POST {path} answered {status}: {reply!r}")
    await connection.close()
    return msgspec.json.decode(reply)["key"]


def completion_request(key: str, model: str, prompt: str, max_tokens: int) -> bytes:
    body = msgspec.json.encode({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True})
    return encode_request("POST", "/v1/completions", HOST, body,
                          {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def configure_log(data_dir: Path, level: str) -> Path:
    path = data_dir / "gateway.log"
    logging.basicConfig(filename=path, level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return path


def count_access_lines(log: Path) -> int:
    with open(log, "rb") as f:
        return sum(b" gateway.access: " in line for line in f)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


# Part 1: added latency over the engine.


@dataclass
class Pair:
    max_tokens: int
    http_s: float
    direct_s: float

    @property
    def added_s(self) -> float:
        return self.http_s - self.direct_s


@contextlib.contextmanager
def serve_in_thread(app: Starlette) -> Iterator[int]:
    """Serve `app` with uvicorn (as `switchboard serve` configures it) on a loopback port, on a
    thread of this process, until the block ends; yields the port."""
    import uvicorn

    # NOTE: proto IPPROTO_TCP, as getaddrinfo gives uvicorn when it binds the port itself: asyncio
    # sets TCP_NODELAY only on such sockets, and without it the response's body waits for the
    # client's delayed ACK of its headers (~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind((HOST, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


async def timed_http(connection: Connection, request: bytes) -> tuple[float, str]:
    started = time.perf_counter()
    status, body = await connection.send(request)
    elapsed = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"the gateway answered {status}: {body!r}")
    return elapsed, msgspec.json.decode(body)["choices"][0]["text"]


async def timed_direct(engine: AsyncEngine, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> tuple[float, str]:
    started = time.perf_counter()
    text = "".join([out.new_text async for out in engine.generate(prompt_ids, params,
                                                                   request_id=request_id)])
    return time.perf_counter() - started, text


async def run_pairs(port: int, admin_key: str, engine: AsyncEngine, num_pairs: int,
                    max_tokens: int, num_warmup: int = 20) -> list[Pair]:
    """Request i goes through HTTP and straight to the engine, the order alternating by pair;
    both replies must carry the same greedy text."""
    from engine.request import SamplingParams

    await wait_until_up(port)
    key = await new_tenant_key(port, admin_key)
    connection = await Connection.open(HOST, port)
    pairs = []
    for i in range(num_warmup + num_pairs):
        prompt, num_tokens = f"Request {i}: the quick brown fox", 1 + i % max_tokens
        request = completion_request(key, "switchboard-demo", prompt, num_tokens)
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        prompt_ids = engine.tokenizer.encode(prompt)
        if i % 2:
            direct_s, direct_text = await timed_direct(engine, prompt_ids, params, f"d{i}")
            http_s, http_text = await timed_http(connection, request)
        else:
            http_s, http_text = await timed_http(connection, request)
            direct_s, direct_text = await timed_direct(engine, prompt_ids, params, f"d{i}")
        if http_text != direct_text:
            raise RuntimeError(f"pair {i}: HTTP gave {http_text!r}, the engine {direct_text!r}")
        if i >= num_warmup:
            pairs.append(Pair(num_tokens, http_s, direct_s))
    await connection.close()
    return pairs


def measure_added_latency(args: argparse.Namespace, data_dir: Path) -> list[Pair]:
    import torch

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.demo import DEMO_NAME, ensure_demo_model
    from engine.engine import LLMEngine
    from gateway.app import create_app
    from gateway.local_engine import LocalEngineClient

    torch.set_num_threads(args.threads)
    model = ensure_demo_model(args.work_dir / DEMO_NAME)
    # No prefix caching: each pair repeats its prompt, and the second of the two must not be
    # served from the first one's cache.
    config = EngineConfig(model=str(model), num_kv_blocks=256, enable_prefix_caching=False)
    engine = AsyncEngine(LLMEngine(config, show_progress=False))
    admin_key = "sb-admin-" + secrets.token_urlsafe(16)
    app = create_app({DEMO_NAME: LocalEngineClient(engine)}, data_dir=data_dir,
                     admin_key=admin_key)
    try:
        with serve_in_thread(app) as port:
            return asyncio.run(run_pairs(port, admin_key, engine, args.pairs, args.max_tokens))
    finally:
        engine.shutdown()


def report_added_latency(pairs: list[Pair]) -> None:
    rows = [("through the gateway (HTTP)", [p.http_s for p in pairs]),
            ("straight to AsyncEngine.generate", [p.direct_s for p in pairs]),
            ("added by the gateway (per pair)", [p.added_s for p in pairs])]
    print(f"\n{'':36} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, values in rows:
        print(f"{name:36} {ms(percentile(values, 50))} {ms(percentile(values, 99))} "
              f"{ms(statistics.fmean(values))}")
    for num_tokens in sorted({p.max_tokens for p in pairs}):
        added = [p.added_s for p in pairs if p.max_tokens == num_tokens]
        print(f"  max_tokens={num_tokens}: added p50 {ms(percentile(added, 50)).strip()} ms "
              f"over {len(added)} pairs")
    p50 = percentile([p.added_s for p in pairs], 50) * 1e3
    verdict = "met" if p50 < TARGET_ADDED_P50_MS else "missed"
    print(f"target: added p50 < {TARGET_ADDED_P50_MS} ms -> {p50:.3f} ms, {verdict}")


# Part 2: the rate the gateway sustains over an engine that answers at once.


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process `pid`, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def instant_gateway(args: argparse.Namespace, data_dir: Path, admin_key: str,
                    profile_out: Path | None) -> Iterator[tuple[subprocess.Popen, int]]:
    """The gateway over an InstantEngine in a child process; yields it and its port."""
    port = free_port()
    command = [sys.executable, "-m", "benchmarks.instant_engine", "--port", str(port),
               "--data-dir", str(data_dir), "--admin-key", admin_key,
               "--log-level", args.log_level]
    if args.profile == "cprofile":
        command[1:1] = ["-m", "cProfile", "-o", str(profile_out)]
    server = subprocess.Popen(command)
    if args.pin:
        os.sched_setaffinity(server.pid, {0})
        os.sched_setaffinity(0, {1})
    try:
        yield server, port
    finally:
        server.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully; cProfile then writes
        server.wait(timeout=30)


async def run_throughput(args: argparse.Namespace, server: subprocess.Popen, port: int,
                         admin_key: str, profile_out: Path | None) -> tuple[list[LoadResult], str]:
    await wait_until_up(port, lambda: server.poll() is None)
    key = await new_tenant_key(port, admin_key)
    request = completion_request(key, INSTANT_MODEL, "Say hello to the gateway.", 4)
    connection = await Connection.open(HOST, port)
    status, body = await connection.send(request)
    await connection.close()
    if status != 200 or msgspec.json.decode(body)["choices"][0]["text"] != "Hell":
        raise RuntimeError(f"unexpected reply {status}: {body!r}")
    runs = []
    for i, concurrency in enumerate(args.concurrency):
        spy = None
        if args.profile == "py-spy" and i == len(args.concurrency) - 1:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(server.pid), "--rate", "500",
                                    "--format", "raw", "-o", str(profile_out),
                                    "-d", str(int(args.warmup + args.duration))],
                                   stdout=subprocess.DEVNULL)
        runs.append(await closed_loop(HOST, port, request, concurrency, args.warmup,
                                      args.duration, lambda: process_cpu_seconds(server.pid)))
        if spy is not None:
            spy.wait()
    return runs, key


def report_throughput(runs: list[LoadResult]) -> None:
    print(f"\n{'in flight':>9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'gateway CPU':>12} "
          f"{'loadgen CPU':>12}  statuses")
    for r in runs:
        print(f"{r.concurrency:9d} {r.rate:8.0f} {ms(percentile(r.latencies, 50))} "
              f"{ms(percentile(r.latencies, 99))} {r.probe_seconds / r.seconds:11.0%} "
              f"{r.cpu_seconds / r.seconds:11.0%}   {dict(r.statuses)}")
    best = max(runs, key=lambda r: r.rate)
    verdict = "met" if best.rate >= TARGET_RATE else "missed"
    print(f"target: >= {TARGET_RATE:.0f} req/s -> {best.rate:.0f} req/s at {best.concurrency} in "
          f"flight, {verdict}")
    if not best.num_completed:
        print("gateway CPU per request: not measurable, no reply came inside the window; raise "
              "--duration")
        return
    print(f"gateway CPU per request at that load: {best.probe_seconds / best.num_completed * 1e6:.0f}"
          " us (CPU % is of one core: 100% = one core busy)")


async def check_accounting(port: int, admin_key: str, key: str, runs: list[LoadResult],
                           log: Path, log_level: str) -> None:
    """Every request was counted in /metrics, billed in the tenant's usage, and (at info) logged."""
    num_ok = 1 + sum(r.num_ok_total for r in runs)  # 1: the reply check
    connection = await Connection.open(HOST, port)
    _, metrics = await connection.send(encode_request(
        "GET", "/metrics", HOST, headers={"Authorization": f"Bearer {admin_key}"}))
    _, detail = await connection.send(encode_request(
        "GET", f"/admin/tenants/{TENANT}", HOST, headers={"Authorization": f"Bearer {admin_key}"}))
    await connection.close()
    series = (f'switchboard_requests_total{{tenant="{TENANT}",model="{INSTANT_MODEL}",'
              f'status="200"}} ').encode()
    counted = next(int(line.removeprefix(series)) for line in metrics.splitlines()
                   if line.startswith(series))
    billed = msgspec.json.decode(detail)["usage"]["requests"]
    logged = count_access_lines(log)
    print(f"accounting: {num_ok} requests answered 200; /metrics counted {counted}, usage billed "
          f"{billed}, access log has {logged} lines (log level {log_level})")


def measure_throughput(args: argparse.Namespace, data_dir: Path) -> None:
    admin_key = "sb-admin-" + secrets.token_urlsafe(16)
    profile_out = args.profile_out or args.work_dir / ("gateway.prof" if args.profile == "cprofile"
                                                       else "gateway.pyspy.txt")
    with instant_gateway(args, data_dir, admin_key, profile_out) as (server, port):
        runs, key = asyncio.run(run_throughput(args, server, port, admin_key, profile_out))
        report_throughput(runs)
        asyncio.run(check_accounting(port, admin_key, key, runs, data_dir / "gateway.log",
                                     args.log_level))
    if args.pin:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    if args.profile == "cprofile":
        pstats.Stats(str(profile_out)).sort_stats("tottime").print_stats(25)
    if args.profile is not None:
        print(f"profile written to {profile_out}")


def main() -> None:
    args = parse_args()
    print(machine_summary())
    print(f"gateway log level: {args.log_level}")
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        if args.part in ("all", "latency"):
            print(f"\n== 1. Added latency: demo model, {args.pairs} pairs, max_tokens "
                  f"1..{args.max_tokens}, greedy, HTTP vs AsyncEngine.generate ==")
            print(f"start {load_summary()}")
            data_dir = Path(tmp) / "latency"
            data_dir.mkdir()
            log = configure_log(data_dir, args.log_level)
            pairs = measure_added_latency(args, data_dir)
            report_added_latency(pairs)
            print(f"access log: {count_access_lines(log)} lines (log level {args.log_level})")
            print(f"end {load_summary()}")
        if args.part in ("all", "throughput"):
            pinning = "gateway on CPU 0, load generator on CPU 1" if args.pin else "not pinned"
            print(f"\n== 2. Throughput: instant engine, non-streamed completions (max_tokens 4), "
                  f"{args.duration:.0f} s per run after {args.warmup:.0f} s warm-up, {pinning} ==")
            print(f"start {load_summary()}")
            data_dir = Path(tmp) / "throughput"
            data_dir.mkdir()
            measure_throughput(args, data_dir)
            print(f"end {load_summary()}")


if __name__ == "__main__":
    main()
