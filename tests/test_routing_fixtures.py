"""Routes over the trained arithmetic fixtures, through the real gateway and engines: the
decisions and answers are known exactly (tests/test_arithmetic_fixtures.py pins the models)."""

import json

import httpx
import pytest

from tests.conftest import serve_gateway
from tests.test_arithmetic_fixtures import CONFIDENT, EASY, HARD, MEDIUM_RIGHT_ON_HARD

FIXTURES = ("small", "medium", "large")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import torch

    from benchmarks.routing import FIXTURES as FOLDER
    from engine.config import EngineConfig
    from gateway.local_engine import LocalEngineClient
    from routing.learned import Example, train_router
    from routing.routes import parse_routes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engines = {name: LocalEngineClient.load(EngineConfig(model=str(FOLDER / name),
                                                         num_kv_blocks=64), show_progress=False)
               for name in FIXTURES}
    router, _ = train_router([Example(p.prompt, True) for p in EASY] +
                             [Example(p.prompt, False) for p in HARD], target_strong_share=0.5)
    router.save(router_dir := tmp_path_factory.mktemp("router"))
    routes = parse_routes({
        "auto": {"tiers": ["small", "large"], "measure": "min_prob", "threshold": CONFIDENT},
        "learned": {"kind": "learned", "tiers": ["small", "large"], "router": str(router_dir)},
        "three": {"tiers": list(FIXTURES), "measure": "min_prob",
                  "thresholds": [CONFIDENT, CONFIDENT]},
    }, engines)
    try:
        with serve_gateway(engines, tmp_path_factory.mktemp("fixtures-gw"), routes=routes,
                           default_route="auto") as gateway:
            yield gateway, gateway.new_tenant("arith")
    finally:
        for engine in engines.values():
            engine.close()
        torch.set_num_threads(threads)


def ask(server, prompt: str | list[int], model: str = "auto", stream: bool = False) -> httpx.Response:
    gateway, key = server
    return httpx.post(gateway.url + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": prompt, "max_tokens": 6,
                            "temperature": 0, "stream": stream})


def test_easy_sums_stay_on_the_small_model_and_hard_ones_escalate_to_a_right_answer(server):
    for problem in EASY:
        response = ask(server, problem.prompt)
        assert response.headers["x-switchboard-model"] == "small", problem
        assert response.json()["choices"][0]["text"].strip() == problem.answer
    for problem in HARD:
        response = ask(server, problem.prompt)
        assert response.headers["x-switchboard-escalated"] == "true", problem
        assert float(response.headers["x-switchboard-score"]) < CONFIDENT
        assert response.json()["choices"][0]["text"].strip() == problem.answer


def test_three_tiers_stop_at_the_medium_model_when_it_is_sure(server):
    kept_medium = []
    for problem in HARD:
        headers = ask(server, problem.prompt, model="three").headers
        scores = [float(s) for s in headers["x-switchboard-score"].split(",")]
        assert scores[0] < CONFIDENT  # the small model is unsure on every hard sum
        if headers["x-switchboard-model"] == "medium":
            assert len(scores) == 2 and scores[1] >= CONFIDENT
            kept_medium.append(problem)
        else:
            assert headers["x-switchboard-model"] == "large" and scores[1] < CONFIDENT
    # The medium model answers some hard sums (and is right on some of them), so the middle
    # tier does save large-model calls here.
    assert kept_medium and sum(MEDIUM_RIGHT_ON_HARD) >= 1


def test_a_streamed_hard_sum_is_escalated_before_any_byte(server):
    response = ask(server, HARD[0].prompt, stream=True)
    assert response.headers["x-switchboard-model"] == "large"
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    assert all(e["model"] == "large" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]).strip() == \
        HARD[0].answer


def test_a_learned_route_refuses_token_ids_outside_the_vocabulary_as_a_model_does(server):
    """The router reads the prompt before the engine checks its ids, so ids no tokenizer can
    decode must still get the model's own 400."""
    for ids in ([65, 66, -1], [65, 2**40], [70000]):
        for stream in (False, True):
            refused = ask(server, ids, model="learned", stream=stream)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "prompt"
            assert "outside the vocabulary" in refused.json()["error"]["message"]
    assert ask(server, EASY[0].prompt, model="learned").status_code == 200


def test_a_learned_route_reads_a_prompt_alike_as_a_string_a_list_or_token_ids(server):
    """Routers are trained on prompt text: a one-prompt list, or the prompt's ids (with the
    "<s>" the tokenizer adds), must be scored as the string is."""
    gateway, _ = server
    small = gateway.app.state.gateway.engines["small"]
    for problem in EASY[:3] + HARD[:3]:
        ids = small.tokenize(problem.prompt)
        assert ids[0] == small.tokenize("")[0]  # starts with a special token
        scores = {ask(server, form, model="learned").headers["x-switchboard-score"]
                  for form in (problem.prompt, [problem.prompt], ids)}
        assert len(scores) == 1, (problem.prompt, scores)
