"""Prometheus text rendering, and the gateway's /metrics after real traffic."""

import concurrent.futures
import re
from pathlib import Path

import httpx
import pytest

from gateway.prometheus import Counter, Gauge, Histogram, render
from tests.conftest import DEMO_MODEL, gateway_server
from tests.helpers import HeldEngine, IdleEngineParts
from tests.test_gateway_routing import eventually

README = Path(__file__).resolve().parent.parent / "README.md"


def test_counter_gauge_and_histogram_render_the_text_format():
    requests = Counter("x_requests_total", "Requests.", ("tenant",))
    requests.inc(tenant='a"b')
    requests.inc(2, tenant='a"b')
    gauge = Gauge("x_waiting", "Waiting.")
    gauge.set(4)
    read = Counter("x_reads_total", "Reads counted elsewhere.")
    read.set_total(7)
    latency = Histogram("x_seconds", "Latency.", (0.1, 1.0), ("model",))
    for value in (0.05, 0.1, 0.5, 3.0):
        latency.observe(value, model="m")
    assert render([requests, gauge, read, latency]).splitlines() == [
        "# HELP x_requests_total Requests.",
        "# TYPE x_requests_total counter",
        'x_requests_total{tenant="a\\"b"} 3',
        "# HELP x_waiting Waiting.",
        "# TYPE x_waiting gauge",
        "x_waiting 4",
        "# HELP x_reads_total Reads counted elsewhere.",
        "# TYPE x_reads_total counter",
        "x_reads_total 7",
        "# HELP x_seconds Latency.",
        "# TYPE x_seconds histogram",
        'x_seconds_bucket{model="m",le="0.1"} 2',
        'x_seconds_bucket{model="m",le="1"} 3',
        'x_seconds_bucket{model="m",le="+Inf"} 4',
        'x_seconds_sum{model="m"} 3.65',
        'x_seconds_count{model="m"} 4',
    ]


def test_labels_must_match_the_declared_names():
    with pytest.raises(ValueError, match="takes labels"):
        Counter("c_total", "C.", ("tenant",)).inc(model="m")


def test_the_engine_series_of_a_model_no_longer_served_go():
    """A model whose workers left past their TTL kept its last capacity, resident adapters and
    loads in /metrics for good, summed into every dashboard."""
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    engine = IdleEngineParts()
    both = metrics.render({"kept": engine, "gone": engine})
    assert 'switchboard_kv_cache_blocks_capacity{model="gone"} 1' in both.splitlines()
    metrics.count_tokens("acme", "gone", 3, 4)  # what was billed stays: it happened
    metrics.adapter_disk_loads.set_total(2, model="gone")
    one = metrics.render({"kept": engine})
    assert 'switchboard_kv_cache_blocks_capacity{model="kept"} 1' in one.splitlines()
    engine_names = ("switchboard_kv_cache", "switchboard_num_requests", "switchboard_adapter",
                    "switchboard_num_preemptions", "switchboard_prefix_cache")
    assert [line for line in one.splitlines()
            if line.startswith(engine_names) and 'model="gone"' in line] == []
    assert 'switchboard_generation_tokens_total{tenant="acme",model="gone"} 4' in one.splitlines()


def sample(text: str, name: str, **labels) -> float:
    """The value of one series in a /metrics body (labels given must all match)."""
    for line in text.splitlines():
        match = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == str(v) for k, v in labels.items()):
            return float(match.group(3))
    raise AssertionError(f"no sample {name} {labels} in /metrics")


def served_sample(server, name: str, **labels) -> float | None:
    """`sample` of the server's /metrics now; None while it has no such series yet."""
    try:
        return sample(server.admin("GET", "/metrics").text, name, **labels)
    except AssertionError:
        return None


