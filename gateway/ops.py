"""Model listing, health and Prometheus metrics."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import authenticate_tenant
from gateway.prometheus import CONTENT_TYPE
from gateway.protocol import ModelCard, ModelList
from gateway.state import gateway_state
from routing.models import allowed_base_models, allowed_routes, default_route, visible_adapters
from routing.routes import AUTO


class Health(msgspec.Struct, kw_only=True):
    status: str
    models: list[str]


async def list_models(request: Request) -> Response:
    """The models the caller's tenant may use: base models, routes, then its own adapters."""
    state = gateway_state(request)
    store = state.require_store()
    tenant = await authenticate_tenant(request, store)
    cards = [ModelCard(id=name, created=state.started_at,
                       max_model_len=state.engines[name].max_model_len)
             for name in allowed_base_models(tenant, state.engines)]
    for name in allowed_routes(tenant, state.catalog):
        route = state.routes[default_route(tenant, state.catalog) if name == AUTO else name]
        cards.append(ModelCard(id=name, created=state.started_at, max_model_len=min(
            state.engines[m].max_model_len for m in route.tiers)))
    cards += [ModelCard(id=a.name, created=int(a.created_at), owned_by=tenant.name,
                        max_model_len=state.engines[a.base_model].max_model_len,
                        parent=a.base_model)
              for a in await visible_adapters(store, tenant, state.engines)]
    return Response(msgspec.json.encode(ModelList(data=cards)), media_type="application/json")


async def health(request: Request) -> Response:
    """200 while the gateway is up and serving its models (no key needed)."""
    state = gateway_state(request)
    body = Health(status="ok", models=list(state.engines))
    return Response(msgspec.json.encode(body), media_type="application/json")


async def metrics(request: Request) -> Response:
    """Prometheus metrics in the text exposition format (no key needed)."""
    state = gateway_state(request)
    return Response(state.metrics.render(state.engines), media_type=CONTENT_TYPE)
