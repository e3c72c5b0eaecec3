"""Real `switchboard` processes for tests: start one on a free loopback port, wait until it is
healthy, stop it (gracefully, or kill it). Output goes to a log file that failures quote."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

_random = random.SystemRandom()  # a test seeding `random` must not make every run pick alike
_START_TIMEOUT_S = 120.0  # loading torch and the model on a busy 2-core machine


def free_port() -> int:
    """A loopback port free now, for a server started later. Not one that binding port 0 gives:
    that comes from the system's ephemeral range, from which any outgoing connection (a test's
    own clients) may take it in between; a port below that range is taken only by naming it."""
    lowest_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(1000):
        port = _random.randrange(max(1024, lowest_ephemeral - 16384), lowest_ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use
                continue
            return port
    raise RuntimeError(f"no free loopback port below {lowest_ephemeral}")


@dataclass
class SwitchboardProcess:
    """One running `switchboard` command."""

    popen: subprocess.Popen
    url: str
    port: int
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """Ctrl-C, then kill if it has not exited in 20 s."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


def start_switchboard(args: list[str], log: Path, port: int | None = None) -> SwitchboardProcess:
    """Run `switchboard ARGS --port PORT` (a free port unless given), without waiting."""
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # several engines share 2 cores
    env.pop("SWITCHBOARD_ADMIN_KEY", None)
    with open(log, "ab") as out:
        popen = subprocess.Popen([sys.executable, "-m", "gateway.cli", *args, "--port", str(port)],
                                 stdout=out, stderr=subprocess.STDOUT, env=env)
    return SwitchboardProcess(popen, f"http://127.0.0.1:{port}", port, log)


def wait_until(process: SwitchboardProcess, is_ready: Callable[[], bool],
               timeout_s: float = _START_TIMEOUT_S) -> None:
    """Poll `is_ready` until it holds; fail with the process's output if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.popen.poll() is None:
        try:
            if is_ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{process.popen.args} did not become ready; its output:\n"
                         f"{process.output()[-4000:]}")


def is_healthy(process: SwitchboardProcess) -> bool:
    return httpx.get(process.url + "/health", timeout=2).status_code == 200
