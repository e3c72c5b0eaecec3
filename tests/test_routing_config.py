"""Confidence measures, route declarations and prices: the pure parts of routing."""

import math

import pytest

from routing.confidence import confidence
from routing.pricing import Price
from routing.routes import CascadeRoute, parse_routes

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
])
def test_bad_routes_are_refused_with_their_reason(table, words):
    with pytest.raises(ValueError, match=words):
        parse_routes({"r": table}, SERVED)


def test_a_route_cannot_shadow_a_model():
    with pytest.raises(ValueError, match="name of a served model"):
        parse_routes({"small": {"tiers": ["small", "large"], "threshold": 0.5}}, SERVED)


def test_price_of_a_call():
    price = Price(input_usd_per_mtok=0.5, output_usd_per_mtok=2.0)
    assert price.cost(1000, 500) == pytest.approx((1000 * 0.5 + 500 * 2.0) / 1e6)
    with pytest.raises(ValueError):
        Price(-1.0, 0.0)
