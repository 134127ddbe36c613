"""Reading Triton model configurations (the JSON the Python backend hands to ``initialize``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def parameters(model_config: str | Mapping[str, Any]) -> dict[str, str]:
    """``parameters { key: "k" value { string_value: "v" } }`` as a plain dict."""
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def tensor_names(model_config: str | Mapping[str, Any], section: str) -> list[str]:
    """Names of the ``input`` or ``output`` tensors, in config order."""
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    return [tensor["name"] for tensor in config.get(section, [])]
