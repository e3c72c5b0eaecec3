"""The arithmetic fixtures in the engine, and the task's train/held-out split.

Routing tests rely on these exact behaviours: the small model answers the easy sums below right and
the hard ones wrong (with low confidence), and the large model answers both right. They were
measured on the committed fixtures; retraining them means measuring these lists again.
"""

import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks import arithmetic
from benchmarks.arithmetic import Problem

FIXTURES = Path(__file__).parent / "fixtures" / "arithmetic"
EASY = [Problem(a, b) for a, b in ((7, 6), (9, 4), (80, 64), (49, 81), (84, 68), (92, 83), (58, 39),
                                   (71, 91))]
HARD = [Problem(a, b) for a, b in ((684, 415), (798, 285), (815, 898), (140, 784), (671, 686),
                                   (608, 693), (170, 960), (762, 691))]
MEDIUM_RIGHT_ON_HARD = [False, True, False, True, False, False, True, False]
CONFIDENT = 0.5
"""The small model's min token prob is above this on every EASY answer and below it on every HARD one."""


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    # NOTE: tiny models gain nothing from more threads, and a busy machine makes them much slower.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def answers(single_thread) -> dict[str, list[arithmetic.GradedAnswer]]:
    from engine.llm import LLM

    results = {}
    for name in ("small", "medium", "large"):
        llm = LLM(str(FIXTURES / name), show_progress=False, num_kv_blocks=64)
        results[name] = arithmetic.answer_with_engine(llm, EASY + HARD)
    return results


def test_fixtures_are_small_float16_folders():
    for name in ("small", "medium", "large"):
        folder = FIXTURES / name
        assert sorted(p.name for p in folder.iterdir()) == [
            "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
            "tokenizer.json", "tokenizer_config.json"]
        with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
            assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"F16"}
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert total < 12 * 2**20


def test_small_model_is_right_on_easy_and_wrong_on_hard(answers):
    small = answers["small"]
    assert [a.text for a in small[: len(EASY)]] == [p.answer for p in EASY]
    assert not any(a.is_correct for a in small[len(EASY):])
    assert all(a.min_token_prob > CONFIDENT for a in small[: len(EASY)])
    assert all(a.min_token_prob < CONFIDENT for a in small[len(EASY):])


def test_large_model_is_right_on_both(answers):
    assert [a.text for a in answers["large"]] == [p.answer for p in EASY + HARD]


def test_medium_model_is_right_on_easy_and_on_some_hard(answers):
    medium = answers["medium"]
    assert [a.text for a in medium[: len(EASY)]] == [p.answer for p in EASY]
    assert [a.is_correct for a in medium[len(EASY):]] == MEDIUM_RIGHT_ON_HARD


def test_held_out_sets_never_meet_training_problems():
    rng = random.Random(0)
    train = {arithmetic.sample_train_problem(rng, d)
             for d in range(1, arithmetic.MAX_DIFFICULTY + 1) for _ in range(2000)}
    for d in range(1, arithmetic.MAX_DIFFICULTY + 1):
        held_out = arithmetic.held_out_problems(seed=d, difficulty=d, num=300)
        assert all(arithmetic.is_held_out(p) for p in held_out)
        assert len(set(held_out)) == len(held_out)
        assert not train & set(held_out)
        assert all(p.difficulty == d for p in held_out)
    assert not any(arithmetic.is_held_out(p) for p in train)


def test_held_out_share_of_one_digit_sums():
    one_digit = [Problem(a, b) for a in range(10) for b in range(10)]
    held_out = arithmetic.held_out_problems(seed=0, difficulty=1, num=100)
    assert sorted(held_out, key=lambda p: p.prompt) == sorted(
        (p for p in one_digit if arithmetic.is_held_out(p)), key=lambda p: p.prompt)
    assert len(held_out) == 12


def test_is_correct_wants_exactly_the_sum():
    problem = Problem(482, 907)
    assert problem.prompt == "482+907=" and problem.answer == "1389"
    assert arithmetic.is_correct(problem, "1389")
    assert arithmetic.is_correct(problem, "1389\n")
    assert not arithmetic.is_correct(problem, "13890")
    assert not arithmetic.is_correct(problem, "1388")


def test_mixed_problems_follow_the_weights():
    problems = arithmetic.mixed_problems(seed=3, weights={1: 0.1, 2: 0.5, 3: 0.4}, num=200)
    counts = {d: sum(p.difficulty == d for p in problems) for d in (1, 2, 3)}
    assert counts == {1: 20, 2: 100, 3: 80}
    assert all(arithmetic.is_held_out(p) for p in problems)


def graded(problem: Problem, text: str, min_prob: float) -> arithmetic.GradedAnswer:
    return arithmetic.GradedAnswer(problem, text, (-0.01, math.log(min_prob)))


def test_cascade_escalates_below_the_threshold():
    problems = [Problem(1, 2), Problem(10, 20), Problem(100, 200), Problem(11, 22)]
    small = [graded(problems[0], "3", 0.9), graded(problems[1], "31", 0.2),
             graded(problems[2], "301", 0.3), graded(problems[3], "33", 0.8)]
    large = [graded(p, p.answer, 0.99) for p in problems[:3]] + [graded(problems[3], "34", 0.99)]
    result = arithmetic.cascade(small, large, threshold=0.5)
    assert (result.small_accuracy, result.large_accuracy) == (0.5, 0.75)
    assert (result.cascade_accuracy, result.escalation_rate) == (1.0, 0.5)
    assert arithmetic.best_threshold(small, large, max_escalation_rate=0.5) == pytest.approx(0.8)
    assert arithmetic.best_threshold(small, large, max_escalation_rate=0.25) == pytest.approx(0.3)
