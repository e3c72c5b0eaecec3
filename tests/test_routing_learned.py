"""The learned router: training, threshold calibration, saving, and `switchboard router train`."""

import json
import math
import random

import pytest

from gateway.cli import main
from routing.learned import (Example, LearnedRouter, _split, read_examples, roc_auc, threshold_for_share,
                             train_router)


def arithmetic_examples(count: int, seed: int = 0) -> list[Example]:
    """Sums whose operands have 1-5 digits; the 'small model' gets only 1-2 digit ones right."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        digits = rng.randint(1, 5)
        a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
        examples.append(Example(f"{a}+{b}=", digits <= 2))
    return examples


def test_the_router_learns_which_prompts_are_hard_and_hits_its_target_share():
    router, report = train_router(arithmetic_examples(500), target_strong_share=0.6)
    assert report.auc > 0.95
    assert report.strong_share == pytest.approx(0.6, abs=0.02)
    unseen = arithmetic_examples(200, seed=1)
    strong = [router.wants_strong(e.prompt)[0] for e in unseen]
    hard_sent = sum(s for s, e in zip(strong, unseen) if not e.small_correct)
    assert hard_sent / sum(not e.small_correct for e in unseen) > 0.9
    assert router.score("3+4=") < router.score("48213+99321=")


def test_save_and_load_give_the_same_scores(tmp_path):
    router, _ = train_router(arithmetic_examples(200), target_strong_share=0.5, epochs=20)
    router.save(tmp_path)
    loaded = LearnedRouter.load(tmp_path)
    prompts = [e.prompt for e in arithmetic_examples(20, seed=2)]
    assert loaded.scores(prompts) == router.scores(prompts)
    assert loaded.settings == router.settings
    (tmp_path / "router.json").write_text("{}")
    with pytest.raises(ValueError, match="no router made by"):
        LearnedRouter.load(tmp_path)


@pytest.mark.parametrize("change, words", [
    ({"threshold": "0.3"}, "Expected `float`, got `str` - at `$.threshold`"),
    ({"threshold": None}, "at `$.threshold`"),
    ({"threshold": 1.5}, "at `$.threshold`"),
    ({"num_buckets": 0}, "at `$.num_buckets`"),
    ({"char_ngrams": "ab"}, "at `$.char_ngrams`"),
    ({"word_ngrams": [0]}, "at `$.word_ngrams[0]`"),
    ({"target_strong_share": -0.1}, "at `$.target_strong_share`"),
    ({"weights": {"x": 1.0}}, "in `$.weights`"),
])
def test_a_router_file_with_a_bad_field_is_refused_when_loaded(tmp_path, change, words):
    # Once loaded, such a file failed every request to its route (TypeError, ZeroDivisionError).
    router, _ = train_router(arithmetic_examples(100), target_strong_share=0.5, epochs=5)
    router.save(tmp_path)
    document = json.loads((tmp_path / "router.json").read_text())
    (tmp_path / "router.json").write_text(json.dumps({**document, **change}))
    with pytest.raises(ValueError, match="no router made by") as raised:
        LearnedRouter.load(tmp_path)
    assert words in str(raised.value)
    # json.loads reads NaN (not JSON), which compares false with every score.
    (tmp_path / "router.json").write_text(json.dumps({**document, "threshold": math.nan}))
    with pytest.raises(ValueError, match="no router made by"):
        LearnedRouter.load(tmp_path)


def test_threshold_for_share_and_auc():
    scores = [0.1, 0.9, 0.4, 0.7, 0.3]
    assert threshold_for_share(scores, 0.4) == 0.7  # 0.9 and 0.7 are the top 40%
    assert threshold_for_share(scores, 0.0) > 0.9 and threshold_for_share(scores, 1.0) == 0.1
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [False, False, True, True]) == 1.0
    assert roc_auc([0.5, 0.5], [False, True]) == 0.5


def test_training_data_errors_name_the_line():
    with pytest.raises(ValueError, match="line 2"):
        read_examples(['{"prompt": "a", "small_correct": true}', '{"prompt": "b"}'])
    with pytest.raises(ValueError, match="got right and prompts it got wrong"):
        train_router([Example("a", True), Example("b", True)], 0.5)


def test_router_train_command(tmp_path, capsys, monkeypatch):
    data = tmp_path / "outcomes.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "small_correct": e.small_correct})
                            + "\n" for e in arithmetic_examples(300)))
    assert main(["router", "train", str(data), "--out", str(tmp_path / "r"),
                 "--target-strong-share", "0.5", "--epochs", "30"]) == 0
    assert "sends 50.0% to the strong model" in capsys.readouterr().out
    assert LearnedRouter.load(tmp_path / "r").settings.target_strong_share == 0.5
    # "~" after "=", which a shell leaves as is: the router went into a folder named "~" here.
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["router", "train", "--out=~/home-router", "--epochs=30", f"~/{data.name}"]) == 0
    assert LearnedRouter.load(tmp_path / "home-router").settings.target_strong_share == 0.4
    assert main(["router", "train", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]) == 2
    # A file that starts with a byte order mark, as some Windows tools write one.
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + data.read_bytes())
    assert main(["router", "train", str(marked), "--out", str(tmp_path / "r-bom"), "--epochs=30"]) == 0
    # An --out that is a file is refused before training (it once failed after, with a traceback).
    assert main(["router", "train", str(data), "--out", str(data)]) == 2
    assert "is a file; name a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as raised:  # 0 epochs made a router that sent everything strong
        main(["router", "train", str(data), "--out", str(tmp_path / "r0"), "--epochs", "0"])
    assert raised.value.code == 2


@pytest.mark.parametrize("lines", [[], ['{"prompt": "1+1=", "small_correct": true}']])
def test_router_train_on_too_few_outcomes_exits_2_with_one_line(tmp_path, capsys, lines):
    # An empty file once ended in an IndexError traceback.
    data = tmp_path / "outcomes.jsonl"
    data.write_text("".join(line + "\n" for line in lines))
    assert main(["router", "train", str(data), "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == ("switchboard router train: training needs prompts the small "
                                       "model got right and prompts it got wrong\n")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("holdout_fraction", [0.5, 0.99])
def test_a_large_holdout_leaves_training_both_outcomes(holdout_fraction):
    """Ten prompts the small model got right and one it got wrong: a holdout share that would
    take the wrong one away keeps it to train on (it was refused for data "lacking" an outcome
    that it holds)."""
    examples = [Example(f"easy {i}", True) for i in range(10)] + [Example("hard", False)]
    holdout, training = _split(examples, holdout_fraction, 0)
    assert {e.small_correct for e in training} == {True, False} and holdout
    assert sorted(holdout + training, key=examples.index) == examples
    _, report = train_router(examples, target_strong_share=0.3, holdout_fraction=holdout_fraction,
                             epochs=5)
    assert report.num_train + report.num_holdout == 11


@pytest.mark.parametrize("share", [1.5, -0.1, float("nan")])
def test_a_strong_share_outside_0_to_1_is_refused_before_training(share, monkeypatch):
    """It was refused only once the router was trained: minutes on a real data set."""
    import routing.learned as learned

    def no_training(*args, **kwargs):
        raise AssertionError("trained before the share was checked")

    monkeypatch.setattr(learned, "train", no_training)
    with pytest.raises(ValueError, match="the strong-model share must be in \\[0, 1\\]"):
        train_router(arithmetic_examples(20), target_strong_share=share)


def test_two_prompts_are_too_few_to_train_and_calibrate_and_are_told_so():
    with pytest.raises(ValueError, match="too few to hold some out .* give at least 3"):
        train_router([Example("easy", True), Example("hard", False)], target_strong_share=0.3)


def test_the_held_out_part_has_each_outcome_in_its_share_of_the_whole():
    """The calibration reads the held-out prompts as the traffic to come: a split that left out
    the hard prompts (as one ordered by a checksum of the line number did) calibrates on the
    wrong traffic, and cannot measure how well the router ranks."""
    examples = [Example(f"topic {i % 10} question {i}", i % 10 not in (3, 7)) for i in range(1000)]
    for seed in range(3):
        holdout, training = _split(examples, 0.2, seed)
        assert (len(holdout), len(training)) == (200, 800)
        assert sum(not e.small_correct for e in holdout) == 40  # 20% hard, as in the whole
        assert sorted(holdout + training, key=examples.index) == examples
    _, report = train_router(examples, target_strong_share=0.3, epochs=5)
    assert not math.isnan(report.auc)


def test_a_process_keeps_the_recent_scores_of_its_most_recently_routed_tenants_only():
    """Each (route, tenant) window is kept while it is among the `max_windows` most recently used:
    tenants deleted or made anew (a new incarnation) once kept theirs for the process's life."""
    from types import SimpleNamespace

    from routing.decide import MIN_RECENT, LearnedRouting

    route = SimpleNamespace(name="auto", router=SimpleNamespace(settings=SimpleNamespace(threshold=0.5)),
                            target_strong_share=0.5, recalibrate_window=100)
    tenants = [SimpleNamespace(incarnation=f"t{i}", strong_share=None) for i in range(3)]
    routing = LearnedRouting(max_windows=2)
    scores = [0.01 * i for i in range(MIN_RECENT)]  # all below the router's threshold of 0.5
    for score in scores:
        first = routing.decide(route, tenants[0], score)
    assert first.threshold == threshold_for_share(scores, 0.5)  # recalibrated on its window
    routing.decide(route, tenants[1], 0.3)
    assert routing.decide(route, tenants[0], 0.3).threshold != 0.5  # used last: kept
    routing.decide(route, tenants[2], 0.3)  # a third window: the least recently used goes
    assert routing.decide(route, tenants[0], 0.3).threshold != 0.5
    routing.decide(route, tenants[1], 0.3)
    routing.decide(route, tenants[2], 0.3)
    assert routing.decide(route, tenants[0], 0.3).threshold == 0.5  # dropped: starts anew
