"""create_app: the Starlette application of the gateway, over engines built by the caller.

The app owns the store (opened on the server's event loop by its lifespan, since Redis
connections belong to one loop); the caller owns the engines and closes them after the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware

from gateway import adapter_api, admin, version
from gateway.admission import wait_for_settles
from gateway.auth import ensure_admin_key
from gateway.chat import create_chat_completion
from gateway.completions import create_completion
from gateway.engine_client import EngineClient
from gateway.errors import EXCEPTION_HANDLERS
from gateway.metrics import GatewayMetrics
from gateway.middleware import AccessLog, InFlight
from gateway.openapi import openapi_json
from gateway.ops import health, list_models, metrics, retrieve_model
from gateway.path_route import PathRoute
from gateway.remote import DEFAULT_MODEL_TTL_S, WorkerPool
from gateway.shadowing import ShadowWarnings, warn_of_undeclared_default_routes
from gateway.state import DEFAULT_MAX_UPLOAD_BYTES, GatewayState
from routing.models import taken_names
from routing.pricing import Price
from routing.routes import AUTO, Route as ModelRoute
from store import open_store
from store.blobs import SWEEP_PERIOD_S, BlobStore, drop_deleted_adapters, ensure_intact_copy
from store.keys import hash_key
from store.workers import Periodic, WorkerRegistry

logger = logging.getLogger(__name__)
# How long a shutdown waits for the requests it cancelled to settle their calls before it closes
# the store; a request that hangs in its cleanup must not hold the process.
_ENDING_TIMEOUT_S = 10.0

ROUTES = [
    PathRoute("/v1/models", {"GET": list_models}),
    # NOTE: {model:path}, as base:adapter names and upstream model names may hold '/' and ':'.
    PathRoute("/v1/models/{model:path}", {"GET": retrieve_model}),
    PathRoute("/v1/completions", {"POST": create_completion}),
    PathRoute("/v1/chat/completions", {"POST": create_chat_completion}),
    *adapter_api.ROUTES,
    *admin.ROUTES,
    PathRoute("/health", {"GET": health}),
    PathRoute("/metrics", {"GET": metrics}),
    PathRoute("/openapi.json", {"GET": openapi_json}),
]


def _log_admin_key(key: str) -> None:
    logger.warning("created the admin key (stored only as a hash; it is not shown again): %s", key)


def check_routes(engines: dict[str, EngineClient], routes: dict[str, ModelRoute],
                 default_route: str | None, *, workers: bool = False) -> None:
    """ValueError unless the default route is declared, no route has the name of one of `engines`
    (the local models and upstreams), and every route's tiers are served (any mix of local
    models and upstreams: each tier reads a prompt with its own tokenizer). With `workers`, the
    tiers are left to log_tiers_no_worker_serves, once the registry has been read. Warns of a
    route named `auto` that is not the default route."""
    if default_route is not None and default_route not in routes:
        raise ValueError(f"the default route {default_route!r} is not declared; routes: "
                         f"{', '.join(routes) or 'none'}")
    for route in routes.values():
        if route.name in engines:
            raise ValueError(f"route {route.name!r} has the name of a served model; rename one of them")
        missing = [m for m in route.tiers if m not in engines]
        if missing and not workers:
            raise ValueError(f"route {route.name!r} names models that are not served: "
                             f"{', '.join(missing)}")
    if AUTO in routes and default_route != AUTO:
        # NOTE: a warning, not a refusal: a tenant whose own default route is it reaches it.
        logger.warning(
            "route %r is reached only by tenants whose default_route is %r: `model: \"auto\"` "
            "means the default route, which is %s; rename the route, or set default_route = "
            "\"auto\"", AUTO, AUTO, repr(default_route) if default_route else "not set")


def log_tiers_no_worker_serves(engines: dict[str, EngineClient],
                               routes: dict[str, ModelRoute]) -> None:
    """Only a warning: workers may start after the gateway (the route leaves those models' tiers
    out until one does)."""
    for route in routes.values():
        missing = [m for m in route.tiers if m not in engines]
        if missing:
            logger.warning("route %r names models no engine worker serves yet: %s (its calls run "
                           "on its other models until one does)", route.name, ", ".join(missing))


def create_app(engines: dict[str, EngineClient], *, data_dir: Path, store_url: str | None = None,
               admin_key: str | None = None, metrics_key: str | None = None,
               adapter_dir: Path | None = None,
               max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
               prices: dict[str, Price] | None = None,
               routes: dict[str, ModelRoute] | None = None, default_route: str | None = None,
               workers_url: str | None = None, load_tokenizer: Callable[[Path], Any] | None = None,
               worker_model_ttl_s: float = DEFAULT_MODEL_TTL_S,
               announce_admin_key: Callable[[str], None] = _log_admin_key,
               blob_sweep_s: float = SWEEP_PERIOD_S) -> Starlette:
    """The gateway serving `engines` (by the model name clients send).

    On startup it opens the store (`store_url`, see store.open_store; SQLite in `data_dir` when
    None) and sets the admin key to `admin_key`; with none given and none stored, it creates one
    and hands its plaintext to `announce_admin_key`, once. /metrics answers the admin key and
    `metrics_key` (when given), nothing else. Uploaded adapter files live in
    `adapter_dir` (default `data_dir`/adapters); with a Redis store also in Redis, from which
    gateways fetch what their own `adapter_dir` lacks, and where others delete adapters: every
    `blob_sweep_s` the gateway drops the files of those from its folder.
    Calls are charged to tenants' spend at `prices` (by model name; unlisted models are free).
    `routes` (routing.routes) are offered as models; `default_route` is what `auto` means.
    `model` names routes and served models before adapters: the gateway logs a warning for each
    tenant adapter whose name one has (at startup, or when an engine worker's model is first
    served), as calls then reach it as `base:adapter` only.
    With `workers_url` (a Redis URL), the models of the engine workers registered there are
    served too (gateway/remote.py), their tokenizers read by `load_tokenizer`, each until
    `worker_model_ttl_s` after the last heartbeat of its workers; routes are then checked once
    the registry has been read, so their models may be served by workers (even workers that
    start later). A worker's model named like a route is reached by no call (the route is) and
    not listed: the gateway logs a warning when it is first served.
    """
    routes = routes or {}
    engines = dict(engines)  # NOTE: the worker pool adds (and removes) the models of its workers
    check_routes(engines, routes, default_route, workers=workers_url is not None)
    blobs = BlobStore(adapter_dir if adapter_dir is not None else data_dir / "adapters")
    gateway = GatewayState(engines=engines, metrics=GatewayMetrics(), blobs=blobs,
                           max_upload_bytes=max_upload_bytes, prices=prices or {},
                           routes=routes, default_route=default_route,
                           metrics_key_hash=hash_key(metrics_key) if metrics_key else None)
    requests: set[asyncio.Task] = set()  # those being handled
    shadows = ShadowWarnings()  # of adapters whose name a route or served model took

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # NOTE: `switchboard serve` waited for the store to take writes just before (gateway.cli).
        gateway.store = await open_store(store_url, data_dir)
        pool = sweeping = None
        try:
            created = await ensure_admin_key(gateway.store, admin_key)
            if created is not None:
                announce_admin_key(created)
            # Files of adapters deleted through other gateways (or while this one was down).
            await drop_deleted_adapters(blobs, gateway.store)
            if gateway.store.shared_blobs is not None:  # others delete adapters while it runs
                sweeping = Periodic(functools.partial(drop_deleted_adapters, blobs, gateway.store),
                                    blob_sweep_s, "dropping the files of deleted adapters")
            await shadows.check(gateway.store, gateway.catalog, taken_names(gateway.catalog))
            await warn_of_undeclared_default_routes(gateway.store, gateway.catalog)
            if workers_url is not None:
                pool = WorkerPool(WorkerRegistry.open(workers_url), data_dir / "tokenizers",
                                  load_tokenizer, engines, model_ttl_s=worker_model_ttl_s,
                                  records_elsewhere=store_url != workers_url,
                                  ensure_intact_copy=functools.partial(
                                      ensure_intact_copy, blobs, gateway.store.shared_blobs),
                                  on_serving=lambda model: shadows.check_served(
                                      gateway.require_store(), gateway.catalog, model))
                await pool.start()
                log_tiers_no_worker_serves(engines, routes)
            yield
        finally:
            # NOTE: a server's shutdown cancels the requests still running at its deadline; they
            # settle their calls on the way out, through the store and the worker pool.
            if requests:
                await asyncio.wait(set(requests), timeout=_ENDING_TIMEOUT_S)
            await wait_for_settles(_ENDING_TIMEOUT_S)
            if sweeping is not None:
                await sweeping.stop()
            if pool is not None:
                await pool.close()
            await gateway.store.close()

    # NOTE: AccessLog outside InFlight, so that it records the 503 InFlight answers a call the
    # shutdown's deadline stopped (inside, it logged and counted a 500 nobody was sent).
    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS,
                    middleware=[Middleware(AccessLog, metrics=gateway.metrics),
                                Middleware(InFlight, tasks=requests)])
    app.state.gateway = gateway
    app.state.version = version()
    return app
