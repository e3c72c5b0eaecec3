"""GatewayState: what every handler reaches through `request.app.state.gateway`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from starlette.requests import Request

from gateway.engine_client import EngineClient
from gateway.metrics import GatewayMetrics
from routing.decide import LearnedRouting
from routing.models import Catalog
from routing.pricing import FREE, Price
from routing.routes import Route
from store import Store
from store.blobs import BlobStore

DEFAULT_MAX_UPLOAD_BYTES = 1 << 30


@dataclass
class GatewayState:
    """The served models (by the name clients use), the store, adapter files (`blobs`: this
    gateway's folder, a cache in front of the store's shared copies if it has any), and the
    metrics."""

    engines: dict[str, EngineClient]
    metrics: GatewayMetrics
    blobs: BlobStore
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES  # largest adapter upload body accepted
    prices: dict[str, Price] = field(default_factory=dict)  # by base model name; unlisted: free
    routes: dict[str, Route] = field(default_factory=dict)
    default_route: str | None = None  # what `auto` means for tenants without a default of their own
    metrics_key_hash: str | None = None  # of the key that may read /metrics (the admin key may too)
    learned: LearnedRouting = field(default_factory=LearnedRouting)
    store: Store | None = None  # opened by the app's lifespan, on the server's event loop
    started_at: int = field(default_factory=lambda: int(time.time()))
    store_health_error: str | None = None  # what /health last said of the store (None: usable)

    @property
    def catalog(self) -> Catalog:
        return Catalog(tuple(self.engines), self.routes, self.default_route)

    def price_of(self, base_model: str) -> Price:
        return self.prices.get(base_model, FREE)

    def require_store(self) -> Store:
        assert self.store is not None, "the store is opened by the app's lifespan"
        return self.store


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway
