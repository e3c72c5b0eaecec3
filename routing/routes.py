"""Routes: names clients send as `model` that pick a served model per request.

Two kinds. A learned route asks a trained router (routing.learned) whether the prompt needs the
strong model and runs only the model it picks:

    [routes.smart]
    kind = "learned"
    tiers = ["small", "large"]              # the small model, then the strong one
    router = "/path/to/router"              # a folder written by `switchboard router train`
    target_strong_share = 0.3               # optional: recalibrate to this share of strong calls
    recalibrate_window = 500                # over each tenant's last 500 requests (the default; 0: never)

A cascade route (the default kind) lists models cheapest first. The request runs on the first; if that model's
confidence (routing.confidence) in its answer is below the route's threshold for that step, the
next model answers instead, and so on; the last model's answer is always kept. Declared in the
server's config file:

    [routes.auto]
    tiers = ["small", "medium", "large"]   # cheapest first
    measure = "quantile"                    # mean_logprob | min_prob | quantile
    thresholds = [0.55, 0.4]                # one per escalation step (len(tiers) - 1)
    quantile = 0.1                          # for measure = "quantile"
    prefix_tokens = 8                       # streamed requests decide on this many tokens
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

from routing.confidence import DEFAULT_QUANTILE, MEASURES
from routing.learned import LearnedRouter
from store.models import validate_name

AUTO = "auto"  # the model name that means "the tenant's default route"
DEFAULT_RECALIBRATE_WINDOW = 500
MAX_RECALIBRATE_WINDOW = 10_000  # ranked on each call: about 1 ms at this size


@dataclass(frozen=True)
class CascadeRoute:
    """Models cheapest first, and the confidence each must reach to keep its answer."""

    name: str
    tiers: tuple[str, ...]
    thresholds: tuple[float, ...]  # thresholds[i]: tiers[i] keeps its answer at or above it
    measure: str = "quantile"
    quantile: float = DEFAULT_QUANTILE
    prefix_tokens: int = 8

    def __post_init__(self) -> None:
        where = f"route {self.name!r}"
        if len(self.tiers) < 2:
            raise ValueError(f"{where} needs at least two tiers, cheapest first")
        if len(set(self.tiers)) != len(self.tiers):
            raise ValueError(f"{where} lists a model twice in tiers")
        if len(self.thresholds) != len(self.tiers) - 1:
            raise ValueError(f"{where} needs one threshold per escalation step: "
                             f"{len(self.tiers) - 1} for {len(self.tiers)} tiers")
        if self.measure not in MEASURES:
            raise ValueError(f"{where}: unknown measure {self.measure!r}; use one of "
                             f"{', '.join(MEASURES)}")
        if not 0.0 <= self.quantile <= 1.0:
            raise ValueError(f"{where}: quantile must be in [0, 1], got {self.quantile}")
        if self.prefix_tokens < 1:
            raise ValueError(f"{where}: prefix_tokens must be >= 1, got {self.prefix_tokens}")
        # A threshold no score can be on the far side of escalates every call (both tiers billed),
        # or none: a typo, not a policy. NaN escalates every call too.
        low, high = (-math.inf, 0.0) if self.measure == "mean_logprob" else (0.0, 1.0)
        for threshold in self.thresholds:
            if not low <= threshold <= high:
                raise ValueError(f"{where}: {self.measure} thresholds must be in [{low}, {high}], "
                                 f"got {threshold}")

    def threshold(self, step: int) -> float | None:
        """The threshold tiers[step] must reach; None for the last tier, which always answers."""
        return self.thresholds[step] if step < len(self.thresholds) else None


@dataclass(frozen=True)
class LearnedRoute:
    """A small and a strong model, and the router that picks between them per prompt."""

    name: str
    tiers: tuple[str, str]  # (small, strong)
    router: LearnedRouter
    target_strong_share: float | None = None  # None: the router's own calibrated threshold
    recalibrate_window: int = DEFAULT_RECALIBRATE_WINDOW
    """Recent prompts per tenant the threshold is recalibrated on, to the target share (the
    tenant's `strong_share`, else the route's); 0: never, the router's threshold always."""

    def __post_init__(self) -> None:
        where = f"route {self.name!r}"
        if len(self.tiers) != 2 or self.tiers[0] == self.tiers[1]:
            raise ValueError(f"{where}: a learned route has two tiers, the small model then the "
                             "strong one")
        share = self.target_strong_share
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"{where}: target_strong_share must be in [0, 1], got {share}")
        if not 0 <= self.recalibrate_window <= MAX_RECALIBRATE_WINDOW:
            raise ValueError(f"{where}: recalibrate_window must be in [0, {MAX_RECALIBRATE_WINDOW}] "
                             "(each call ranks the tenant's scores in the window)")
        if self.recalibrate_window == 0 and share is not None:
            raise ValueError(f"{where}: target_strong_share is reached by recalibrating on each "
                             "tenant's recent prompts; set recalibrate_window above 0 (or leave it "
                             f"out: {DEFAULT_RECALIBRATE_WINDOW})")


