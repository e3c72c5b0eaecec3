"""Auth, the admin API, rate limits and budgets, against both store backends."""

import asyncio
import concurrent.futures
import contextlib
import itertools
import sqlite3
import threading
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import pytest

from engine.demo import demo_config
from store import RedisStore, open_store
from tests.conftest import ADMIN_KEY, DEMO_MODEL, gateway_server, run_server
from tests.redis_server import redis_server  # noqa: F401

_names = itertools.count()


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def server(request, demo_engine, tmp_path_factory):
    """A gateway per store backend (the Redis one on a throwaway redis-server)."""
    store_url = request.getfixturevalue("redis_server") if request.param == "redis" else None
    with gateway_server(demo_engine, tmp_path_factory.mktemp("admin"), store_url) as running:
        yield running


@pytest.fixture
def tenant(server):
    """A fresh tenant name and key (names are unique: the Redis store outlives one test)."""
    name = f"t{next(_names)}"
    return name, server.new_tenant(name)


def get(server, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.get(server.url + path, headers=headers)


def complete(server, key: str, **body) -> httpx.Response:
    body = {"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 1, **body}
    return httpx.post(server.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_v1_needs_a_valid_key(server, tenant):
    _, key = tenant
    assert get(server, "/v1/models", key).status_code == 200
    for bad in (None, "sb-wrong", "not-even-prefixed"):
        response = get(server, "/v1/models", bad)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    admin = get(server, "/v1/models", ADMIN_KEY)
    assert admin.status_code == 403 and "admin key" in admin.json()["error"]["message"]


def test_admin_endpoints_need_the_admin_key(server, tenant):
    _, key = tenant
    assert get(server, "/admin/tenants", None).status_code == 401
    assert get(server, "/admin/tenants", "sb-wrong").status_code == 401
    forbidden = get(server, "/admin/tenants", key)
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["type"] == "permission_error"
    assert get(server, "/admin/tenants", ADMIN_KEY).status_code == 200


def test_tenant_lifecycle(server):
    name = f"t{next(_names)}"
    created = server.admin("POST", "/admin/tenants",
                           json={"name": name, "rpm": 10, "tpm": 1000})
    assert created.status_code == 201
    assert (created.json()["name"], created.json()["rpm"], created.json()["tpm"]) == (name, 10, 1000)
    assert server.admin("POST", "/admin/tenants", json={"name": name}).status_code == 409
    listed = server.admin("GET", "/admin/tenants").json()["data"]
    assert name in [t["name"] for t in listed]
    detail = server.admin("GET", f"/admin/tenants/{name}").json()
    assert detail["tenant"]["rpm"] == 10 and detail["keys"] == []
    assert detail["usage"]["requests"] == 0
    assert server.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
    missing = server.admin("GET", f"/admin/tenants/{name}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "tenant_not_found"
    assert server.admin("DELETE", f"/admin/tenants/{name}").status_code == 404


def test_a_long_name_of_a_missing_tenant_or_key_is_cut_in_the_404(server):
    """Cut after 100 characters, as in every other 404 (the store's error once came back whole)."""
    name = "t" * 5000
    cut = f"'{'t' * 100}'... (5000 characters)"
    calls = [("GET", f"/admin/tenants/{name}", None), ("PATCH", f"/admin/tenants/{name}", {"rpm": 1}),
             ("DELETE", f"/admin/tenants/{name}", None), ("POST", f"/admin/tenants/{name}/keys", None),
             ("GET", f"/admin/tenants/{name}/adapters", None), ("DELETE", f"/admin/keys/{name}", None)]
    answers = [server.admin(method, path, json=body) for method, path, body in calls]
    assert [(answer.status_code, answer.json()["error"]["code"], answer.json()["error"]["message"])
            for answer in answers] == [(404, "tenant_not_found", f"tenant {cut} does not exist")] * 5 + [
        (404, "key_not_found", f"API key {cut} does not exist")]


@pytest.mark.parametrize("body, param", [
    ({"name": "bad/name"}, "name"),
    ({"name": "ok", "rpm": 0}, "rpm"),
    ({"name": "ok", "rpm": -1}, "rpm"),
    ({"name": "ok", "tpm": 10**400}, "tpm"),  # once accepted, then a 500 for each of its calls
    ({"name": "ok", "monthly_token_budget": 2**53 + 1}, "monthly_token_budget"),
    ({"name": "ok", "monthly_spend_budget_usd": 0}, "monthly_spend_budget_usd"),
    # Within the rounding tolerance of $0, it refused every call, free ones too.
    ({"name": "ok", "monthly_spend_budget_usd": 1e-9}, "monthly_spend_budget_usd"),
    ({"name": "ok", "strong_share": 2}, "strong_share"),
    ({"name": "ok", "max_adapter_bytes": 0}, "max_adapter_bytes"),
    ({"name": "ok", "max_adapter_bytes": 1.5}, "max_adapter_bytes"),
    ({"rpm": 3}, "name"),
    ({"name": "ok", "rpm": "many"}, "rpm"),
    # Misspelt limits once made an unlimited tenant (201).
    ({"name": "ok", "monthly_spend_budget": 100}, "monthly_spend_budget"),
    ({"name": "ok", "rpm ": 10}, "rpm "),
    # A misspelt model name would lock the tenant out of the model it meant.
    ({"name": "ok", "allowed_models": [DEMO_MODEL, "demo-lama"]}, "allowed_models"),
])
def test_invalid_tenants_are_bad_requests(server, body, param):
    response = server.admin("POST", "/admin/tenants", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert server.admin("GET", "/admin/tenants/ok").status_code == 404  # nothing was created


def test_a_tenant_s_usage_of_a_closed_month_is_read_with_month(server, tenant, request):
    name, _ = tenant
    store = server.app.state.gateway.store
    store_url = (request.getfixturevalue("redis_server") if isinstance(store, RedisStore)
                 else f"sqlite://{store.path}")
    asyncio.run(_bill_one_call(store_url, name, datetime(2025, 3, 15, tzinfo=UTC).timestamp()))
    this_month = server.admin("GET", f"/admin/tenants/{name}").json()["usage"]
    assert this_month["requests"] == 0 and this_month["month"] != "2025-03"
    march = server.admin("GET", f"/admin/tenants/{name}", params={"month": "2025-03"}).json()
    usage = march["usage"]
    assert (usage["month"], usage["requests"], usage["tokens_in"], usage["tokens_out"]) == (
        "2025-03", 1, 3, 4)
    for bad in ("2025-13", "2025-3", "March", "2025-03-01", "２０２５-03", ""):
        refused = server.admin("GET", f"/admin/tenants/{name}", params={"month": bad})
        assert refused.status_code == 400, bad
        assert refused.json()["error"]["param"] == "month"


async def _bill_one_call(store_url: str, tenant: str, now: float) -> None:
    """Settle one call of `tenant` at `now` through a store client of its own (another gateway)."""
    store = await open_store(store_url, Path("."))
    try:
        held = await store.reserve_tokens(await store.get_tenant(tenant), 7, now=now)
        await store.settle(held, tokens_in=3, tokens_out=4, spend_usd=0.0)
    finally:
        await store.close()


def test_key_is_shown_once_authenticates_and_is_revoked(server, tenant):
    name, _ = tenant
    created = server.admin("POST", f"/admin/tenants/{name}/keys")
    assert created.status_code == 201
    body = created.json()
    assert set(body) == {"id", "key", "tenant", "prefix", "created_at"}
    assert body["key"].startswith(body["prefix"])
    assert get(server, "/v1/models", body["key"]).status_code == 200
    listed = server.admin("GET", f"/admin/tenants/{name}").json()["keys"]
    assert body["id"] in [k["id"] for k in listed]
    assert body["key"] not in created.text.replace(body["key"], "", 1)  # shown exactly once
    assert body["key"] not in str(listed)
    revoked = server.admin("DELETE", f"/admin/keys/{body['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    assert get(server, "/v1/models", body["key"]).status_code == 401
    assert server.admin("DELETE", "/admin/keys/key_nope").status_code == 404
    assert server.admin("POST", "/admin/tenants/nobody/keys").status_code == 404


def test_a_tenant_s_limits_change_in_place_and_its_keys_see_them_at_once(server):
    name = f"t{next(_names)}"
    key = server.new_tenant(name, rpm=1, tpm=1000)
    assert complete(server, key).status_code == 200
    assert complete(server, key).status_code == 429
    patched = server.admin("PATCH", f"/admin/tenants/{name}", json={"rpm": None, "tpm": 500})
    assert patched.status_code == 200, patched.text
    assert (patched.json()["rpm"], patched.json()["tpm"]) == (None, 500)
    assert complete(server, key).status_code == 200  # the same key, now unlimited in rpm
    # A set: each model kept once, in the order sent (they were stored as sent).
    twice = server.admin("PATCH", f"/admin/tenants/{name}", json={"allowed_models": [DEMO_MODEL] * 2})
    assert twice.status_code == 200 and twice.json()["allowed_models"] == [DEMO_MODEL]
    created = server.admin("POST", "/admin/tenants", json={"name": f"t{next(_names)}",
                                                           "allowed_models": [DEMO_MODEL] * 2})
    assert created.status_code == 201 and created.json()["allowed_models"] == [DEMO_MODEL]
    patched = server.admin("PATCH", f"/admin/tenants/{name}", json={"allowed_models": []})
    assert patched.json()["allowed_models"] == [] and patched.json()["tpm"] == 500
    assert complete(server, key).status_code == 403
    detail = server.admin("GET", f"/admin/tenants/{name}").json()
    assert detail["tenant"] == patched.json() and detail["usage"]["requests"] == 2
    assert len(detail["keys"]) == 1 and not detail["keys"][0]["revoked"]


def test_max_adapter_bytes_is_set_at_creation_changed_by_patch_and_shown(server):
    name = f"t{next(_names)}"
    created = server.admin("POST", "/admin/tenants", json={"name": name, "max_adapter_bytes": 10**9})
    assert created.status_code == 201 and created.json()["max_adapter_bytes"] == 10**9
    patched = server.admin("PATCH", f"/admin/tenants/{name}", json={"max_adapter_bytes": 2**53})
    assert patched.status_code == 200 and patched.json()["max_adapter_bytes"] == 2**53
    detail = server.admin("GET", f"/admin/tenants/{name}").json()
    assert (detail["tenant"]["max_adapter_bytes"], detail["adapter_bytes"]) == (2**53, 0)
    unlimited = server.admin("PATCH", f"/admin/tenants/{name}", json={"max_adapter_bytes": None})
    assert unlimited.json()["max_adapter_bytes"] is None
    listed = {t["name"]: t for t in server.admin("GET", "/admin/tenants").json()["data"]}
    assert listed[name]["max_adapter_bytes"] is None


@pytest.mark.parametrize("body, param", [
    ({}, None),
    ({"rpm": 0}, "rpm"),
    ({"strong_share": 1.5}, "strong_share"),
    ({"max_adapter_bytes": -1}, "max_adapter_bytes"),
    ({"max_adapter_bytes": "1GB"}, "max_adapter_bytes"),
    ({"name": "renamed"}, "name"),  # the name is the tenant's id
    ({"rmp": 5}, "rmp"),
    ({"allowed_models": ["demo-lama"]}, "allowed_models"),
    ({"default_route": "nope"}, "default_route"),
])
def test_invalid_tenant_updates_are_bad_requests_and_change_nothing(server, tenant, body, param):
    name, key = tenant
    before = server.admin("GET", f"/admin/tenants/{name}").json()["tenant"]
    response = server.admin("PATCH", f"/admin/tenants/{name}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert server.admin("GET", f"/admin/tenants/{name}").json()["tenant"] == before
    forbidden = httpx.patch(server.url + f"/admin/tenants/{name}", json={"rpm": 1},
                            headers={"Authorization": f"Bearer {key}"})
    assert forbidden.status_code == 403
    missing = server.admin("PATCH", "/admin/tenants/nobody", json={"rpm": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "tenant_not_found"


def test_deleting_a_tenant_invalidates_its_keys(server, tenant):
    name, key = tenant
    assert server.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
    assert get(server, "/v1/models", key).status_code == 401


def test_rpm_limit_allows_exactly_that_many_then_429_with_retry_after(server):
    key = server.new_tenant(f"t{next(_names)}", rpm=3)
    statuses = [complete(server, key).status_code for _ in range(3)]
    assert statuses == [200, 200, 200]
    limited = complete(server, key)
    assert limited.status_code == 429
    assert 1 <= int(limited.headers["retry-after"]) <= 20  # one request refills in 60 / 3 s
    error = limited.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=DEMO_MODEL, prompt="hi", max_tokens=1)


def test_tpm_holds_prompt_plus_max_tokens_and_gives_back_what_was_not_used(server):
    key = server.new_tenant(f"t{next(_names)}", tpm=40)
    too_large = complete(server, key, max_tokens=50)
    assert too_large.status_code == 400 and too_large.json()["error"]["code"] == "request_too_large"
    # "hi" is 3 prompt tokens (BOS + 2 bytes). Each call pays 3 + 25 up front, more than the 40
    # leave twice; an EOS forced first ends it after 1 token, and it gives back the other 24.
    eos = {str(demo_config().eos_token_id): 100}
    for _ in range(3):
        ended = complete(server, key, max_tokens=25, logit_bias=eos)
        assert ended.status_code == 200 and ended.json()["usage"]["total_tokens"] == 4, ended.text
    # 3 + 17 = 20 tokens used in full, twice, with the 12 used above: no room left.
    assert complete(server, key, max_tokens=17, ignore_eos=True).status_code == 200
    limited = complete(server, key, max_tokens=17, ignore_eos=True)
    assert limited.status_code == 429 and "tpm" in limited.json()["error"]["message"]


def test_a_call_refused_after_admission_costs_nothing(server):
    """Refused for the monthly budget, or by the engine (a token id outside the vocabulary): no
    rpm or tpm used, nothing billed, no request counted."""
    name = f"t{next(_names)}"
    key = server.new_tenant(name, rpm=2, tpm=400, monthly_token_budget=200)
    assert complete(server, key, max_tokens=5, ignore_eos=True).status_code == 200  # 8 of 200
    over_budget = complete(server, key, max_tokens=195)  # 198 tokens: more than the 192 left
    assert over_budget.status_code == 429
    assert over_budget.json()["error"]["code"] == "insufficient_quota"
    assert "192 of 200 tokens left (8 used, 0 held by calls in flight)" in \
        over_budget.json()["error"]["message"]
    for _ in range(3):  # 3 + 150 tokens each: all three would not fit in 400 a minute
        refused = complete(server, key, max_tokens=150, logit_bias={"99999": 1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias"
    assert complete(server, key, max_tokens=5, ignore_eos=True).status_code == 200
    usage = server.admin("GET", f"/admin/tenants/{name}").json()["usage"]
    assert (usage["requests"], usage["tokens_in"] + usage["tokens_out"]) == (2, 16)
    assert complete(server, key, max_tokens=5).status_code == 429  # rpm: 2 a minute


def test_a_call_larger_than_the_whole_monthly_budget_is_a_bad_request(server):
    key = server.new_tenant(f"t{next(_names)}", monthly_token_budget=100)
    too_large = complete(server, key, max_tokens=200)
    error = too_large.json()["error"]
    assert too_large.status_code == 400 and (error["code"], error["param"]) == \
        ("request_too_large", "max_tokens")
    assert "monthly budget is 100 tokens" in error["message"]
    assert complete(server, key, max_tokens=90).status_code == 200


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_chat_too_large_for_the_limits_names_the_field_it_set_its_length_with(server, field):
    key = server.new_tenant(f"t{next(_names)}", tpm=60, monthly_token_budget=1000)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as too_large:
        client.chat.completions.create(model=DEMO_MODEL, messages=messages, **{field: 100})
    budgeted = client.with_options(api_key=server.new_tenant(f"t{next(_names)}",
                                                             monthly_token_budget=100))
    budgeted.chat.completions.create(model=DEMO_MODEL, messages=messages, max_tokens=50,
                                     extra_body={"ignore_eos": True})
    with pytest.raises(openai.RateLimitError) as over_budget:
        budgeted.chat.completions.create(model=DEMO_MODEL, messages=messages, **{field: 50})
    client.close()
    assert (too_large.value.code, too_large.value.param) == ("request_too_large", field)
    assert f"(prompt plus {field} for every choice)" in too_large.value.message
    # n named only where lowering it helps: these calls had one choice.
    assert f"lower {field} or shorten the prompt" in too_large.value.message
    assert f"lower {field} or shorten the prompt" in over_budget.value.message


def test_a_refusal_names_n_and_the_number_of_prompts_only_where_lowering_them_helps(server):
    key = server.new_tenant(f"t{next(_names)}", tpm=60)
    several = complete(server, key, max_tokens=20, n=2, prompt=["a b", "c d"])
    assert several.status_code == 400, several.text
    assert "lower max_tokens or n, or send fewer or shorter prompts" in several.json()["error"]["message"]
    one = complete(server, key, max_tokens=100)
    assert one.status_code == 400, one.text
    assert one.json()["error"]["message"].endswith("lower max_tokens or shorten the prompt")


def test_a_chat_without_max_tokens_is_shortened_to_fit_the_tpm_limit(server):
    # Left out, max_tokens is the rest of the context (thousands of tokens): rather than refuse
    # that for a tenant allowed 60 tokens a minute, the answers get what the limit leaves them.
    key = server.new_tenant(f"t{next(_names)}", tpm=60)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=DEMO_MODEL, messages=messages, n=2,
                                          extra_body={"ignore_eos": True})
    prompt_tokens = chat.usage.prompt_tokens
    assert [c.finish_reason for c in chat.choices] == ["length", "length"]
    assert chat.usage.completion_tokens == 2 * ((60 - prompt_tokens) // 2)
    with pytest.raises(openai.BadRequestError, match="request_too_large|lower max_tokens"):
        client.chat.completions.create(model=DEMO_MODEL, messages=messages, max_tokens=100)
    client.close()


def test_a_chat_without_max_tokens_too_large_for_the_limits_says_what_it_may_lower(server):
    """Its answers cut to the least they can be, the refusal names what sets that least, not a
    max_tokens the call never sent: min_tokens (the engine refused it as more than max_tokens),
    else nothing but n and the prompt."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.new_tenant(
        f"t{next(_names)}", tpm=60), max_retries=0)
    with pytest.raises(openai.BadRequestError) as min_tokens:
        client.chat.completions.create(model=DEMO_MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"min_tokens": 100})
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.chat.completions.create(model=DEMO_MODEL,
                                       messages=[{"role": "user", "content": "hi " * 100}])
    client.close()
    assert (min_tokens.value.code, min_tokens.value.param) == ("request_too_large", "min_tokens")
    assert "(prompt plus min_tokens for every choice)" in min_tokens.value.message
    assert "limit is 60 tokens per minute; lower min_tokens or shorten the prompt" in \
        min_tokens.value.message
    assert (long_prompt.value.code, long_prompt.value.param) == ("request_too_large", None)
    assert "(prompt plus one output token for every choice, the least it can use)" in \
        long_prompt.value.message
    assert "max_tokens" not in long_prompt.value.message


def test_a_chat_without_max_tokens_is_shortened_to_what_the_monthly_budget_leaves(server):
    name = f"t{next(_names)}"
    key = server.new_tenant(name, monthly_token_budget=50)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=DEMO_MODEL, messages=messages,
                                           extra_body={"ignore_eos": True})
    assert first.choices[0].finish_reason == "length"
    assert first.usage.total_tokens == 50  # the whole budget, not a 429 for the rest of the context
    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=messages)
    assert raised.value.body["code"] == "insufficient_quota"
    assert "USD (prompt plus one output token for every choice, the least it can use): " \
        "shorten the prompt, or ask your administrator" in raised.value.message  # it set no max_tokens
    usage = server.admin("GET", f"/admin/tenants/{name}").json()["usage"]
    assert (usage["tokens_in"] + usage["tokens_out"], usage["reserved_tokens"]) == (50, 0)
    client.close()


def test_a_fitted_chat_that_a_call_in_flight_leaves_no_room_says_what_it_held(server, monkeypatch):
    """Fitted to the 50 tokens its budget had left as it was read, it then found them held by a
    call admitted meanwhile: the refusal once said it held "one output token, the least it can
    use", and advised against nothing but n and the prompt."""
    import gateway.serving

    name = f"t{next(_names)}"
    key = server.new_tenant(name, monthly_token_budget=50)
    real_admit = gateway.serving.admit

    async def admit_after_another(store, tenant, *args, **kwargs):
        in_flight = await real_admit(store, tenant, 50)  # a call admitted first
        try:
            return await real_admit(store, tenant, *args, **kwargs)
        finally:
            await in_flight.withdraw(refund_requests=True)

    monkeypatch.setattr(gateway.serving, "admit", admit_after_another)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as raised:
        client.chat.completions.create(model=DEMO_MODEL, messages=[{"role": "user", "content": "hi"}])
    client.close()
    assert raised.value.body["code"] == "insufficient_quota"
    assert " output tokens (the room your limits had as the call was read) for every choice)" in \
        raised.value.message and "the least" not in raised.value.message
    assert "lower max_tokens or shorten the prompt" in raised.value.message
    usage = server.admin("GET", f"/admin/tenants/{name}").json()["usage"]
    assert (usage["requests"], usage["reserved_tokens"]) == (0, 0)


def test_monthly_budget_is_settled_with_real_counts(server):
    name = f"t{next(_names)}"
    key = server.new_tenant(name, monthly_token_budget=30)
    # Reserves 3 + 10 = 13; settles 3 + 4 (EOS cannot end it early: ignore_eos, min 4 tokens).
    first = complete(server, key, max_tokens=4, ignore_eos=True)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] == 7
    streamed = complete(server, key, max_tokens=6, ignore_eos=True, stream=True)
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    usage = server.admin("GET", f"/admin/tenants/{name}").json()["usage"]
    assert (usage["requests"], usage["tokens_in"], usage["tokens_out"]) == (2, 6, 10)
    assert usage["reserved_tokens"] == 0
    over = complete(server, key, max_tokens=20)  # 16 used + 3 + 20 > 30
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "insufficient_quota"
    assert over.headers["x-should-retry"] == "false"


def test_allowed_models_limit_what_a_tenant_sees(server):
    key = server.new_tenant(f"t{next(_names)}", allowed_models=[])
    assert get(server, "/v1/models", key).json()["data"] == []
    response = complete(server, key)  # served, but not for this tenant
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "model_not_allowed"
    assert response.json()["error"]["type"] == "permission_error"
    unknown = complete(server, key, model="no-such-model")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_first_start_creates_an_admin_key_once(demo_engine, tmp_path):
    from gateway.app import create_app

    announced = []
    for _ in range(2):
        app = create_app({DEMO_MODEL: demo_engine}, data_dir=tmp_path,
                         announce_admin_key=announced.append)
        with run_server(app) as url:
            assert len(announced) == 1
            headers = {"Authorization": f"Bearer {announced[0]}"}
            assert httpx.get(url + "/admin/tenants", headers=headers).status_code == 200
    app = create_app({DEMO_MODEL: demo_engine}, data_dir=tmp_path, admin_key="sb-admin-new",
                     announce_admin_key=announced.append)
    with run_server(app) as url:
        old = httpx.get(url + "/admin/tenants", headers={"Authorization": f"Bearer {announced[0]}"})
        new = httpx.get(url + "/admin/tenants", headers={"Authorization": "Bearer sb-admin-new"})
        assert (old.status_code, new.status_code, len(announced)) == (401, 200, 1)


@pytest.mark.parametrize("change", ["key revoked", "tenant made anew", "model disallowed"])
def test_a_call_whose_key_or_tenant_changed_while_its_body_arrived_gets_what_it_gets_now(
        server, change):
    """The key is checked again once a call's body is in: a client sending it slowly (or holding
    connections open) once outlived a revocation, and a deleted tenant's call paid into the rate
    bucket of the tenant made anew under its name."""
    name = f"t{next(_names)}"
    key = server.new_tenant(name)
    request = httpx.Request("POST", server.url + "/v1/completions",
                            headers={"Authorization": f"Bearer {key}"},
                            json={"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 1})
    body, half_sent, changed = request.read(), threading.Event(), threading.Event()

    def slowly():
        yield body[:5]
        half_sent.set()
        changed.wait(30)
        yield body[5:]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, request.url, content=slowly(), headers=request.headers,
                           timeout=60)
        assert half_sent.wait(30)
        try:
            if change == "key revoked":
                [listed] = server.admin("GET", f"/admin/tenants/{name}").json()["keys"]
                assert server.admin("DELETE", f"/admin/keys/{listed['id']}").status_code == 200
            elif change == "tenant made anew":
                assert server.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
                assert server.admin("POST", "/admin/tenants",
                                    json={"name": name, "rpm": 1}).status_code == 201
            else:
                assert server.admin("PATCH", f"/admin/tenants/{name}",
                                    json={"allowed_models": []}).status_code == 200
        finally:
            changed.set()
        reply = sent.result()
    assert reply.status_code == (403 if change == "model disallowed" else 401), reply.text
    usage = server.admin("GET", f"/admin/tenants/{name}").json()["usage"]
    assert usage["requests"] == 0
    if change == "tenant made anew":  # its one request a minute is still there
        new_key = server.admin("POST", f"/admin/tenants/{name}/keys").json()["key"]
        assert complete(server, new_key).status_code == 200


@pytest.mark.parametrize("metrics_key", [None, "sb-metrics-key"])
def test_a_store_that_lost_the_admin_key_says_so_until_a_gateway_sets_it_again(
        demo_engine, tmp_path, caplog, metrics_key):
    """As a Redis restarted without its data loses it: the right admin key was refused as
    "invalid admin key", and nothing was logged (on /metrics, while a metrics key was set)."""
    with gateway_server(demo_engine, tmp_path, metrics_key=metrics_key) as server:
        with contextlib.closing(sqlite3.connect(tmp_path / "switchboard.db")) as db, db:
            db.execute("DELETE FROM settings WHERE name = 'admin_key_hash'")
        if metrics_key is not None:
            assert get(server, "/metrics", metrics_key).status_code == 200
        for path in ("/admin/tenants", "/metrics"):
            refused = get(server, path, ADMIN_KEY)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"] == {
                "message": "the store holds no admin key: it has lost its data (as a Redis "
                           "restarted without its data does); restart a gateway with --admin-key "
                           "(or SWITCHBOARD_ADMIN_KEY) to set it again",
                "type": "server_error", "param": None, "code": "admin_key_missing"}
            assert refused.headers["x-should-retry"] == "false"
        assert "the store holds no admin key" in caplog.text
    with gateway_server(demo_engine, tmp_path) as server:  # started with the admin key
        assert get(server, "/admin/tenants", ADMIN_KEY).status_code == 200
        assert get(server, "/admin/tenants", "sb-wrong").status_code == 401
