"""Routing quality: accuracy against the share of large-model calls, on held-out arithmetic.

The models are the trained fixtures of tests/fixtures/arithmetic (made by
`python -m benchmarks.train_arithmetic`): small, medium and large models of multi-digit addition,
run greedily by Switchboard's own engine. Every held-out problem is answered by every model once;
each router is then a rule over those answers, swept over its threshold:

- random: a share p of requests goes to the large model (the expected accuracy is exact);
- cascade, one curve per confidence measure (routing.confidence): the small model answers unless
  its confidence is below the threshold;
- learned: routing.learned trained on the small model's outcomes on *training* problems, scored
  on the held-out prompts;
- a three-tier cascade small -> medium -> large (min_prob, one threshold for both steps).

For each it prints the curve, APGR (RouteLLM's average performance gap recovered: the area under
(accuracy - small) / (large - small) over the large-call share), and the best accuracy reached
with at most 40% of requests on the large model. Target: >= 95% of the large model's accuracy
with <= 40% large-model calls, on a mix where the small model alone reaches <= 70% of it.

    python -m benchmarks.routing            # ~1-2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.arithmetic import (MAX_DIFFICULTY, Problem, is_correct, mixed_problems,
                                   sample_train_problem)
from benchmarks.common import positive_int, random_seed
from routing.confidence import MEASURES, confidence
from routing.learned import Example, train_router

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "arithmetic"
MODELS = ("small", "medium", "large")
MAX_LARGE_SHARE = 0.4
TARGET_RECOVERY = 0.95


@dataclass(frozen=True)
class Answer:
    correct: bool
    logprobs: list[float]  # of each generated token, EOS included


@dataclass(frozen=True)
class Point:
    large_share: float  # requests answered by the large model (a cascade's escalations)
    accuracy: float
    threshold: float


def answer_all(model: str, problems: Sequence[Problem], max_tokens: int) -> list[Answer]:
    """Greedy answers of one fixture model by Switchboard's engine, with token logprobs."""
    from engine.llm import LLM
    from engine.request import SamplingParams

    llm = LLM(str(FIXTURES / model), show_progress=False, num_kv_blocks=1024)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    outputs = llm.generate([p.prompt for p in problems], params, use_tqdm=False)
    return [Answer(is_correct(p, out.text), [lp.logprob for lp in out.logprobs])
            for p, out in zip(problems, outputs)]


def accuracy(correct: Sequence[bool]) -> float:
    return sum(correct) / len(correct)


def sweep(scores: Sequence[float], small: Sequence[Answer], large: Sequence[Answer],
          escalate_below: bool = True) -> list[Point]:
    """Every operating point of a two-model router with per-request `scores`: at threshold t the
    large model answers when score < t (cascade confidences) or score >= t (learned router)."""
    points = []
    for t in sorted(set(scores)) + [float("inf")]:
        goes_large = [(s < t) if escalate_below else (s >= t) for s in scores]
        answers = [lg if go else sm for go, sm, lg in zip(goes_large, small, large)]
        points.append(Point(sum(goes_large) / len(scores),
                            accuracy([a.correct for a in answers]), t))
    if not escalate_below:
        points.append(Point(0.0, accuracy([a.correct for a in small]), float("inf")))
    return sorted(points, key=lambda p: (p.large_share, -p.accuracy))


def random_curve(acc_small: float, acc_large: float) -> list[Point]:
    return [Point(share / 20, acc_small + (acc_large - acc_small) * share / 20, share / 20)
            for share in range(21)]


def apgr(points: Sequence[Point], acc_small: float, acc_large: float) -> float:
    """Area under the performance-gap-recovered curve over the large share in [0, 1], keeping the
    best accuracy reached at or below each share (as RouteLLM reports it)."""
    gap = acc_large - acc_small
    frontier: list[tuple[float, float]] = [(0.0, 0.0)]
    best = 0.0
    for point in sorted(points, key=lambda p: p.large_share):
        best = max(best, (point.accuracy - acc_small) / gap)
        frontier.append((point.large_share, best))
    frontier.append((1.0, max(best, 1.0)))
    return sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(frontier, frontier[1:]))


def best_within(points: Sequence[Point], max_share: float) -> Point:
    return max((p for p in points if p.large_share <= max_share + 1e-9), key=lambda p: p.accuracy)


def three_tier(small: Sequence[Answer], medium: Sequence[Answer], large: Sequence[Answer],
               measure: str) -> list[Point]:
    """small -> medium -> large with one threshold for both steps; share counts large calls."""
    points = []
    scores_s = [confidence(a.logprobs, measure) for a in small]
    scores_m = [confidence(a.logprobs, measure) for a in medium]
    for t in sorted(set(scores_s) | set(scores_m)) + [float("inf")]:
        answers, large_calls = [], 0
        for s_score, m_score, sm, md, lg in zip(scores_s, scores_m, small, medium, large):
            if s_score >= t:
                answers.append(sm)
            elif m_score >= t:
                answers.append(md)
            else:
                answers.append(lg)
                large_calls += 1
        points.append(Point(large_calls / len(small), accuracy([a.correct for a in answers]), t))
    return points


