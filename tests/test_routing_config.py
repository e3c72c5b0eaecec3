"""Confidence measures, route declarations and prices: the pure parts of routing."""

import math

import pytest

from routing.confidence import confidence
from routing.pricing import Price
from routing.learned import Example, train_router
from routing.routes import DEFAULT_RECALIBRATE_WINDOW, CascadeRoute, parse_routes

SERVED = ("small", "medium", "large")


def test_confidence_measures_on_known_values():
    logprobs = [math.log(p) for p in (0.9, 0.5, 0.99, 0.2, 0.95)]
    assert confidence(logprobs, "mean_logprob") == pytest.approx(sum(logprobs) / 5)
    assert confidence(logprobs, "min_prob") == pytest.approx(0.2)
    # sorted probabilities 0.2, 0.5, 0.9, 0.95, 0.99: the 10th percentile sits 0.4 of the way
    # from the first to the second, the 50th is the median.
    assert confidence(logprobs, "quantile", 0.1) == pytest.approx(0.2 + 0.4 * 0.3)
    assert confidence(logprobs, "quantile", 0.5) == pytest.approx(0.9)
    assert confidence([], "min_prob") == 1.0 and confidence([], "mean_logprob") == 0.0
    with pytest.raises(ValueError, match="unknown confidence measure"):
        confidence(logprobs, "vibes")


def test_one_unsure_token_sinks_min_prob_more_than_the_quantile_on_long_answers():
    sure = [math.log(0.99)] * 40
    one_doubt = sure[:-1] + [math.log(0.3)]
    assert confidence(one_doubt, "min_prob") == pytest.approx(0.3)
    assert confidence(one_doubt, "quantile", 0.1) == pytest.approx(0.99)


def test_routes_parse_with_a_threshold_per_step():
    routes = parse_routes({
        "auto": {"tiers": ["small", "large"], "threshold": 0.5, "measure": "min_prob"},
        "three": {"tiers": list(SERVED), "thresholds": [0.6, 0.4], "prefix_tokens": 4},
    }, SERVED)
    assert routes["auto"] == CascadeRoute("auto", ("small", "large"), (0.5,), "min_prob")
    three = routes["three"]
    assert (three.threshold(0), three.threshold(1), three.threshold(2)) == (0.6, 0.4, None)
    assert three.prefix_tokens == 4 and three.measure == "quantile"


@pytest.mark.parametrize("table, words", [
    ({"tiers": ["small"], "threshold": 0.5}, "at least two tiers"),
    ({"tiers": ["small", "huge"], "threshold": 0.5}, "not served: huge"),
    ({"tiers": ["small", "large"], "thresholds": [0.5, 0.4]}, "one threshold per escalation"),
    ({"tiers": ["small", "large"], "threshold": 0.5, "measure": "vibes"}, "unknown measure"),
    ({"tiers": ["small", "large"], "threshold": 0.5, "colour": 1}, "unknown keys"),
    ({"tiers": ["small", "small"], "threshold": 0.5}, "twice"),
    # Thresholds no score can clear (NaN among them) escalate, and bill, every call.
    ({"tiers": ["small", "large"], "threshold": math.nan}, r"quantile thresholds must be in \[0.0, 1.0\]"),
    ({"tiers": ["small", "large"], "threshold": 0.5, "measure": "mean_logprob"},
     r"mean_logprob thresholds must be in \[-inf, 0.0\], got 0.5"),
    ({"tiers": ["small", "large"], "thresholds": [0.5, 1.5]}, "one threshold per escalation"),
    ({"tiers": ["small", "medium", "large"], "thresholds": [0.5, 1.5]}, "got 1.5"),
    # Values of the wrong type name their key (they once raised TypeError, or were read letter
    # by letter: tiers = "small" named the models s, m, a, l, l).
    ({"tiers": "small", "threshold": 0.5}, r"\[routes.r\]: Expected `array`, got `str` - at `tiers`"),
    ({"tiers": [["small"], "large"], "threshold": 0.5}, "at `tiers\\[0\\]`"),
    ({"tiers": ["small", "large"], "threshold": "high"}, "got `str` - at `threshold`"),
    ({"tiers": ["small", "large"], "threshold": True}, "got `bool` - at `threshold`"),
    ({"tiers": ["small", "large"], "threshold": 0.5, "prefix_tokens": 0}, "at `prefix_tokens`"),
    ({"kind": "learned", "tiers": ["small", "large"], "router": 5}, "got `int` - at `router`"),
    ({"kind": "learned", "tiers": ["small", "large"], "router": "r", "recalibrate_window": "lots"},
     "got `str` - at `recalibrate_window`"),
    ({"kind": "learned", "tiers": ["small", "large"], "router": "r", "target_strong_share": "0.3"},
     "got `str` - at `target_strong_share`"),
])
def test_bad_routes_are_refused_with_their_reason(table, words):
    with pytest.raises(ValueError, match=words):
        parse_routes({"r": table}, SERVED)


def test_a_learned_route_recalibrates_by_default_and_refuses_a_share_it_could_never_reach(tmp_path):
    router, _ = train_router([Example(f"{word} {i}", word == "easy") for i in range(20)
                              for word in ("easy", "hard")], target_strong_share=0.5, epochs=5)
    router.save(tmp_path)
    table = {"kind": "learned", "tiers": ["small", "large"], "router": str(tmp_path),
             "target_strong_share": 0.3}
    assert parse_routes({"r": table}, SERVED)["r"].recalibrate_window == DEFAULT_RECALIBRATE_WINDOW
    with pytest.raises(ValueError, match="set recalibrate_window above 0"):
        parse_routes({"r": {**table, "recalibrate_window": 0}}, SERVED)
    assert parse_routes({"r": {**table, "target_strong_share": None, "recalibrate_window": 0}},
                        SERVED)["r"].recalibrate_window == 0
    # Each call ranks the tenant's window of scores: a window of millions took a second a call.
    with pytest.raises(ValueError, match=r"recalibrate_window must be in \[0, 10000\]"):
        parse_routes({"r": {**table, "recalibrate_window": 10_001}}, SERVED)


def test_a_learned_routes_router_folder_may_start_with_a_tilde(tmp_path, monkeypatch):
    # As every other path setting may; it was read literally, and the route refused.
    router, _ = train_router([Example(f"{word} {i}", word == "easy") for i in range(20)
                              for word in ("easy", "hard")], target_strong_share=0.5, epochs=2)
    (tmp_path / "routers" / "smart").mkdir(parents=True)
    router.save(tmp_path / "routers" / "smart")
    monkeypatch.setenv("HOME", str(tmp_path))
    table = {"kind": "learned", "tiers": ["small", "large"], "router": "~/routers/smart"}
    assert parse_routes({"r": table}, SERVED)["r"].router.settings == router.settings


@pytest.mark.parametrize("name", ["a:b", "my route", "", "-x", "r" * 65])
def test_a_route_name_follows_the_rule_of_names(name):
    # "a:b" was listed by /v1/models, yet every call to it was a 404: "a" read as a route,
    # "b" as an adapter.
    with pytest.raises(ValueError, match=f"invalid route name {name!r}: use 1-64 characters"):
        parse_routes({name: {"tiers": ["small", "large"], "threshold": 0.5}}, SERVED)
    assert list(parse_routes({"v1.2_b-c": {"tiers": ["small", "large"], "threshold": 0.5}},
                             SERVED)) == ["v1.2_b-c"]


def test_a_cascade_gives_threshold_or_thresholds_not_both():
    table = {"tiers": ["small", "large"], "threshold": 0.0, "thresholds": [1.0]}  # once: 1.0
    with pytest.raises(ValueError, match=r"\[routes.r\] gives both threshold and thresholds"):
        parse_routes({"r": table}, SERVED)


def test_a_route_cannot_shadow_a_model():
    with pytest.raises(ValueError, match="name of a served model"):
        parse_routes({"small": {"tiers": ["small", "large"], "threshold": 0.5}}, SERVED)


def test_price_of_a_call():
    price = Price(input_usd_per_mtok=0.5, output_usd_per_mtok=2.0)
    assert price.cost(1000, 500) == pytest.approx((1000 * 0.5 + 500 * 2.0) / 1e6)
    with pytest.raises(ValueError):
        Price(-1.0, 0.0)
