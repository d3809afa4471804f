"""The router's OpenAPI document: FastAPI's routes plus what the request handlers validate by
hand — the request bodies (vLLM's request models, as the router checks them), this deployment's
model name, limits and arms, the routing headers and the OpenAI error shape.

Built from the live config, so a client or a fuzzer (schemathesis) sees the contract in force.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from specserve import headers
from specserve.config.schema import LoadedConfig, RouterConfig

REF = "#/components/schemas/{model}"
ERROR = "ErrorResponse"
BEARER = "apiKey"
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}
_ERROR_STATUSES = {
    "400": "Invalid request: the message names the field",
    "401": "Missing or wrong API key (where keys are configured)",
    "403": "Forcing an arm needs an admin key",
    "404": "Unknown model",
    "408": "The request body arrived too slowly",
    "413": "Request body too large",
    "429": "The arm is overloaded, or the API key over its rate limit: retry after "
    "`Retry-After` seconds",
    "503": "The arm is not running, its engine failed, or the service is shutting down",
}


def openapi_document(
    app: FastAPI, loaded: LoadedConfig, bodies: dict[str, type[BaseModel]]
) -> dict[str, Any]:
    """The document for a config (its revision is the document's version); `bodies` maps each
    POST path to the model its body is validated with."""
    config = loaded.config
    doc = get_openapi(title="specserve", version=loaded.revision, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas[ERROR] = _ERROR_SCHEMA
    doc["components"]["securitySchemes"] = {
        BEARER: {"type": "http", "scheme": "bearer", "description": "An API key"}
    }
    for path, model in bodies.items():
        schema = model.model_json_schema(ref_template=REF, mode="validation")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = _narrowed(schema, config)
        operation = doc["paths"][path]["post"]
        operation["parameters"] = _routing_headers(config)
        operation["security"] = [{BEARER: []}]
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
        operation["responses"] = {
            "200": {
                "description": "The completion, or a `text/event-stream` when `stream` is true",
                "content": {"application/json": {}, "text/event-stream": {}},
            },
            **{
                status: {
                    "description": text,
                    "content": {"application/json": {"schema": {"$ref": REF.format(model=ERROR)}}},
                }
                for status, text in _ERROR_STATUSES.items()
            },
        }
    return doc


def _narrowed(schema: dict[str, Any], config: RouterConfig) -> dict[str, Any]:
    """vLLM's body schema with what this router adds: the model is required and is this one,
    the token and choice counts are bounded by `limits`, every chat message has a role and a
    completion has a prompt."""
    properties = dict(schema["properties"])
    properties["model"] = {"type": "string", "enum": [config.model.name]}
    limits = config.limits
    for key, most in (
        ("max_tokens", limits.max_tokens),
        ("max_completion_tokens", limits.max_tokens),
        ("n", limits.max_n),
    ):
        if key in properties:
            bounded = {"type": "integer", "minimum": 1, "maximum": most}
            properties[key] = {"anyOf": [bounded, {"type": "null"}]}
    required = {*schema.get("required", ()), "model"}
    if "messages" in properties:
        # vLLM admits a loosely typed message; the router requires every message's role.
        role = {"type": "string"}
        with_role = {"type": "object", "required": ["role"], "properties": {"role": role}}
        items = properties["messages"].get("items", {})
        properties["messages"] = {
            **properties["messages"],
            "items": {"allOf": [items, with_role]},
        }
    if "prompt" in properties:
        # Prompt embeddings are not enabled on the arms' engines: a prompt is required.
        required.add("prompt")
    return {**schema, "properties": properties, "required": sorted(required)}


def _routing_headers(config: RouterConfig) -> list[dict[str, Any]]:
    return [
        {
            "name": headers.ARM_OVERRIDE,
            "in": "header",
            "required": False,
            "description": "Serve this request on this arm (any configured arm, weight 0 too); "
            "needs an admin key where keys are configured",
            "schema": {"type": "string", "enum": [arm.name for arm in config.arms]},
        },
        {
            "name": config.routing.session_header,
            "in": "header",
            "required": False,
            "description": "Sticky key: the same key is served by the same arm",
            "schema": {"type": "string"},
        },
    ]
