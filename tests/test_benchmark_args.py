"""Benchmark scripts refuse arguments that would measure nothing or crash midway: argparse's exit
2 naming the option, before any model is loaded."""

import argparse
import importlib
import subprocess
import sys

import pytest

from benchmarks import routing
from benchmarks.common import MAX_SEED


@pytest.mark.parametrize("args, words", [
    (["--mix", "foo"], "argument --mix: expected difficulty:share"),
    (["--mix", "1:0"], "argument --mix: shares must be finite, not negative, and not all 0"),
    (["--mix", "1:-1,2:2"], "argument --mix: shares must be"),
    (["--mix", "7:1"], "argument --mix: difficulties must be in [1, 3]"),
    (["--num-problems", "0"], "argument --num-problems: must be at least 1"),
    (["--num-train", "1"], f"argument --num-train: must be at least {routing.MIN_TRAIN}"),
    (["--seed", str(2**64)], f"argument --seed: must be from 0 to {MAX_SEED}, got {2**64}"),
    (["--seed", "-1"], "argument --seed: must be from 0 to"),
])
def test_the_routing_benchmark_refuses_arguments_it_cannot_run(args, words, capsys):
    with pytest.raises(SystemExit) as exited:
        routing.main(args)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("acc_large", [0.7, 0.0])
def test_a_curve_with_no_gap_to_recover_is_not_measurable(acc_large, capsys):
    """Equally accurate models (1- and 2-digit sums, which all three get right) ended the run in a
    ZeroDivisionError."""
    points = routing.random_curve(0.7, acc_large)
    routing.print_curve("random", points, 0.7, acc_large)
    assert "APGR not measurable: the large model" in capsys.readouterr().out


def test_a_throughput_run_with_no_reply_in_its_window_is_not_measurable(capsys):
    """A window too short for any reply (--duration 0.001) ended the run in an IndexError."""
    from benchmarks.bench_gateway import report_throughput
    from benchmarks.loadgen import LoadResult

    report_throughput([LoadResult(4, 0.001, [])])
    out = capsys.readouterr().out
    assert "nan" in out and "not measurable, no reply came inside the window" in out


def test_percentiles_are_the_nearest_rank():
    from benchmarks.loadgen import percentile

    # Each one rank low: round() took q/100 * n = 2.5 to 2.
    assert percentile([5, 1, 4, 2, 3], 50) == 3
    assert percentile(list(range(1, 11)), 25) == 3
    assert (percentile(list(range(1, 101)), 99), percentile([7.0], 50), percentile([1, 2], 0)) == (99, 7.0, 1)


def test_a_default_mix_reads_as_difficulty_shares():
    assert routing.difficulty_mix("1:0.3,2:0.3,3:0.4") == {1: 0.3, 2: 0.3, 3: 0.4}


@pytest.mark.parametrize("script", ["bench_gateway", "bench_scaleout"])
def test_a_negative_warmup_is_refused(script):
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", "--warmup", "-1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "argument --warmup: must be a finite number, 0 or more, got -1" in done.stderr


@pytest.mark.parametrize("script, args, words", [
    ("bench_lora", ["--alphas", "1", "0"], "argument --alphas: must be a finite number above 0, got 0"),
    ("bench_lora", ["--registered", "1"], "argument --scale-active: at most 1 of --registered 1 "
     "adapters can be active (the cold-load probes and the PEFT check use others), got 128"),
    ("train_arithmetic", ["--sizes", "small,bogus"], "argument --sizes: unknown sizes 'bogus'; the "
     "sizes are small, medium, large"),
    ("train_arithmetic", ["--threads", "0"], "argument --threads: must be at least 1, got 0"),
    ("train_arithmetic", ["--probe-size", "0"], "argument --probe-size: must be at least 1, got 0"),
    ("train_arithmetic", ["--report-only", "--out", "/nonexistent"], "argument --report-only: no "
     "trained small, medium, large in /nonexistent; train them first"),
])
def test_scripts_refuse_arguments_that_would_fail_midway(script, args, words, capsys):
    parse_args = importlib.import_module(f"benchmarks.{script}").parse_args
    with pytest.raises(SystemExit) as exited:
        parse_args(args)
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_scripts_take_arguments_they_can_run():
    from benchmarks import bench_lora, train_arithmetic

    assert bench_lora.parse_args(["--registered", "200"]).scale_active == 128
    assert train_arithmetic.parse_args(["--report-only", "--sizes", "small"]).sizes == ["small"]


def test_the_scaleout_benchmark_asks_for_at_least_1_token():
    """The gateway refuses max_tokens 0 (without echo): --max-tokens 1 once sent it on half the
    connections, and reported the 400s' rate."""
    from benchmarks.bench_scaleout import output_tokens

    assert {output_tokens(argparse.Namespace(max_tokens=1), c) for c in range(4)} == {1, 2}
    assert {output_tokens(argparse.Namespace(max_tokens=4), c) for c in range(5)} == {2, 3, 4, 5, 6}
