"""The benchmark scripts refuse counts and durations that would measure nothing: argparse's exit 2
naming the option, where a zero once ended a run in a ZeroDivisionError or IndexError."""

import importlib
import sys

import pytest


@pytest.mark.parametrize("script, argv", [
    ("bench_gateway", ["--concurrency", "0"]),
    ("bench_gateway", ["--duration", "0"]),
    ("bench_gateway", ["--pairs", "0"]),
    ("bench_scaleout", ["--duration", "nan"]),
    # Counted from heartbeats: 0.3 s counted no tokens (a ZeroDivisionError), 2 s gave 11x.
    ("bench_scaleout", ["--duration", "2"]),
    ("bench_engine", ["--decode-steps", "0"]),
    ("bench_lora", ["--num-requests", "-1"]),
    ("bench_turns", ["--n", "0"]),
    ("bench_turns", ["--delay", "-1"]),
])
def test_a_count_or_duration_that_measures_nothing_exits_2(monkeypatch, capsys, script, argv):
    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as exited:
        module.parse_args()
    assert exited.value.code == 2
    assert f"argument {argv[0]}: must be" in capsys.readouterr().err
