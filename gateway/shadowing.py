"""Warnings for tenants' adapters whose name a route or served model took after their upload,
and for engine workers' models whose name a route took.

Uploads refuse the names of routes and served models, but the operator may add one later (a
restart with another config, an engine worker of a new model): `model` then names it, not the
adapter (routing.models.resolve_model), which is reached as `base:adapter` only. Nothing tells
the tenant, so the gateway's log does, once per adapter.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from routing.models import Catalog, adapter_model_id, adapters_named
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
            self._warned.add((adapter.tenant, adapter.name))
            logger.warning(
                "adapter %r of tenant %r (base model %r) has the name of %s, which calls naming "
                "%r run instead of the adapter; the tenant reaches the adapter as %r (so "
                "/v1/models lists it), or can upload it again under another name", adapter.name,
                adapter.tenant, adapter.base_model, _taker(catalog, adapter.name), adapter.name,
                adapter_model_id(adapter, names))


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


def _taker(catalog: Catalog, name: str) -> str:
    """What `model: name` means, as resolve_model reads it."""
    if name == AUTO:
        return f"{AUTO!r}, the tenant's default route"
    if name in catalog.routes:
        return f"the route {name!r}"
    return f"the served model {name!r}"
