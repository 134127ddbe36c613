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
               example: dict[str, Any] | None = None) -> dict[str, Any]:
    """``openapi_extra`` for a body of files (name -> several allowed) plus form fields, or JSON."""
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
            "schema": {"type": "object", "properties": properties, "required": list(files)},
        },
        "application/json": json_content,
    }}}