def test_metrics_after_traffic(server):
    key = server.new_tenant("metered")
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
    for stream in (False, True):
        response = httpx.post(server.url + "/v1/completions", json={**body, "stream": stream},
                              headers=headers, timeout=30)
        assert response.status_code == 200
    assert httpx.post(server.url + "/v1/completions", json={**body, "model": "nope"},
                      headers=headers).status_code == 404

    # A stream is counted as answered once billed, after its client had it.
    assert eventually(lambda: served_sample(server, "switchboard_requests_total", tenant="metered",
                                            model=DEMO_MODEL, status=200) == 2)
    text = server.admin("GET", "/metrics").text
    assert sample(text, "switchboard_requests_total", tenant="metered", model=DEMO_MODEL,
                  status=200) == 2
    assert sample(text, "switchboard_requests_total", tenant="metered", model="-",
                  status=404) == 1
    assert sample(text, "switchboard_prompt_tokens_total", tenant="metered", model=DEMO_MODEL) == 6
    assert sample(text, "switchboard_generation_tokens_total", tenant="metered",
                  model=DEMO_MODEL) == 10
    assert sample(text, "switchboard_time_to_first_token_seconds_count", model=DEMO_MODEL) >= 2
    assert sample(text, "switchboard_time_per_output_token_seconds_count", model=DEMO_MODEL) >= 8
    assert sample(text, "switchboard_e2e_request_latency_seconds_count", model=DEMO_MODEL) >= 2
    assert sample(text, "switchboard_e2e_request_latency_seconds_bucket", model=DEMO_MODEL,
                  le="+Inf") >= 2
    engine = server.engine_metrics()
    assert sample(text, "switchboard_num_requests_waiting", model=DEMO_MODEL) == 0
    assert sample(text, "switchboard_num_requests_running", model=DEMO_MODEL) == 0
    assert sample(text, "switchboard_kv_cache_usage_ratio", model=DEMO_MODEL) == 0
    assert sample(text, "switchboard_kv_cache_blocks_capacity", model=DEMO_MODEL) == \
        engine.kv_blocks_total
    assert "# TYPE switchboard_time_to_first_token_seconds histogram" in text
    # The engine's running totals are counters, as rate() and increase() expect.
    for name, total in (("num_preemptions", engine.num_preemptions),
                        ("adapter_cache_hits", engine.adapter_hits),
                        ("adapter_cache_misses", engine.adapter_misses),
                        ("adapter_cache_evictions", engine.adapter_evictions),
                        ("adapter_disk_loads", engine.adapter_disk_loads),
                        ("prefix_cache_queried_tokens", engine.prefix_cache_queried_tokens),
                        ("prefix_cache_hit_tokens", engine.prefix_cache_hit_tokens)):
        assert f"# TYPE switchboard_{name}_total counter" in text
        assert sample(text, f"switchboard_{name}_total", model=DEMO_MODEL) == total
    assert "# TYPE switchboard_kv_cache_blocks_capacity gauge" in text
    types = re.findall(r"^# TYPE (\w+) (\w+)$", text, re.MULTILINE)
    assert [name for name, kind in types if name.endswith("_total") and kind != "counter"] == []


def test_a_call_a_tenant_s_policy_refuses_is_counted_under_the_model_it_names(server):
    """A served model or route (an adapter's base model), which the operator controls; a name
    that means nothing is "-"."""
    key = server.new_tenant("barred", allowed_models=[])
    response = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 1}, timeout=30)
    assert response.status_code == 403
    assert eventually(lambda: served_sample(server, "switchboard_requests_total", tenant="barred",
                                            model=DEMO_MODEL, status=403) == 1)


def test_a_call_of_a_tenant_deleted_meanwhile_is_not_counted_as_billed(demo_engine, tmp_path):
    """Its store bills no one (the tenant made anew under its name starts from nothing), but
    /metrics counted its tokens as billed, under the name of the tenant made anew."""
    engine = HeldEngine(demo_engine)
    body = {"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
    with gateway_server(engine, tmp_path) as server:
        key = server.new_tenant("renewed")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60,
                               headers={"Authorization": f"Bearer {key}"})
            assert engine.arrived.wait(30)
            try:
                assert server.admin("DELETE", "/admin/tenants/renewed").status_code == 200
                assert server.admin("POST", "/admin/tenants", json={"name": "renewed"}).status_code == 201
            finally:
                engine.resume.set()
            reply = call.result()
        new_key = server.admin("POST", "/admin/tenants/renewed/keys").json()["key"]
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                           headers={"Authorization": f"Bearer {new_key}"})

        def usage() -> tuple[int, int]:
            counts = server.admin("GET", "/admin/tenants/renewed").json()["usage"]
            return counts["tokens_in"], counts["tokens_out"]

        assert eventually(lambda: usage() != (0, 0))
        billed, text = usage(), server.admin("GET", "/metrics").text
    assert (reply.status_code, again.status_code) == (200, 200), reply.text
    assert billed == (3, 5)  # the second call's alone
    assert sample(text, "switchboard_prompt_tokens_total", tenant="renewed", model=DEMO_MODEL) == 3
    assert sample(text, "switchboard_generation_tokens_total", tenant="renewed", model=DEMO_MODEL) == 5


