"""The OpenAPI 3.1 document of the gateway, built from its route table.

Every route appears, summarised by the first line of its endpoint's docstring; request bodies
get JSON schemas generated from their msgspec Structs, so the document cannot drift from them.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from gateway.adapter_api import UPLOAD_FORM_SCHEMA, UPLOAD_PATHS
from gateway.admin import TenantCreate, TenantUpdate
from gateway.errors import ErrorResponse
from gateway.path_route import PathRoute
from gateway.protocol import ChatCompletionRequest, CompletionRequest

_REQUEST_BODIES: dict[tuple[str, str], type[msgspec.Struct]] = {
    ("POST", "/v1/completions"): CompletionRequest,
    ("POST", "/v1/chat/completions"): ChatCompletionRequest,
    ("POST", "/admin/tenants"): TenantCreate,
    ("PATCH", "/admin/tenants/{tenant}"): TenantUpdate,
}
_PUBLIC_PATHS = {"/health", "/openapi.json"}
_REF_TEMPLATE = "#/components/schemas/{name}"
_CONVERTOR = re.compile(r"{(\w+):\w+}")


def openapi_document(routes: list[BaseRoute], version: str) -> dict[str, Any]:
    """The OpenAPI document describing every route in `routes`."""
    bodies = sorted(set(_REQUEST_BODIES.values()), key=lambda t: t.__name__)
    body_schemas, components = msgspec.json.schema_components([*bodies, ErrorResponse],
                                                              ref_template=_REF_TEMPLATE)
    body_refs = dict(zip(bodies, body_schemas))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, PathRoute):
            continue
        for method in sorted(route.endpoints):
            operation = _operation(route, method)
            body = _REQUEST_BODIES.get((method, route.path))
            if body is not None:
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": body_refs[body]}},
                }
            elif method == "POST" and route.path in UPLOAD_PATHS:
                operation["requestBody"] = {
                    "required": True,
                    "content": {"multipart/form-data": {"schema": UPLOAD_FORM_SCHEMA}},
                }
            paths.setdefault(openapi_path(route.path), {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Switchboard", "version": version,
                 "description": "OpenAI-compatible multi-model LLM gateway."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def openapi_path(path: str) -> str:
    """A route's path as an OpenAPI template: "{model:path}" is "{model}" there."""
    return _CONVERTOR.sub(r"{\1}", path)


# Endpoints that answer 201 Created (a tenant, a key, an adapter version).
_CREATING_ENDPOINTS = {"create_tenant", "create_key", "upload_adapter", "admin_upload_adapter"}
_SENTENCE_END = re.compile(r"(?<=\.)\s")  # where a docstring's first sentence ends


def _operation(route: PathRoute, method: str) -> dict[str, Any]:
    endpoint = route.endpoints[method]
    name = endpoint.__name__
    doc = (endpoint.__doc__ or name).strip()
    first_paragraph = " ".join(doc.split("\n\n")[0].split())
    created = name in _CREATING_ENDPOINTS
    operation: dict[str, Any] = {
        "summary": _SENTENCE_END.split(first_paragraph, maxsplit=1)[0],
        "operationId": f"{method.lower()}_{name}",
        "responses": {
            "201" if created else "200": {"description": "Created" if created else "OK"},
            "default": {
                "description": "An error, in OpenAI's error shape",
                "content": {"application/json": {"schema": {"$ref": _REF_TEMPLATE.format(
                    name="ErrorResponse")}}},
            },
        },
    }
    if route.path not in _PUBLIC_PATHS:
        operation["security"] = [{"bearer": []}]
    if route.param_convertors:
        operation["parameters"] = [{"name": name, "in": "path", "required": True,
                                    "schema": {"type": "string"}}
                                   for name in route.param_convertors]
    return operation


async def openapi_json(request: Request) -> Response:
    """This document: every route of the gateway with its request schema."""
    document = openapi_document(request.app.routes, request.app.state.version)
    return Response(msgspec.json.encode(document), media_type="application/json")
