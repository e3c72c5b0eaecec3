"""PathRoute: one route per path, for every method the path answers.

Starlette answers a request whose path a route matches, but not its method, with the 405 of the
first such route, whose Allow header lists that route's methods only: with a Route per method,
PUT /admin/tenants/x would say `Allow: GET, HEAD` though PATCH and DELETE work there. One route per
path makes the 405 list every method of the path, as RFC 9110 asks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

Endpoint = Callable[[Request], Awaitable[Response]]


class PathRoute(Route):
    """The endpoints of one path by HTTP method; each endpoint's `__name__` names its operation
    (in the OpenAPI document). HEAD runs GET's endpoint, as a Starlette Route does."""

    def __init__(self, path: str, endpoints: Mapping[str, Endpoint]):
        self.endpoints = {method.upper(): endpoint for method, endpoint in endpoints.items()}

        async def dispatch(request: Request) -> Response:
            # NOTE: only a method of `endpoints`, or HEAD with GET there: Route.handle answers
            # the others' 405.
            endpoint = self.endpoints.get(request.method) or self.endpoints["GET"]
            return await endpoint(request)

        super().__init__(path, dispatch, methods=list(self.endpoints))
