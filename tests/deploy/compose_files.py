"""Compose files as Docker Compose reads them, for the deployment tests (test support, not product code).

Follows the Compose Specification (compose-spec/compose-spec, "Interpolation" and "Merge and override"):

- loading: YAML with the two Compose tags ``!reset`` and ``!override`` (and YAML merge keys ``<<``);
- interpolation of values (never keys): ``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``${NAME-default}``,
  ``${NAME:?err}``, ``${NAME?err}``, ``${NAME:+alt}``, ``${NAME+alt}``, nested operands, ``$$`` for a
  literal ``$``; an unset variable without a default becomes the empty string; other shell forms
  (``${NAME/a/b}``) are refused;
- merging several ``-f`` files, each interpolated on its own first: mappings merge, sequences append,
  ``command``/``entrypoint``/``healthcheck.test`` are replaced, ``ports``/``volumes``/``secrets``/``configs``
  merge by their unique key, ``environment``/``labels`` merge by name in either syntax, ``!reset`` removes,
  ``!override`` replaces.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

# --- loading ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reset:
    """``!reset``: remove the attribute from the merged model."""

    value: Any


@dataclass(frozen=True)
class Override:
    """``!override``: replace instead of merging."""

    value: Any


class ComposeLoader(yaml.SafeLoader):  # type: ignore[misc]  # untyped without types-PyYAML
    """A SafeLoader that also knows Compose's ``!reset`` and ``!override``."""


def _tag(wrapper: type[Reset] | type[Override]) -> Callable[[yaml.SafeLoader, yaml.Node], object]:
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> object:
        if isinstance(node, yaml.MappingNode):
            return wrapper(loader.construct_mapping(node, deep=True))
        if isinstance(node, yaml.SequenceNode):
            return wrapper(loader.construct_sequence(node, deep=True))
        # A tagged scalar is read as if it had no tag: `!reset null` holds None, not "null".
        tag = loader.resolve(yaml.ScalarNode, node.value, (True, False))
        untagged = yaml.ScalarNode(tag, node.value, node.start_mark, node.end_mark)
        return wrapper(loader.construct_object(untagged))
    return construct


ComposeLoader.add_constructor("!reset", _tag(Reset))
ComposeLoader.add_constructor("!override", _tag(Override))


def parse_compose(text: str) -> dict[str, Any]:
    data = yaml.load(text, Loader=ComposeLoader)
    if not isinstance(data, dict):
        raise ValueError(f"a Compose file is a mapping, not {type(data).__name__}")
    return data


