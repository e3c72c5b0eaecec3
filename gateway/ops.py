"""Model listing and lookup, health and Prometheus metrics."""

from __future__ import annotations

import logging

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import authenticate_tenant, require_metrics_reader
from gateway.engine_client import EngineUnavailable
from gateway.errors import model_not_found, store_unavailable
from gateway.prometheus import CONTENT_TYPE
from gateway.protocol import ModelCard, ModelList
from gateway.state import gateway_state
from routing.models import (adapter_route, allowed_routes, default_route, reachable_base_models,
                            tenant_adapter_id, visible_adapters)
from routing.routes import AUTO
from store import FULL_ERRORS, UNAVAILABLE_ERRORS, unavailable_cause

logger = logging.getLogger(__name__)


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: str  # "ok" or "unavailable"
    models: list[str]
    unavailable_models: list[str] = []  # served, but no engine can take their requests now
    error: str | None = None  # why it is unavailable


async def list_models(request: Request) -> Response:
    """The models the caller's tenant may use: base models, routes, then its own adapters."""
    cards = await _model_cards(request)
    return Response(msgspec.json.encode(ModelList(data=cards)), media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    """One model of those the caller's tenant may use; 404 for any other (another tenant's
    adapter included: its name is not even confirmed)."""
    model = request.path_params["model"]
    card = next((c for c in await _model_cards(request) if c.id == model), None)
    if card is None:
        raise model_not_found(model)
    return Response(msgspec.json.encode(card), media_type="application/json")


async def _model_cards(request: Request) -> list[ModelCard]:
    state = gateway_state(request)
    store = state.require_store()
    tenant = await authenticate_tenant(request, store, state.metrics_key_hash)
    catalog = state.catalog
    # NOTE: as served now: with engine workers, models come and go while the adapters are read.
    engines = dict(state.engines)
    cards = [ModelCard(id=name, created=state.started_at,
                       max_model_len=engines[name].max_model_len)
             for name in reachable_base_models(tenant, catalog)]
    route_lengths: dict[str, int | None] = {}
    for name in allowed_routes(tenant, catalog):
        route = state.routes[default_route(tenant, catalog) if name == AUTO else name]
        # NOTE: with engine workers, a route's models are served once their workers register.
        # A route runs a call on a tier that can hold it: it takes what its roomiest tier served
        # now does (none while none is).
        lengths = [engines[m].max_model_len for m in route.tiers if m in engines]
        route_lengths[name] = max(lengths) if lengths else None
        cards.append(ModelCard(id=name, created=state.started_at, max_model_len=route_lengths[name]))
    # An adapter whose name a route or served model took since its upload is listed as the id
    # that still reaches it, so that ids stay unique; one whose base model the tenant reaches only
    # through a route, as `route:name`. NOTE: one of a rank its model is not served with here
    # (since a restart) is left out: its calls get a 503 until the operator restarts the server
    # with a higher limit.
    # `route:name` takes the route's length: a call its adapter's model cannot hold is answered
    # by the route's other tiers (it was listed with the adapter's model's, half the route's).
    max_ranks = {name: engine.max_adapter_rank for name, engine in engines.items()}
    for adapter in await visible_adapters(store, tenant, catalog, max_ranks):
        route = adapter_route(tenant, catalog, adapter)
        length = engines[adapter.base_model].max_model_len if route is None else route_lengths[route]
        cards.append(ModelCard(id=tenant_adapter_id(tenant, catalog, adapter),
                               created=int(adapter.created_at), owned_by=tenant.name,
                               parent=adapter.base_model, max_model_len=length))
    return cards


async def health(request: Request) -> Response:
    """200 while the gateway serves its models, 503 while its store cannot take writes or no model
    has an engine that can take requests (no key needed).

    Every /v1 and /admin call needs the store, and completions write to it (rate limits, budget
    holds), so while it cannot take writes (Redis is unreachable or full, another process holds
    the SQLite file's write lock: `error` says which) the gateway is not ready: a load balancer
    should send nothing to it. Nor while every engine worker is gone: each call would get a 503.
    Use this as a readiness check, not a liveness one: restarting the gateway mends none of
    these, and the running gateway recovers by itself once they are mended.
    """
    state = gateway_state(request)
    try:
        await state.require_store().ensure_writable()
    except UNAVAILABLE_ERRORS as error:
        why = _store_health_error(error)
        if state.store_health_error != why:  # logged as it starts or changes, not at each probe
            logger.warning("/health: the store cannot take writes: %s (%s: %s)",
                           unavailable_cause(error), type(error).__name__, error)
            state.store_health_error = why
        return _health(503, Health(status="unavailable", models=list(state.engines), error=why))
    if state.store_health_error is not None:
        logger.info("/health: the store takes writes again")
        state.store_health_error = None
    unavailable = []
    for name, engine in list(state.engines.items()):
        try:
            await engine.ensure_available()
        except EngineUnavailable:
            unavailable.append(name)
    if len(unavailable) == len(state.engines):
        return _health(503, Health(status="unavailable", models=list(state.engines),
                                   unavailable_models=unavailable,
                                   error="no engine can take requests: start an engine worker "
                                         "(switchboard worker --redis URL)"))
    return _health(200, Health(status="ok", models=list(state.engines),
                               unavailable_models=unavailable))


def _store_health_error(error: Exception) -> str:
    """/health's `error` while the store cannot take writes: what calls are told while it has no
    room left (only its operator mends that), else what the cause is (calls are told to retry)."""
    if isinstance(error, FULL_ERRORS):
        return store_unavailable(error).body.error.message
    return (f"the gateway cannot use its store (tenants, keys, limits): {unavailable_cause(error)}; "
            "it serves again by itself once that is mended")


def _health(status: int, body: Health) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


async def metrics(request: Request) -> Response:
    """Prometheus metrics in the text exposition format, for the metrics key or the admin key."""
    state = gateway_state(request)
    await require_metrics_reader(request, state.require_store(), state.metrics_key_hash)
    return Response(state.metrics.render(state.engines), media_type=CONTENT_TYPE)