def learned_scores(problems: Sequence[Problem], num_train: int, seed: int,
                   weights: dict[int, float]) -> tuple[list[float], float]:
    """Scores of a router trained on the small model's outcomes on training-split problems."""
    rng = random.Random(seed)
    difficulties = list(weights)
    train = [sample_train_problem(rng, rng.choices(difficulties, list(weights.values()))[0])
             for _ in range(num_train)]
    outcomes = answer_all("small", train, max_tokens=6)
    examples = [Example(p.prompt, a.correct) for p, a in zip(train, outcomes)]
    started = time.perf_counter()
    router, report = train_router(examples, target_strong_share=MAX_LARGE_SHARE, seed=seed)
    print(f"learned router: trained on {report.num_train} training-split prompts in "
          f"{time.perf_counter() - started:.1f} s, held-out (training split) AUC {report.auc:.3f}")
    return router.scores([p.prompt for p in problems]), router.settings.threshold


def print_curve(name: str, points: Sequence[Point], acc_small: float, acc_large: float) -> None:
    if acc_large <= acc_small:  # NOTE: APGR is a share of the gap: there is none to recover
        print(f"{name:<28} APGR not measurable: the large model ({acc_large:.3f}) is no more "
              f"accurate than the small one ({acc_small:.3f}) on this mix; add harder problems")
        return
    best = best_within(points, MAX_LARGE_SHARE)
    score = apgr(points, acc_small, acc_large)
    met = best.accuracy >= TARGET_RECOVERY * acc_large
    print(f"{name:<28} APGR {score:.3f}   best at <= {MAX_LARGE_SHARE:.0%} large: accuracy "
          f"{best.accuracy:.3f} ({best.accuracy / acc_large:.1%} of large) with "
          f"{best.large_share:.1%} large  [{'met' if met else 'missed'}]")
    shown = [best_within(points, share / 10) for share in range(11)]
    print("    " + "  ".join(f"{p.large_share:.0%}:{p.accuracy:.3f}" for p in shown))


# The fewest training-split prompts to train a router on: some of each outcome, some held out.
MIN_TRAIN = 20


def difficulty_mix(text: str) -> dict[int, float]:
    """An argparse type: `difficulty:share,...`, difficulties in [1, MAX_DIFFICULTY], shares
    that are not negative and add up to more than 0."""
    try:
        mix = {int(d): float(w) for d, w in (item.split(":") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected difficulty:share,... (e.g. 1:0.3,2:0.7), "
                                         f"got {text!r}") from None
    if not all(1 <= d <= MAX_DIFFICULTY for d in mix):
        raise argparse.ArgumentTypeError(f"difficulties must be in [1, {MAX_DIFFICULTY}], got {text!r}")
    if any(not 0 <= w < float("inf") for w in mix.values()) or not sum(mix.values()) > 0:
        raise argparse.ArgumentTypeError(f"shares must be finite, not negative, and not all 0, "
                                         f"got {text!r}")
    return mix


def at_least_min_train(text: str) -> int:
    value = int(text)
    if value < MIN_TRAIN:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_TRAIN}, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-problems", type=positive_int, default=600,
                        help="held-out prompts (600)")
    parser.add_argument("--mix", type=difficulty_mix, default="1:0.3,2:0.3,3:0.4",
                        help=f"difficulty:share of the held-out mix, difficulties 1-{MAX_DIFFICULTY} "
                        "(default 1:0.3,2:0.3,3:0.4)")
    parser.add_argument("--num-train", type=at_least_min_train, default=2000,
                        help=f"training-split prompts for the learned router (2000; at least {MIN_TRAIN})")
    parser.add_argument("--seed", type=random_seed, default=1)
    args = parser.parse_args(argv)
    weights = args.mix
    problems = mixed_problems(args.seed, weights, args.num_problems)
    started = time.perf_counter()
    answers = {m: answer_all(m, problems, max_tokens=6) for m in MODELS}
    print(f"{len(problems)} held-out problems, mix {weights}; answered by {', '.join(MODELS)} in "
          f"{time.perf_counter() - started:.1f} s")
    acc = {m: accuracy([a.correct for a in answers[m]]) for m in MODELS}
    for m in MODELS:
        by_difficulty = {d: accuracy([a.correct for p, a in zip(problems, answers[m])
                                      if p.difficulty == d]) for d in sorted(weights)}
        print(f"  {m:<7} accuracy {acc[m]:.3f}  by digits "
              + "  ".join(f"{d}: {v:.3f}" for d, v in by_difficulty.items()))
    ratio = acc["small"] / acc["large"]
    print(f"small alone reaches {ratio:.1%} of the large model's accuracy "
          f"(the mix must keep this <= 70%: {'yes' if ratio <= 0.70 else 'NO'})\n")
    small, large = answers["small"], answers["large"]
    print_curve("random", random_curve(acc["small"], acc["large"]), acc["small"], acc["large"])
    for measure in MEASURES:
        scores = [confidence(a.logprobs, measure) for a in small]
        print_curve(f"cascade {measure}", sweep(scores, small, large), acc["small"], acc["large"])
    try:
        scores, _ = learned_scores(problems, args.num_train, args.seed, weights)
    except ValueError as error:  # e.g. the small model got every training prompt right
        print(f"learned router: not trained: {error}; give a larger --num-train or a mix of "
              "harder problems")
    else:
        print_curve("learned router", sweep(scores, small, large, escalate_below=False),
                    acc["small"], acc["large"])
    print_curve("cascade 3 tiers, min_prob", three_tier(small, answers["medium"], large, "min_prob"),
                acc["small"], acc["large"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
