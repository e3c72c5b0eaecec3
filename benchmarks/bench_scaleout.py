"""Scale-out: one gateway in front of two engine workers against the same gateway with one worker.

Real processes on loopback: a redis-server, `switchboard worker` processes (one intra-op thread
each, as one GPU each would be one device), and one `switchboard serve --redis` gateway. A
closed-loop load generator (benchmarks/loadgen.py) keeps `--concurrency` greedy completions in
flight (token-id prompts of `--prompt-len`; outputs of max_tokens/2 to 3*max_tokens/2 tokens, a
different length per connection); output tokens/s is what the workers report generating. Phase 1
runs it against one worker; then a second worker joins the same Redis, the gateway finds it, and
phase 2 runs the same load. The ratio of the two rates is the figure; on a machine with fewer free cores than workers it
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
                               machine_summary, non_negative_float, positive_float, positive_int)
from benchmarks.loadgen import LoadResult, closed_loop, encode_request, percentile
from store.workers import WorkerRecord
from tests.processes import SwitchboardProcess, is_healthy, start_switchboard, wait_until
from tests.redis_server import start_redis_server, stop_redis_server

ADMIN_KEY = "sb-admin-bench-scaleout"
MODEL = "bench"
# Tokens are counted from the workers' heartbeats (one a second), which lag by up to a beat at each
# end of a window: a window of 10 beats keeps that error to a fifth at most (2 s gave 11x).
MIN_DURATION_S = 10.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight")
    parser.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="output tokens per request")
    parser.add_argument("--warmup", type=non_negative_float, default=5.0, help="untimed seconds per phase")
    parser.add_argument("--duration", type=_timed_seconds, default=30.0,
                        help=f"timed seconds per phase, at least {MIN_DURATION_S:g} (default 30)")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR,
                        help=f"where the random model is kept (default {DEFAULT_WORK_DIR})")
    return parser.parse_args()


def _timed_seconds(text: str) -> float:
    value = positive_float(text)
    if value < MIN_DURATION_S:
        raise argparse.ArgumentTypeError(
            f"must be at least {MIN_DURATION_S:g} s: the tokens are counted from the workers' "
            f"heartbeats, which lag by up to a second at each end of the window, got {text}")
    return value


def start_worker(root: Path, index: int, redis_url: str, model_dir: Path) -> SwitchboardProcess:
    return start_switchboard(
        ["worker", "--redis", redis_url, "--model", f"{MODEL}={model_dir}",
         "--data-dir", str(root / f"worker{index}"), "--kv-cache-memory", "512MiB",
         "--max-num-seqs", "32", "--max-loras", "0", "--log-level", "warning"],
        root / f"worker{index}.log")


def worker_tokens(redis_url: str) -> dict[str, int]:
    """Output tokens generated so far by each registered worker, by its URL."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        raws = [client.get(f"sb:worker:{i.decode()}") for i in client.smembers("sb:workers")]
    finally:
        client.close()
    records = [msgspec.json.decode(raw, type=WorkerRecord) for raw in raws if raw is not None]
    return {r.url: msgspec.json.decode(r.stats)["num_generation_tokens"] for r in records}


def tenant_key(gateway: SwitchboardProcess) -> str:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(gateway.url + "/admin/tenants", json={"name": "bench"}, headers=admin).raise_for_status()
    return httpx.post(gateway.url + "/admin/tenants/bench/keys", headers=admin).json()["key"]


def run_load(gateway: SwitchboardProcess, key: str, args: argparse.Namespace,
             vocab_size: int, redis_url: str) -> LoadResult:
    """The closed loop; its probe counts the output tokens the workers generated (the sum over
    their heartbeats' counters, which lag by up to a heartbeat at each end of the window)."""
    rng = random.Random(0)
    host = urlsplit(gateway.url)
    requests = []
    for i in range(args.concurrency):
        # NOTE: lengths differ by connection, or all requests finish in the same step and the
        # loop runs in lockstep rounds.
        body = msgspec.json.encode({
            "model": MODEL, "prompt": [rng.randrange(vocab_size) for _ in range(args.prompt_len)],
            "max_tokens": output_tokens(args, i),
            "temperature": 0, "ignore_eos": True})
        requests.append(encode_request("POST", "/v1/completions", host.netloc, body,
                                       {"Authorization": f"Bearer {key}",
                                        "Content-Type": "application/json"}))
    return asyncio.run(closed_loop(host.hostname, host.port, requests, args.concurrency,
                                   args.warmup, args.duration,
                                   probe=lambda: sum(worker_tokens(redis_url).values())))


def output_tokens(args: argparse.Namespace, connection: int) -> int:
    """The max_tokens of a connection's requests: from half of --max-tokens (at least 1: the
    gateway refuses 0) up, one more per connection (wrapping past 1.5 times --max-tokens)."""
    return max(1, args.max_tokens // 2) + connection % (args.max_tokens + 1)


def report(label: str, result: LoadResult) -> float:
    tokens_per_s = result.probe_seconds / result.seconds  # NOTE: the probe counts tokens here
    p50 = percentile(result.latencies, 50) * 1000 if result.latencies else float("nan")
    print(f"{label}: {tokens_per_s:.1f} output tokens/s, {result.rate:.2f} req/s, "
          f"p50 latency {p50:.0f} ms, statuses {dict(result.statuses)}", flush=True)
    return tokens_per_s


def main() -> None:
    args = parse_args()
    spec = ModelSpec()
    model_dir = ensure_model(spec, args.work_dir)
    print(machine_summary())
    lengths = [output_tokens(args, i) for i in range(args.concurrency)]
    print(f"model: {spec.name} (random weights); {args.concurrency} in flight, prompt "
          f"{args.prompt_len} tokens, {min(lengths)} to {max(lengths)} output tokens (mean "
          f"{sum(lengths) / len(lengths):.1f}), greedy")
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
            one = report("one worker ", run_load(gateway, key, args, spec.vocab_size, redis_url))
            processes.append(start_worker(root, 1, redis_url, model_dir))
            wait_until(processes[-1], lambda: len(worker_tokens(redis_url)) == 2)
            print(load_summary())
            two = report("two workers", run_load(gateway, key, args, spec.vocab_size, redis_url))
            print(f"output tokens by worker since the start: {worker_tokens(redis_url)}")
            if one > 0:
                print(f"two workers / one worker: {two / one:.2f}x output tokens/s")
            else:
                print("two workers / one worker: not measurable: no tokens were counted with one "
                      "worker; raise --duration")
            print(load_summary())
        finally:
            for process in processes:
                process.stop()
            stop_redis_server(redis_proc)


if __name__ == "__main__":
    main()