def load_compose(path: Path) -> dict[str, Any]:
    try:
        return parse_compose(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines and ``#`` comments (the subset the project's env files use: no quotes)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            env[name.strip()] = value.strip()
    return env


# --- interpolation ----------------------------------------------------------------------------------------

class InterpolationError(ValueError):
    pass


class Reference(NamedTuple):
    """One ``$NAME`` / ``${NAME<op><arg>}``; ``op`` is None without an operator, ``arg`` is unexpanded."""

    name: str
    op: str | None
    arg: str


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPERATORS = (":-", ":?", ":+", "-", "?", "+")


def _closing_brace(text: str, start: int) -> int:
    """Index of the ``}`` that closes the ``${`` opened just before ``start`` (nested ones skipped)."""
    depth, i = 1, start
    while i < len(text):
        pair = text[i:i + 2]
        if pair in ("${", "$$"):
            depth += pair == "${"
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise InterpolationError(f"unterminated ${{ in {text!r}")


def _braced(text: str, start: int) -> tuple[int, Reference]:
    end = _closing_brace(text, start + 2)
    body = text[start + 2:end]
    name = _NAME.match(body)
    rest = body[name.end():] if name else body
    op = next((o for o in _OPERATORS if rest.startswith(o)), None)
    if name is None or (rest and op is None):
        raise InterpolationError(f"invalid interpolation format: {text[start:end + 1]!r}")
    return end + 1, Reference(name.group(), op, rest[len(op):] if op else "")


def _scan(text: str) -> Iterator[tuple[int, int, Reference | None]]:
    """(start, end, reference) of each expression in ``text``; reference None for ``$$``."""
    i = 0
    while (start := text.find("$", i)) != -1:
        following = text[start + 1:start + 2]
        if following == "$":
            yield start, start + 2, None
            i = start + 2
        elif following == "{":
            i, reference = _braced(text, start)
            yield start, i, reference
        elif bare := _NAME.match(text, start + 1):
            i = bare.end()
            yield start, i, Reference(bare.group(), None, "")
        else:  # not a variable: the `$` stays
            i = start + 1


def _resolve(reference: Reference, env: Mapping[str, str]) -> str:
    name, op, arg = reference
    value = env.get(name)
    if op is None:
        return value or ""
    missing = value is None or (op.startswith(":") and value == "")
    if op.endswith("-"):
        return substitute(arg, env) if missing else str(value)
    if op.endswith("?"):
        if missing:
            raise InterpolationError(f"required variable {name} is missing a value: {substitute(arg, env)}")
        return str(value)
    return "" if missing else substitute(arg, env)  # `+`


def substitute(text: str, env: Mapping[str, str]) -> str:
    """``text`` with every expression replaced; raises InterpolationError for ``?`` on a missing value."""
    parts, last = [], 0
    for start, end, reference in _scan(text):
        parts += [text[last:start], "$" if reference is None else _resolve(reference, env)]
        last = end
    return "".join([*parts, text[last:]])


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """A loaded model with every string value substituted (mapping keys are left as they are)."""
    if isinstance(value, str):
        return substitute(value, env)
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if isinstance(value, Reset | Override):
        return type(value)(interpolate(value.value, env))
    return value


def variables(value: Any) -> Iterator[Reference]:
    """Every reference in a loaded model, those nested in operands included."""
    if isinstance(value, str):
        for _, _, reference in _scan(value):
            if reference is not None:
                yield reference
                yield from variables(reference.arg)
    elif isinstance(value, dict):
        for item in value.values():
            yield from variables(item)
    elif isinstance(value, list):
        for item in value:
            yield from variables(item)
    elif isinstance(value, Reset | Override):
        yield from variables(value.value)


# --- short syntax -----------------------------------------------------------------------------------------

class Mount(NamedTuple):
    source: str  # "" for an anonymous volume
    target: str
    read_only: bool


class Port(NamedTuple):
    host_ip: str  # "" for every address
    published: str  # "" when only exposed to other services
    target: str
    protocol: str


def volume_mount(entry: str | dict[str, Any]) -> Mount:
    """A service volume in short (``SOURCE:TARGET[:MODE]``, ``TARGET``) or long syntax."""
    if isinstance(entry, dict):
        return Mount(str(entry.get("source", "")), str(entry["target"]), bool(entry.get("read_only")))
    parts = entry.split(":")
    if len(parts) == 1:
        return Mount("", parts[0], False)
    return Mount(parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(","))


def port_spec(entry: str | int | dict[str, Any]) -> Port:
    """A service port in short (``[[IP:]PUBLISHED:]TARGET[/PROTOCOL]``) or long syntax."""
    if isinstance(entry, dict):
        published = entry.get("published")
        return Port(str(entry.get("host_ip", "")), str(published) if published else "", str(entry["target"]),
                    str(entry.get("protocol", "tcp")))
    text, _, protocol = str(entry).partition("/")
    parts = text.rsplit(":", 2)
    return Port(parts[0] if len(parts) == 3 else "", parts[-2] if len(parts) > 1 else "", parts[-1],
                protocol or "tcp")


def _file_target(entry: str | dict[str, Any]) -> str:
    """Unique key of a secret or config: its target, which defaults to its source."""
    return entry if isinstance(entry, str) else str(entry.get("target", entry["source"]))


# --- merge ------------------------------------------------------------------------------------------------

_DELETE = object()
#: Service attributes that a later file replaces instead of appending to ("Shell commands").
_REPLACED = {("command",), ("entrypoint",), ("healthcheck", "test")}
#: Service attributes modelled as sequences whose entries are unique by a key ("Unique resources").
_UNIQUE: dict[tuple[str, ...], Callable[[Any], object]] = {
    ("volumes",): lambda entry: volume_mount(entry).target,
    ("ports",): port_spec,  # {ip, target, published, protocol}
    ("secrets",): _file_target,
    ("configs",): _file_target,
}
#: Service attributes given as a mapping or as a list of ``NAME=value``: merged by name.
_NAMED = {("environment",), ("labels",), ("annotations",), ("build", "args"), ("build", "labels")}


def plain(value: Any) -> Any:
    """The model with ``!reset``/``!override`` replaced by their values (one file on its own)."""
    if isinstance(value, Reset | Override):
        return plain(value.value)
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def _as_mapping(value: dict[str, Any] | list[str]) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    pairs = (item.partition("=") for item in value)
    return {name: (text if sep else None) for name, sep, text in pairs}


def _merge_unique(base: list[Any], override: list[Any], key: Callable[[Any], object]) -> list[Any]:
    merged = list(base)
    where = {key(entry): i for i, entry in enumerate(merged)}
    for entry in plain(override):
        i = where.get(key(entry))
        if i is None:
            where[key(entry)] = len(merged)
            merged.append(entry)
        else:
            both = isinstance(merged[i], dict) and isinstance(entry, dict)
            merged[i] = merge(merged[i], entry) if both else entry
    return merged


def _merge_mapping(base: dict[str, Any], override: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    merged = dict(base)
    for name, item in override.items():
        value = merge(base.get(name), item, (*path, name))
        if value is _DELETE:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged


def merge(base: Any, override: Any, path: tuple[str, ...] = ()) -> Any:
    """``override`` (a later ``-f`` file, or part of one at ``path``) merged onto ``base``."""
    if isinstance(override, Reset):
        return _DELETE
    if isinstance(override, Override):
        return plain(override.value)
    attribute = path[2:] if path[:1] == ("services",) else ()
    if attribute in _NAMED and isinstance(base, dict | list) and isinstance(override, dict | list):
        base, override = _as_mapping(base), _as_mapping(override)
    if isinstance(override, dict) and isinstance(base, dict | None):
        return _merge_mapping(base or {}, override, path)
    if isinstance(base, list) and isinstance(override, list) and attribute not in _REPLACED:
        if attribute in _UNIQUE:
            return _merge_unique(base, override, _UNIQUE[attribute])
        return base + plain(override)
    return plain(override)


def load_model(paths: Sequence[Path], env: Mapping[str, str]) -> dict[str, Any]:
    """The model of ``docker compose -f A -f B config``: each file interpolated on its own, then merged."""
    model: dict[str, Any] = {}
    for path in paths:
        model = merge(model, interpolate(load_compose(path), env))
    return model
