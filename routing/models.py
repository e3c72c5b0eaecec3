"""What a request's `model` names: a served base model, a route, or one of the tenant's adapters.

A client writes `model` as a base model's served name, an adapter's name, `base:adapter`, a
route's name, `auto` (the tenant's default route), or `route:adapter` (the route, whose tier on
the adapter's base model runs with the adapter).
Routes and served models come first: an adapter whose name one takes after its upload (uploads
refuse such names) is reached as `base:adapter` only, so a tenant cannot take an operator's name.
Adapter names resolve in the caller's tenant only, so another tenant's adapter is as unknown as
one that never existed. Model, adapter and route names cannot contain ":" (gateway.config,
store.models.validate_name, routing.routes.parse_routes), so the split of `base:adapter` and
`route:adapter` is unambiguous.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from routing.routes import AUTO, Route
from store import AdapterRecord, Store, Tenant
from store.models import is_valid_name


class ModelNotFound(LookupError):
    """The model does not exist for this tenant (another tenant's adapter does not either).
    `why`, when set: what the name reached and why that does not serve (for the client)."""

    def __init__(self, model: str, why: str | None = None):
        super().__init__(model)
        self.why = why


class ModelNotAllowed(PermissionError):
    """The model or route exists, but the tenant's policy does not allow it: `served`, the served
    model or route that `model` names (an adapter's base model); `instead`, the name that reaches
    it through a route the policy allows, if one does."""

    def __init__(self, model: str, served: str, instead: str | None = None):
        super().__init__(model)
        self.served = served
        self.instead = instead


@dataclass(frozen=True)
class Catalog:
    """What the server offers: base models (in serving order), routes, and the default route."""

    models: tuple[str, ...]
    routes: dict[str, Route] = field(default_factory=dict)
    default_route: str | None = None


@dataclass(frozen=True)
class ModelTarget:
    """What a request runs on: a base model with maybe an adapter, or a route (whose tier on the
    adapter's base model runs with the adapter)."""

    base_model: str
    adapter: AdapterRecord | None = None
    route: Route | None = None


def may_use(tenant: Tenant, name: str) -> bool:
    """Whether the tenant's policy allows the model or route `name`."""
    return tenant.allowed_models is None or name in tenant.allowed_models


def allowed_base_models(tenant: Tenant, served: Collection[str]) -> list[str]:
    """The served base models this tenant may use, in serving order."""
    return [m for m in served if may_use(tenant, m)]


def adapter_base_models(tenant: Tenant, catalog: Catalog) -> list[str]:
    """The served base models this tenant may upload adapters for, in serving order: those its
    policy allows, and the models of the routes it allows (`route:adapter` runs the adapter on
    its base model's tier of the route, as resolve_model lets it)."""
    return [m for m in catalog.models
            if may_use(tenant, m) or route_running(tenant, catalog, m) is not None]


def route_running(tenant: Tenant, catalog: Catalog, base_model: str) -> str | None:
    """The first name of a route this tenant may name that has a tier on `base_model` (None: none
    does): its own name, or `auto` for its default route, which a route named "auto" is reached
    by only (allowed_routes)."""
    names = sorted(allowed_routes(tenant, catalog), key=lambda name: name == AUTO)  # `auto` last
    return next((name for name in names
                 if base_model in catalog.routes[default_route(tenant, catalog)
                                                 if name == AUTO else name].tiers), None)


def reachable_base_models(tenant: Tenant, catalog: Catalog) -> list[str]:
    """The base models this tenant may use that `model` reaches by their own name: not one whose
    name a route (or `auto`) took, as an engine worker's model may (resolve_model runs the route)."""
    taken = {AUTO, *catalog.routes}
    return [m for m in allowed_base_models(tenant, catalog.models) if m not in taken]


def default_route(tenant: Tenant, catalog: Catalog) -> str | None:
    """The route `auto` means for this tenant: its own default, else the server's. Its own one
    counts only while the server declares it: a restart with another config may have dropped it
    (the gateway then logs a warning at startup: gateway/shadowing.py)."""
    own = tenant.default_route
    return own if own in catalog.routes else catalog.default_route


def allowed_routes(tenant: Tenant, catalog: Catalog) -> list[str]:
    """The routes this tenant may name, `auto` first when it has a default route it may use. A
    route named "auto" is listed once, as `auto`: the name means the tenant's default route."""
    names = [r for r in catalog.routes if may_use(tenant, r) and r != AUTO]
    auto = default_route(tenant, catalog)
    return ([AUTO] if auto in catalog.routes and may_use(tenant, auto) else []) + names


def taken_names(catalog: Catalog) -> set[str]:
    """The names `model` gives routes and served models (and `auto`), before any adapter."""
    return {AUTO, *catalog.routes, *catalog.models}


def adapter_model_id(adapter: AdapterRecord, taken: Collection[str]) -> str:
    """The `model` that reaches the adapter: its name, or `base:name` while its name is `taken`
    (see taken_names)."""
    return f"{adapter.base_model}:{adapter.name}" if adapter.name in taken else adapter.name


def adapter_route(tenant: Tenant, catalog: Catalog, adapter: AdapterRecord) -> str | None:
    """The route (as allowed_routes names it) the tenant reaches its adapter through: None where
    its policy allows the adapter's base model, else route_running's."""
    return None if may_use(tenant, adapter.base_model) else \
        route_running(tenant, catalog, adapter.base_model)


def tenant_adapter_id(tenant: Tenant, catalog: Catalog, adapter: AdapterRecord) -> str:
    """The `model` that reaches the tenant's adapter: adapter_model_id's where its policy allows
    the adapter's base model, else `route:name` for a route it allows over that model."""
    route = adapter_route(tenant, catalog, adapter)
    return adapter_model_id(adapter, taken_names(catalog)) if route is None else f"{route}:{adapter.name}"


async def resolve_model(store: Store, tenant: Tenant, catalog: Catalog,
                        model: str) -> ModelTarget:
    """The target `model` names for `tenant`.

    Raises ModelNotFound for names that mean nothing to this tenant, ModelNotAllowed for served
    models and routes its policy excludes.
    """
    # NOTE: routes, then served models, then adapters (taken_names, adapter_model_id).
    head, sep, name = model.partition(":")
    route_name = default_route(tenant, catalog) if head == AUTO else head
    if head == AUTO and route_name is None:
        raise ModelNotFound(model)
    if route_name in catalog.routes:
        if not may_use(tenant, route_name):
            raise ModelNotAllowed(model, route_name)
        route = catalog.routes[route_name]
        adapter = await _tenant_adapter(store, tenant, name) if sep else None
        if sep and adapter is None:
            raise ModelNotFound(model)
        if adapter is not None and adapter.base_model not in route.tiers:
            raise ModelNotFound(model, f"the adapter {name!r} is for the base model "
                                f"{adapter.base_model!r}, which is not one of the models of route "
                                f"{route_name!r} ({', '.join(route.tiers)})")
        return ModelTarget(route.tiers[0], adapter, route)
    if model in catalog.models:
        if not may_use(tenant, model):
            raise ModelNotAllowed(model, model)
        return ModelTarget(model)
    base, name = (head, name) if sep else (None, model)
    if base is not None and base not in catalog.models:
        raise ModelNotFound(model)
    adapter = await _tenant_adapter(store, tenant, name)
    if adapter is None or base not in (None, adapter.base_model):
        raise ModelNotFound(model)
    if not may_use(tenant, adapter.base_model):
        # NOTE: a tenant allowed only routes runs its adapters as route:adapter (/v1/models lists
        # them so); its adapter's own name is refused saying so.
        route = adapter_route(tenant, catalog, adapter)
        raise ModelNotAllowed(model, adapter.base_model,
                              None if route is None else f"{route}:{adapter.name}")
    return ModelTarget(adapter.base_model, adapter)


async def _tenant_adapter(store: Store, tenant: Tenant, name: str) -> AdapterRecord | None:
    # NOTE: a string that cannot be a name is a typo (404), never something to build store keys of.
    return await store.get_adapter(tenant.name, name) if is_valid_name(name) else None


async def visible_adapters(store: Store, tenant: Tenant, catalog: Catalog,
                           max_ranks: Mapping[str, float]) -> list[AdapterRecord]:
    """The tenant's adapters (latest versions) on base models it may use (by name or through a
    route: adapter_base_models), of a rank their model serves. `max_ranks`: each served base
    model's highest adapter rank (0: it serves none)."""
    allowed = set(adapter_base_models(tenant, catalog)) & set(max_ranks)
    return [a for a in await store.list_adapters(tenant.name)
            if a.base_model in allowed and a.rank <= max_ranks[a.base_model]]


async def adapters_named(store: Store, names: Collection[str]) -> list[AdapterRecord]:
    """Every tenant's adapters (latest versions) named one of `names`."""
    return [a for tenant in await store.list_tenants()
            for a in await store.list_adapters(tenant.name) if a.name in names]
