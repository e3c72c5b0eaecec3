"""Multi-digit addition: a task with verifiable answers and a difficulty ladder.

A problem is two operands of the same number of digits, written as plain text: the prompt is
"482+907=" and the right completion is the sum's digits, "1389", after which the model ends the
sequence (EOS). The difficulty of a problem is that number of digits. A small transformer learns each
operand length as a separate skill (where the digits to add sit depends on the length), and longer
sums take longer to learn, so a model with a small budget answers short sums and fails long ones:
a routing task with verifiable answers.

Train and held-out problems are split by a hash of the prompt, so no seed or sample size can ever
put a held-out problem into training data.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm import LLM

MAX_DIFFICULTY = 3
HELD_OUT_ONE_IN = 8
"""One problem in this many (by prompt hash) is held out of training."""


@dataclass(frozen=True)
class Problem:
    """`a + b`, both operands with `difficulty` digits."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def difficulty(self) -> int:
        return len(str(max(self.a, self.b)))


def is_held_out(problem: Problem) -> bool:
    """True for the fixed share of problems reserved for evaluation; training never sees them."""
    digest = hashlib.sha256(problem.prompt.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_ONE_IN == 0


def is_correct(problem: Problem, completion_text: str) -> bool:
    """The completion is exactly the sum (surrounding whitespace ignored)."""
    return completion_text.strip() == problem.answer


def sample_problem(rng: random.Random, difficulty: int, held_out: bool) -> Problem:
    """A uniformly random problem of one difficulty from the train share or the held-out share."""
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be in [1, {MAX_DIFFICULTY}], got {difficulty}")
    low = 0 if difficulty == 1 else 10 ** (difficulty - 1)
    high = 10**difficulty - 1
    while True:
        problem = Problem(rng.randint(low, high), rng.randint(low, high))
        if is_held_out(problem) == held_out:
            return problem


def sample_train_problem(rng: random.Random, difficulty: int) -> Problem:
    """A random problem outside the held-out share (what training and routers may learn from)."""
    return sample_problem(rng, difficulty, held_out=False)


def held_out_problems(seed: int, difficulty: int, num: int) -> list[Problem]:
    """Up to `num` distinct held-out problems of one difficulty, in a seeded order.

    1-digit sums are only 100 problems, so at difficulty 1 about a dozen come back."""
    if difficulty == 1:
        space = [Problem(a, b) for a in range(10) for b in range(10)]
        random.Random(seed).shuffle(space)
        return [p for p in space if is_held_out(p)][:num]
    rng, found = random.Random(seed), {}
    while len(found) < num:
        found.setdefault(sample_problem(rng, difficulty, held_out=True), None)
    return list(found)


def mixed_problems(seed: int, weights: dict[int, float], num: int) -> list[Problem]:
    """`num` held-out problems whose difficulties follow `weights` (difficulty -> share),
    each difficulty's share rounded to whole problems; held-out problems repeat when a
    difficulty's held-out space is smaller than its share."""
    total = sum(weights.values())
    problems: list[Problem] = []
    for difficulty, weight in sorted(weights.items()):
        count = round(num * weight / total)
        pool = held_out_problems(seed + difficulty, difficulty, count)
        problems += [pool[i % len(pool)] for i in range(count)]
    random.Random(seed).shuffle(problems)
    return problems


def accuracy(problems: Sequence[Problem], completions: Sequence[str]) -> float:
    if not problems:
        return 0.0
    return sum(is_correct(p, c) for p, c in zip(problems, completions, strict=True)) / len(problems)


@dataclass(frozen=True)
class GradedAnswer:
    """One greedy completion of a problem, with the logprob of every generated token (EOS included)."""

    problem: Problem
    text: str
    token_logprobs: tuple[float, ...]

    @property
    def is_correct(self) -> bool:
        return is_correct(self.problem, self.text)

    @property
    def min_token_prob(self) -> float:
        """The confidence signal of the cascade: the least likely token the model chose."""
        return math.exp(min(self.token_logprobs, default=0.0))

    @property
    def mean_logprob(self) -> float:
        return sum(self.token_logprobs) / max(1, len(self.token_logprobs))


def answer_with_engine(llm: LLM, problems: Sequence[Problem]) -> list[GradedAnswer]:
    """Greedy answers from Switchboard's engine, with the sampled tokens' logprobs."""
    from engine.request import SamplingParams

    # NOTE: room for one digit more than any right answer, then EOS.
    params = SamplingParams(max_tokens=MAX_DIFFICULTY + 2, temperature=0.0, logprobs=0)
    outputs = llm.generate([p.prompt for p in problems], params, use_tqdm=False)
    return [GradedAnswer(p, out.text, tuple(lp.logprob for lp in out.logprobs))
            for p, out in zip(problems, outputs, strict=True)]


@dataclass(frozen=True)
class CascadeResult:
    """Small model first; the large model answers when the small one's min token prob < threshold."""

    threshold: float
    small_accuracy: float
    large_accuracy: float
    cascade_accuracy: float
    escalation_rate: float

    @property
    def small_to_large(self) -> float:
        return self.small_accuracy / self.large_accuracy if self.large_accuracy else 0.0

    @property
    def cascade_to_large(self) -> float:
        return self.cascade_accuracy / self.large_accuracy if self.large_accuracy else 0.0


def cascade(small: Sequence[GradedAnswer], large: Sequence[GradedAnswer], threshold: float) -> CascadeResult:
    """Score the cascade on answers both models gave to the same problems."""
    if not small or len(small) != len(large):
        raise ValueError("cascade needs the same non-empty problem list answered by both models")
    escalated = [answer.min_token_prob < threshold for answer in small]
    final = [strong if up else weak for weak, strong, up in zip(small, large, escalated)]
    count = len(small)
    return CascadeResult(
        threshold=threshold,
        small_accuracy=sum(a.is_correct for a in small) / count,
        large_accuracy=sum(a.is_correct for a in large) / count,
        cascade_accuracy=sum(a.is_correct for a in final) / count,
        escalation_rate=sum(escalated) / count,
    )


def best_threshold(small: Sequence[GradedAnswer], large: Sequence[GradedAnswer],
                   max_escalation_rate: float) -> float:
    """The threshold with the most accurate cascade that escalates at most `max_escalation_rate`
    of the problems (ties go to fewer escalations): a calibration, so fit it on one problem set
    and score it on another."""
    candidates = sorted({s.min_token_prob for s in small} | {0.0, 1.0 + 1e-9})
    results = [cascade(small, large, t) for t in candidates]
    allowed = [r for r in results if r.escalation_rate <= max_escalation_rate]
    return max(allowed, key=lambda r: (r.cascade_accuracy, -r.escalation_rate)).threshold
