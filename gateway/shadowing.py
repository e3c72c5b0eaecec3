"""Warnings for tenants' adapters whose name a route or served model took after their upload,
for engine workers' models whose name a route took, and for tenants' default routes the
server no longer declares.

Uploads refuse the names of routes and served models, but the operator may add one later (a
restart with another config, an engine worker of a new model): `model` then names it, not the
adapter (routing.models.resolve_model), which is reached as `base:adapter` only. Nothing tells
the tenant, so the gateway's log does, once per adapter.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from routing.models import Catalog, adapters_named, tenant_adapter_id
from routing.routes import AUTO
from store import UNAVAILABLE_ERRORS, Store

logger = logging.getLogger(__name__)


class ShadowWarnings:
    """Logs a WARNING for each tenant adapter that a route or served model shadows, the first
    time it is seen."""

    def __init__(self) -> None:
        self._warned: set[tuple[str, str]] = set()  # (tenant, adapter name)

    async def check(self, store: Store, catalog: Catalog, names: Collection[str]) -> None:
        """Warn of the adapters named one of `names`, which `catalog` takes (taken_names)."""
        try:
            shadowed = await adapters_named(store, names)
        except UNAVAILABLE_ERRORS as error:
            # Only a warning is lost: calls resolve as they would anyway.
            logger.warning("could not look for adapters named %s (the store is unavailable: %s)",
                           ", ".join(sorted(names)), error)
            return
        for adapter in shadowed:
            if (adapter.tenant, adapter.name) in self._warned:
                continue
            try:
                tenant = await store.get_tenant(adapter.tenant)
            except UNAVAILABLE_ERRORS:
                continue  # warned of at the next check
            if tenant is None:  # deleted meanwhile
                continue
            self._warned.add((adapter.tenant, adapter.name))
            logger.warning(
                "adapter %r of tenant %r (base model %r) has the name of %s, which calls naming "
                "%r run instead of the adapter; the tenant reaches the adapter as %r (so "
                "/v1/models lists it), or can upload it again under another name", adapter.name,
                adapter.tenant, adapter.base_model, _taker(catalog, adapter.name), adapter.name,
                tenant_adapter_id(tenant, catalog, adapter))  # NOTE: as /v1/models names it


    async def check_served(self, store: Store, catalog: Catalog, model: str) -> None:
        """Warn if an engine worker's `model`, which the gateway just started serving, has a
        route's name (which no config check could refuse: workers come after the gateway's
        start), then of the adapters named `model`."""
        if model == AUTO or model in catalog.routes:
            logger.warning(
                "engine workers serve a model named %r, which is the name of %s: calls naming %r "
                "run the route, never the model, and /v1/models leaves the model out; start the "
                "workers with another name for it (--model NAME=PATH), or rename the route",
                model, _taker(catalog, model), model)
        await self.check(store, catalog, {model})


async def warn_of_undeclared_default_routes(store: Store, catalog: Catalog) -> None:
    """Warn of each tenant whose own default route this server does not declare (a restart with
    another config dropped it): its `auto` means the server's default route meanwhile."""
    try:
        tenants = await store.list_tenants()
    except UNAVAILABLE_ERRORS as error:
        logger.warning("could not check the tenants' default routes (the store is unavailable: "
                       "%s)", error)
        return
    for tenant in tenants:
        if tenant.default_route is not None and tenant.default_route not in catalog.routes:
            instead = (f"the server's default route {catalog.default_route!r}"
                       if catalog.default_route is not None else "nothing (a 404)")
            logger.warning(
                "tenant %r has the default route %r, which this server does not declare: its "
                "calls to %r get %s instead; declare the route again, or set the tenant's "
                "default_route (PATCH /admin/tenants/%s)", tenant.name, tenant.default_route,
                AUTO, instead, tenant.name)


def _taker(catalog: Catalog, name: str) -> str:
    """What `model: name` means, as resolve_model reads it."""
    if name == AUTO:
        return f"{AUTO!r}, the tenant's default route"
    if name in catalog.routes:
        return f"the route {name!r}"
    return f"the served model {name!r}"
