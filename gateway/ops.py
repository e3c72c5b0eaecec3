"""Model listing, health and Prometheus metrics."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import authenticate_tenant
from gateway.prometheus import CONTENT_TYPE
from gateway.protocol import ModelCard, ModelList
from gateway.serving import visible_models
from gateway.state import gateway_state


class Health(msgspec.Struct, kw_only=True):
    status: str
    models: list[str]


async def list_models(request: Request) -> Response:
    """The models the caller's tenant may use."""
    state = gateway_state(request)
    tenant = await authenticate_tenant(request, state.require_store())
    cards = [ModelCard(id=name, created=state.started_at,
                       max_model_len=state.engines[name].max_model_len)
             for name in visible_models(state, tenant)]
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