def test_latency_is_observed_once_per_call_however_many_choices(server):
    """A call with n = 3 is one request to the client: one time to first token, one end to end;
    each choice's gaps between tokens are observed."""
    key = server.new_tenant("three-choices")
    names = ("time_to_first_token", "time_per_output_token", "e2e_request_latency")

    def counts() -> dict[str, float]:
        text = server.admin("GET", "/metrics").text
        return {n: sample(text, f"switchboard_{n}_seconds_count", model=DEMO_MODEL) for n in names}

    httpx.post(server.url + "/v1/completions", json={"model": DEMO_MODEL, "prompt": "warm",
               "max_tokens": 1}, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    before = counts()
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 5, "n": 3,
                                "ignore_eos": True, "temperature": 1.0, "seed": 7},
                          headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 3
    after = counts()
    assert after["time_to_first_token"] - before["time_to_first_token"] == 1
    assert after["e2e_request_latency"] - before["e2e_request_latency"] == 1
    assert after["time_per_output_token"] - before["time_per_output_token"] >= 3


def test_metrics_need_the_metrics_key_or_the_admin_key(demo_engine, tmp_path):
    """The series name every tenant: no tenant, and no caller without a key, reads them."""
    with gateway_server(demo_engine, tmp_path, metrics_key="scrape-me") as server:
        tenant_key = server.new_tenant("curious")

        def scrape(key: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.get(server.url + "/metrics", headers=headers, timeout=30)

        for key in ("scrape-me", server.admin_key):
            answer = scrape(key)
            assert answer.status_code == 200 and "switchboard_requests_total" in answer.text
        for key, status in ((None, 401), ("wrong", 401), (tenant_key, 403)):
            answer = scrape(key)
            assert answer.status_code == status and "switchboard_" not in answer.text
            assert answer.json()["error"]["message"]


def test_the_metrics_key_is_refused_elsewhere_as_a_key_without_that_permission(demo_engine, tmp_path):
    """It is a valid key, so the admin API and /v1 answer 403 (as the admin key gets on /v1, a
    tenant key on /admin), not 401 as for an unknown key."""
    with gateway_server(demo_engine, tmp_path, metrics_key="scrape-me") as server:
        server.new_tenant("acme")
        scraper = {"Authorization": "Bearer scrape-me"}
        calls = [("GET", "/admin/tenants", None), ("POST", "/admin/tenants", {"name": "evil"}),
                 ("GET", "/admin/tenants/acme/adapters", None), ("GET", "/v1/models", None),
                 ("POST", "/v1/completions", {"model": DEMO_MODEL, "prompt": "hi"})]
        for method, path, body in calls:
            answer = httpx.request(method, server.url + path, json=body, headers=scraper, timeout=30)
            error = answer.json()["error"]
            assert (answer.status_code, error["type"]) == (403, "permission_error"), (path, error)
            assert "the metrics key" in error["message"]
        assert [t["name"] for t in server.admin("GET", "/admin/tenants").json()["data"]] == ["acme"]


def test_the_readme_lists_every_series_with_its_type_and_labels(server):
    key = server.new_tenant("listed")
    answer = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "model": DEMO_MODEL, "prompt": "hi", "max_tokens": 2}, headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200
    text = server.admin("GET", "/metrics").text
    rendered = dict(re.findall(r"^# TYPE (\w+) (\w+)$", text, re.MULTILINE))
    rows = re.findall(r"^\| `(switchboard_\w+)` \| (\w+) \| ([\w, ]*) \|", README.read_text(),
                      re.MULTILINE)
    assert {name: kind for name, kind, _ in rows} == rendered  # no series left out, none gone
    labels = {name: set(listed.replace(",", " ").split()) for name, _, listed in rows}
    for line in text.splitlines():
        if not line.startswith("#"):
            name, found = re.fullmatch(r"(\w+)(?:\{(.*)\})? \S+", line).groups()
            series = name if name in rendered else re.sub(r"_(bucket|sum|count)$", "", name)
            assert set(re.findall(r'(\w+)="', found or "")) - {"le"} == labels[series], line