Route = CascadeRoute | LearnedRoute
_PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
_Threshold = float | tuple[float, ...]


class _CascadeTable(msgspec.Struct, forbid_unknown_fields=True):
    """A [routes.NAME] table of a cascade, as the config file may write it."""

    kind: str = "cascade"
    tiers: tuple[str, ...] = ()
    thresholds: _Threshold | None = None
    threshold: _Threshold | None = None
    measure: str = "quantile"
    quantile: float = DEFAULT_QUANTILE
    prefix_tokens: _PositiveInt = 8


class _LearnedTable(msgspec.Struct, forbid_unknown_fields=True):
    """A [routes.NAME] table of a learned route."""

    kind: str
    tiers: tuple[str, ...] = ()
    router: str | None = None
    target_strong_share: float | None = None
    recalibrate_window: Annotated[int, msgspec.Meta(ge=0)] | None = None


def parse_routes(tables: dict[str, Any], served: Collection[str] | None) -> dict[str, Route]:
    """Routes from the config file's [routes.NAME] tables, checked against the served models
    (unless `served` is None: not known yet); ValueError, naming the route and the key, for
    anything wrong (InvalidName, a ValueError, for a name outside store.models' naming rule)."""
    routes: dict[str, Route] = {}
    for name, table in tables.items():
        # Names follow the rule of tenants and adapters: one with a ':' could never be called,
        # since `model` names a route with an adapter as route:adapter (routing.models).
        validate_name("route", name)
        if served is not None and name in served:
            raise ValueError(f"route {name!r} has the name of a served model; rename one of them")
        if not isinstance(table, dict):
            raise ValueError(f"[routes.{name}] must be a table")
        kind = table.get("kind", "cascade")
        if kind not in ("cascade", "learned"):
            raise ValueError(f"[routes.{name}] kind must be \"cascade\" or \"learned\", got {kind!r}")
        shape = _CascadeTable if kind == "cascade" else _LearnedTable
        unknown = sorted(set(table) - set(shape.__struct_fields__))
        if unknown:
            raise ValueError(f"unknown keys in [routes.{name}]: {', '.join(unknown)}; known keys: "
                             f"{', '.join(sorted(shape.__struct_fields__))}")
        try:
            parsed = msgspec.convert(table, shape)
        except msgspec.ValidationError as error:
            raise ValueError(f"[routes.{name}]: {str(error).replace('$.', '')}") from None
        missing = [t for t in parsed.tiers if served is not None and t not in served]
        if missing:
            raise ValueError(f"route {name!r} names models that are not served: "
                             f"{', '.join(missing)}")
        routes[name] = _learned(name, parsed) if isinstance(parsed, _LearnedTable) else \
            _cascade(name, parsed)
    return routes


def _cascade(name: str, table: _CascadeTable) -> CascadeRoute:
    if table.thresholds is not None and table.threshold is not None:
        raise ValueError(f"[routes.{name}] gives both threshold and thresholds; keep one "
                         "(threshold: the same for every step, thresholds: one per step)")
    thresholds = table.thresholds if table.thresholds is not None else table.threshold
    if isinstance(thresholds, float):
        thresholds = (thresholds,) * max(len(table.tiers) - 1, 1)
    return CascadeRoute(name=name, tiers=table.tiers, thresholds=thresholds or (),
                        measure=table.measure, quantile=table.quantile,
                        prefix_tokens=table.prefix_tokens)


def _learned(name: str, table: _LearnedTable) -> LearnedRoute:
    if table.router is None:
        raise ValueError(f"[routes.{name}] needs router = \"<folder of switchboard router train>\"")
    window = table.recalibrate_window
    router = LearnedRouter.load(Path(table.router).expanduser())
    return LearnedRoute(name=name, tiers=table.tiers, router=router,
                        target_strong_share=table.target_strong_share,
                        recalibrate_window=DEFAULT_RECALIBRATE_WINDOW if window is None else window)
