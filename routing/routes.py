"""Routes: names clients send as `model` that pick a served model per request.

Two kinds. A learned route asks a trained router (routing.learned) whether the prompt needs the
strong model and runs only the model it picks:

    [routes.smart]
    kind = "learned"
    tiers = ["small", "large"]              # the small model, then the strong one
    router = "/path/to/router"              # a folder written by `switchboard router train`
    target_strong_share = 0.3               # optional: recalibrate to this share of strong calls
    recalibrate_window = 500                # over each tenant's last 500 requests (0: never)

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

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from pathlib import Path

from routing.confidence import DEFAULT_QUANTILE, MEASURES
from routing.learned import LearnedRouter

AUTO = "auto"  # the model name that means "the tenant's default route"


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
    recalibrate_window: int = 0  # recent prompts per tenant the threshold is recalibrated on

    def __post_init__(self) -> None:
        where = f"route {self.name!r}"
        if len(self.tiers) != 2 or self.tiers[0] == self.tiers[1]:
            raise ValueError(f"{where}: a learned route has two tiers, the small model then the "
                             "strong one")
        share = self.target_strong_share
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError(f"{where}: target_strong_share must be in [0, 1], got {share}")
        if self.recalibrate_window < 0:
            raise ValueError(f"{where}: recalibrate_window must be >= 0")


Route = CascadeRoute | LearnedRoute
_CASCADE_KEYS = {"kind", "tiers", "thresholds", "threshold", "measure", "quantile", "prefix_tokens"}
_LEARNED_KEYS = {"kind", "tiers", "router", "target_strong_share", "recalibrate_window"}


def parse_routes(tables: dict[str, Any], served: Collection[str]) -> dict[str, Route]:
    """Routes from the config file's [routes.NAME] tables, checked against the served models."""
    routes: dict[str, Route] = {}
    for name, table in tables.items():
        if name in served:
            raise ValueError(f"route {name!r} has the name of a served model; rename one of them")
        if not isinstance(table, dict):
            raise ValueError(f"[routes.{name}] must be a table")
        kind = table.get("kind", "cascade")
        if kind not in ("cascade", "learned"):
            raise ValueError(f"[routes.{name}] kind must be \"cascade\" or \"learned\", got {kind!r}")
        known = _CASCADE_KEYS if kind == "cascade" else _LEARNED_KEYS
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"unknown keys in [routes.{name}]: {', '.join(unknown)}; known keys: "
                             f"{', '.join(sorted(known))}")
        tiers = tuple(table.get("tiers", ()))
        missing = [t for t in tiers if t not in served]
        if missing:
            raise ValueError(f"route {name!r} names models that are not served: "
                             f"{', '.join(missing)}")
        if kind == "learned":
            if "router" not in table:
                raise ValueError(f"[routes.{name}] needs router = \"<folder of switchboard router "
                                 "train>\"")
            routes[name] = LearnedRoute(
                name=name, tiers=tiers, router=LearnedRouter.load(Path(table["router"])),
                target_strong_share=table.get("target_strong_share"),
                recalibrate_window=int(table.get("recalibrate_window", 0)))
            continue
        thresholds = table.get("thresholds", table.get("threshold"))
        if isinstance(thresholds, (int, float)):
            thresholds = [thresholds] * max(len(tiers) - 1, 1)
        routes[name] = CascadeRoute(
            name=name, tiers=tiers, thresholds=tuple(float(t) for t in thresholds or ()),
            measure=table.get("measure", "quantile"),
            quantile=float(table.get("quantile", DEFAULT_QUANTILE)),
            prefix_tokens=int(table.get("prefix_tokens", 8)))
    return routes
