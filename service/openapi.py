"""OpenAPI request bodies for routes that take images as multipart uploads or base64 JSON."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_FILE = {"type": "string", "format": "binary"}


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """Replace local ``$ref``s by their definitions (the body is not a components schema)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return _inline(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


def image_body(json_model: type[BaseModel], files: dict[str, bool],
               fields: dict[str, dict[str, Any]] | None = None,
               example: dict[str, Any] | None = None, required: tuple[str, ...] | None = None
               ) -> dict[str, Any]:
    """``openapi_extra`` for a body of files (name -> several allowed) plus form fields, or JSON; the form
    requires ``required`` (default: every file; () where any one of them will do)."""
    json_schema = json_model.model_json_schema()
    properties: dict[str, Any] = {
        name: {"type": "array", "items": _FILE} if several else _FILE for name, several in files.items()
    }
    properties.update(fields or {})
    json_content: dict[str, Any] = {"schema": _inline(json_schema, json_schema.get("$defs", {}))}
    if example:
        json_content["example"] = example
    return {"requestBody": {"required": True, "content": {
        "multipart/form-data": {
            "schema": {"type": "object", "properties": properties,
                       "required": list(files if required is None else required)},
        },
        "application/json": json_content,
    }}}


#: The error body of each API the app serves, by path prefix (the v1 API's is the default), as its routes
#: answer: ours (service/errors.py), CompreFace's (service/compreface.py), DeepStack's (routers/deepstack.py).
_ERROR_BODIES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("/api/v1/", "CompreFaceError", {
        "type": "object", "required": ["message", "code"],
        "properties": {"message": {"type": "string"},
                       "code": {"type": "integer",
                                "description": "CompreFace's error code (docs/compat.md)"}}}),
    ("/v1/vision/", "DeepStackError", {
        "type": "object", "required": ["success", "error"],
        "properties": {"success": {"type": "boolean", "enum": [False]},
                       "error": {"type": "string",
                                 "description": "the message, our stable code in parentheses"},
                       "code": {"type": "integer", "description": "the HTTP status"}}}),
)
_OURS = "Error"
_RESPONSES = {"4XX": "Refused; the body says why (on the v1 API `code` is stable: docs/api.md, Errors)",
              "5XX": "A failure on the service's side (503 carries Retry-After)"}


def with_error_responses(schema: dict[str, Any], error_body: dict[str, Any]) -> dict[str, Any]:
    """The app's OpenAPI with the error bodies its routes really send.

    FastAPI declares a 422 ``HTTPValidationError`` (``{"detail": [...]}``) on every route that validates
    parameters, and no other error; the v1 API answers ``{"code", "message", "details"}`` for every 4xx and
    5xx (validation included), the compatible APIs their own bodies (and CompreFace a 400, not a 422, for
    validation). Each operation gets ``4XX`` and ``5XX`` responses with its API's body instead; responses a
    route declares itself (the readiness 503) are kept."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components[_OURS] = error_body
    for _, name, body in _ERROR_BODIES:
        components[name] = body
    for path, operations in schema.get("paths", {}).items():
        name = next((name for prefix, name, _ in _ERROR_BODIES if path.startswith(prefix)), _OURS)
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            body = responses.get("422", {}).get("content", {}).get("application/json", {})
            if body.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                del responses["422"]
            for status, description in _RESPONSES.items():
                responses.setdefault(status, {"description": description, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema
