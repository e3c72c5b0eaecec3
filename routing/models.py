"""What a request's `model` names: a served base model, or one of the caller's tenant's adapters.

A client writes `model` as a base model's served name, an adapter's name, or `base:adapter`.
Adapter names resolve in the caller's tenant only, so another tenant's adapter is as unknown as
one that never existed. Names cannot contain ":" (store.models.validate_name), so the split of
`base:adapter` is unambiguous.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from store import AdapterRecord, Store, Tenant
from store.models import is_valid_name


class ModelNotFound(LookupError):
    """The model does not exist for this tenant (or the tenant may not use it)."""


@dataclass(frozen=True)
class ModelTarget:
    """The base model a request runs on and the adapter it runs with, if any."""

    base_model: str
    adapter: AdapterRecord | None = None


def allowed_base_models(tenant: Tenant, served: Collection[str]) -> list[str]:
    """The served base models this tenant may use, in serving order."""
    return [m for m in served if tenant.allowed_models is None or m in tenant.allowed_models]


async def resolve_model(store: Store, tenant: Tenant, served: Collection[str],
                        model: str) -> ModelTarget:
    """The target `model` names for `tenant`; ModelNotFound if it names nothing they may use."""
    allowed = allowed_base_models(tenant, served)
    if model in allowed:
        return ModelTarget(model)
    base, sep, name = model.partition(":")
    if not sep:
        base, name = None, model
    if not name or (base is not None and base not in allowed):
        raise ModelNotFound(model)
    # NOTE: a string that cannot be a name is a typo (404), never something to build store keys of.
    adapter = await store.get_adapter(tenant.name, name) if is_valid_name(name) else None
    if adapter is None or adapter.base_model not in allowed or base not in (None, adapter.base_model):
        raise ModelNotFound(model)
    return ModelTarget(adapter.base_model, adapter)


async def visible_adapters(store: Store, tenant: Tenant,
                           served: Collection[str]) -> list[AdapterRecord]:
    """The tenant's adapters (latest versions) on base models it may use."""
    allowed = set(allowed_base_models(tenant, served))
    return [a for a in await store.list_adapters(tenant.name) if a.base_model in allowed]
