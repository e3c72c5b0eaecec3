"""Scale-out: one gateway in front of two engine workers against the same gateway with one worker.

Real processes on loopback: a redis-server, `switchboard worker` processes (one intra-op thread
each, as one GPU each would be one device), and one `switchboard serve --redis` gateway. A
closed-loop load generator (benchmarks/loadgen.py) keeps `--concurrency` greedy completions in
flight (token-id prompts of `--prompt-len`, `--max-tokens` each). Phase 1 runs it against one
worker; then a second worker joins the same Redis, the gateway finds it, and phase 2 runs the same
load. The ratio of the two rates is the figure; on a machine with fewer free cores than workers it
says how much the cores, not the design, limit.

Run from the repository root:

    python -m benchmarks.bench_scaleout
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgspec

from benchmarks.common import (DEFAULT_WORK_DIR, ModelSpec, ensure_model, load_summary,
                               machine_summary)
from benchmarks.loadgen import LoadResult, closed_loop, encode_request, percentile
from tests.processes import SwitchboardProcess, is_healthy, start_switchboard, wait_until
from tests.redis_server import start_redis_server, stop_redis_server

ADMIN_KEY = "sb-admin-bench-scaleout"
MODEL = "bench"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--warmup", type=float, default=5.0, help="untimed seconds per phase")
    parser.add_argument("--duration", type=float, default=20.0, help="timed seconds per phase")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR,
                        help=f"where the random model is kept (default {DEFAULT_WORK_DIR})")
    return parser.parse_args()


def start_worker(root: Path, index: int, redis_url: str, model_dir: Path) -> SwitchboardProcess:
    return start_switchboard(
        ["worker", "--redis", redis_url, "--model", f"{MODEL}={model_dir}",
         "--data-dir", str(root / f"worker{index}"), "--kv-cache-memory", "512MiB",
         "--max-num-seqs", "32", "--max-loras", "0", "--log-level", "warning"],
        root / f"worker{index}.log")


def num_workers(redis_url: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return sum(client.exists(f"sb:worker:{i.decode()}") for i in client.smembers("sb:workers"))
    finally:
        client.close()


def tenant_key(gateway: SwitchboardProcess) -> str:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(gateway.url + "/admin/tenants", json={"name": "bench"}, headers=admin).raise_for_status()
    return httpx.post(gateway.url + "/admin/tenants/bench/keys", headers=admin).json()["key"]


def run_load(gateway: SwitchboardProcess, key: str, args: argparse.Namespace,
             vocab_size: int) -> LoadResult:
    rng = random.Random(0)
    prompt = [rng.randrange(vocab_size) for _ in range(args.prompt_len)]
    body = msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens,
                                "temperature": 0, "ignore_eos": True})
    host = urlsplit(gateway.url)
    request = encode_request("POST", "/v1/completions", host.netloc, body,
                             {"Authorization": f"Bearer {key}",
                              "Content-Type": "application/json"})
    return asyncio.run(closed_loop(host.hostname, host.port, request, args.concurrency,
                                   args.warmup, args.duration))


def report(label: str, result: LoadResult, max_tokens: int) -> float:
    ok = result.statuses.get(200, 0)
    tokens_per_s = ok * max_tokens / result.seconds
    p50 = percentile(result.latencies, 50) * 1000 if result.latencies else float("nan")
    print(f"{label}: {result.rate:.2f} req/s, {tokens_per_s:.1f} output tokens/s, "
          f"p50 latency {p50:.0f} ms, statuses {dict(result.statuses)}", flush=True)
    return tokens_per_s


def main() -> None:
    args = parse_args()
    spec = ModelSpec()
    model_dir = ensure_model(spec, args.work_dir)
    print(machine_summary())
    print(f"model: {spec.name} (random weights); {args.concurrency} in flight, prompt "
          f"{args.prompt_len} tokens, {args.max_tokens} output tokens, greedy")
    redis_proc, redis_url = start_redis_server()
    processes: list[SwitchboardProcess] = []
    with tempfile.TemporaryDirectory(prefix="sb-scaleout-") as tmp:
        root = Path(tmp)
        try:
            processes.append(start_worker(root, 0, redis_url, model_dir))
            gateway = start_switchboard(["serve", "--redis", redis_url, "--admin-key", ADMIN_KEY,
                                         "--data-dir", str(root / "gateway"),
                                         "--log-level", "warning"], root / "gateway.log")
            processes.append(gateway)
            for process in processes:
                wait_until(process, lambda: is_healthy(process))
            wait_until(gateway, lambda: MODEL in httpx.get(gateway.url + "/health").json()["models"])
            key = tenant_key(gateway)
            print(load_summary())
            one = report("one worker ", run_load(gateway, key, args, spec.vocab_size),
                         args.max_tokens)
            processes.append(start_worker(root, 1, redis_url, model_dir))
            wait_until(processes[-1], lambda: num_workers(redis_url) == 2)
            print(load_summary())
            two = report("two workers", run_load(gateway, key, args, spec.vocab_size),
                         args.max_tokens)
            print(f"two workers / one worker: {two / one:.2f}x output tokens/s")
            print(load_summary())
        finally:
            for process in processes:
                process.stop()
            stop_redis_server(redis_proc)


if __name__ == "__main__":
    main()
