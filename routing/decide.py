"""Learned-route decisions, with each tenant's threshold recalibrated on its own recent traffic.

A router's saved threshold sends its calibration target's share of *its calibration prompts* to
the strong model. A tenant whose prompts are harder or easier than those would see another share;
with a target share (the tenant's own, else the route's) and a window, the threshold becomes the
score that puts that share of the tenant's last `window` prompts above it, as RouteLLM recalibrates
on fresh traffic. Until a tenant has MIN_RECENT prompts, the router's own threshold applies.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from routing.learned import threshold_for_share
from routing.routes import LearnedRoute
from store import Tenant

MIN_RECENT = 20
# The (route, tenant) windows a process keeps, the least recently used dropped past it: tenants
# deleted (or made anew, a new incarnation) would otherwise keep theirs for the process's life.
MAX_WINDOWS = 10_000


@dataclass(frozen=True)
class LearnedDecision:
    tier: int  # 0: the small model, 1: the strong one
    score: float
    threshold: float


class LearnedRouting:
    """Decisions of learned routes, and the recent scores they are recalibrated on (per process)."""

    def __init__(self, max_windows: int = MAX_WINDOWS) -> None:
        self._recent: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()
        self._max_windows = max_windows

    def decide(self, route: LearnedRoute, tenant: Tenant, score: float) -> LearnedDecision:
        """Pick the tier for a prompt of `tenant` the route's router scored `score`."""
        threshold = route.router.settings.threshold
        share = tenant.strong_share if tenant.strong_share is not None else route.target_strong_share
        if route.recalibrate_window > 0:
            recent = self._window(route, tenant)
            recent.append(score)
            if share is not None and len(recent) >= min(MIN_RECENT, route.recalibrate_window):
                threshold = threshold_for_share(list(recent), share)
        return LearnedDecision(1 if score >= threshold else 0, score, threshold)

    def _window(self, route: LearnedRoute, tenant: Tenant) -> deque[float]:
        key = (route.name, tenant.incarnation)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = deque(maxlen=route.recalibrate_window)
            if len(self._recent) > self._max_windows:
                self._recent.popitem(last=False)
        self._recent.move_to_end(key)
        return recent
