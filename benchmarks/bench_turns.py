"""Turns between tenants: one tenant's small call while another tenant's one call floods the queue.

A real `switchboard serve` on the demo model (SQLite store, one intra-op thread) and two tenants.
Tenant "quiet" sends a 2-token completion alone, `--repeats` times (median); then tenant "noisy"
sends one completion of `--prompts` prompts x `--n` choices (2048 queued requests by default, the
most one call may ask for), and `--delay` seconds later "quiet" sends the same 2-token call. The
figure is quiet's latency under the flood over its latency alone; before tenants took turns
within a priority the quiet call waited for nearly the whole flood.

Run from the repository root:

    python -m benchmarks.bench_turns
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import load_summary, machine_summary, non_negative_float, positive_int
from tests.processes import is_healthy, start_switchboard, wait_until

ADMIN_KEY = "sb-admin-bench-turns"
MODEL = "switchboard-demo"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=positive_int, default=1024, help="prompts in the flooding call")
    parser.add_argument("--n", type=positive_int, default=2, help="choices per prompt of the flooding call")
    parser.add_argument("--max-tokens", type=positive_int, default=50, help="tokens per flooding choice")
    parser.add_argument("--delay", type=non_negative_float, default=2.0,
                        help="seconds between the flood and the quiet call (default 2)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="quiet calls timed alone")
    return parser.parse_args()


def tenant_key(client: httpx.Client, name: str) -> str:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    client.post("/admin/tenants", json={"name": name}, headers=admin).raise_for_status()
    return client.post(f"/admin/tenants/{name}/keys", headers=admin).json()["key"]


async def completion(client: httpx.AsyncClient, key: str, **fields) -> float:
    """Seconds one completion took; fails on anything but a 200."""
    start = time.perf_counter()
    response = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": MODEL, "temperature": 0, **fields})
    response.raise_for_status()
    return time.perf_counter() - start


async def measure(url: str, quiet: str, noisy: str, args: argparse.Namespace) -> None:
    small = {"prompt": "hi", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await completion(client, quiet, **small)  # warm-up
        alone = statistics.median([await completion(client, quiet, **small)
                                   for _ in range(args.repeats)])
        flood = asyncio.create_task(completion(
            client, noisy, prompt=[f"flood {i}" for i in range(args.prompts)], n=args.n,
            max_tokens=args.max_tokens))
        await asyncio.sleep(args.delay)
        under_flood = await completion(client, quiet, **small)
        flood_s = await flood
    print(f"quiet 2-token call alone (median of {args.repeats}): {alone * 1e3:.0f} ms")
    print(f"noisy call, {args.prompts} prompts x n={args.n}, max_tokens {args.max_tokens}: {flood_s:.1f} s")
    print(f"quiet call sent {args.delay:g} s into the flood: {under_flood * 1e3:.0f} ms "
          f"({under_flood / alone:.1f}x alone, {under_flood / flood_s:.1%} of the flood's time)")


def main() -> None:
    args = parse_args()
    print(machine_summary())
    print(load_summary())
    with tempfile.TemporaryDirectory(prefix="bench-turns-") as root:
        server = start_switchboard(["serve", "--data-dir", str(Path(root) / "data"), "--admin-key",
                                    ADMIN_KEY, "--log-level", "warning"], Path(root) / "serve.log")
        try:
            wait_until(server, lambda: is_healthy(server))
            with httpx.Client(base_url=server.url, timeout=60) as client:
                quiet, noisy = tenant_key(client, "quiet"), tenant_key(client, "noisy")
            asyncio.run(measure(server.url, quiet, noisy, args))
        finally:
            server.stop()
    print(load_summary())


if __name__ == "__main__":
    main()
