"""tests/deploy/compose_files.py against small inline Compose files, with the results the Compose
Specification gives ("Interpolation", "Merge and override"; the examples there are used where it has
them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy.compose_files import (
    InterpolationError,
    Mount,
    Override,
    Port,
    Reference,
    Reset,
    interpolate,
    load_model,
    merge,
    parse_compose,
    plain,
    port_spec,
    read_env_file,
    substitute,
    variables,
    volume_mount,
)

ENV = {"SET": "v", "EMPTY": ""}


def test_interpolation_rules() -> None:
    text = "${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $$SET ${SET:+alt} $SET"
    assert substitute(text, ENV) == "v d  d $SET alt v"
    with pytest.raises(InterpolationError):
        substitute("${EMPTY:?no}", ENV)
    assert substitute("${EMPTY?no}", ENV) == ""


@pytest.mark.parametrize(("text", "expected"), [
    ("${SET}x/$SET/x$SET", "vx/v/xv"),
    ("$SETx|${UNSET}|$UNSET", "||"),  # a bare name runs on; unset without default: empty
    ("${SET-d}${EMPTY-d}${UNSET-d}", "vd"),
    ("${SET:-d}${EMPTY:-d}${UNSET:-d}", "vdd"),
    ("${SET+a}${EMPTY+b}${UNSET+c}", "ab"),
    ("${SET:+a}${EMPTY:+b}${UNSET:+c}", "a"),
    ("${SET?e}${EMPTY?e}", "v"),
    ("${UNSET:-a b: c}", "a b: c"),
])
def test_substitution_operators(text: str, expected: str) -> None:
    assert substitute(text, ENV) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("$$", "$"), ("$${SET}", "${SET}"), ("$$$SET", "$v"), ("$$$$SET", "$$SET"),
    ("a $ b", "a $ b"), ("$1 5$ $-", "$1 5$ $-"),  # not a variable: kept as written
])
def test_dollar_escape(text: str, expected: str) -> None:
    assert substitute(text, ENV) == expected


def test_nested_operands_are_expanded_only_when_used() -> None:
    assert substitute("${UNSET:-${SET}}", ENV) == "v"
    assert substitute("${UNSET:-${UNSET2:-deep}}/x", ENV) == "deep/x"
    assert substitute("${SET:+[${SET}]}", ENV) == "[v]"
    assert substitute("${SET:-${UNSET?never evaluated}}", ENV) == "v"
    assert substitute("${UNSET:-$${SET}}", ENV) == "${SET}"
    with pytest.raises(InterpolationError, match="UNSET is missing a value: needs v"):
        substitute("${UNSET?needs $SET}", ENV)


def test_required_variables_stop_with_their_message() -> None:
    for text in ("${UNSET:?set UNSET in .env}", "${EMPTY:?set UNSET in .env}", "${UNSET?set UNSET in .env}"):
        with pytest.raises(InterpolationError, match=r"is missing a value: set UNSET in \.env"):
            substitute(text, ENV)


@pytest.mark.parametrize("text", ["${SET/a/b}", "${SET:=d}", "${}", "${1A}", "${SET", "${SET:-${A}"])
def test_unsupported_or_broken_forms_are_refused(text: str) -> None:
    with pytest.raises(InterpolationError):
        substitute(text, ENV)


def test_values_are_interpolated_not_keys() -> None:
    model = {"labels": {"$SET": "$SET"}, "n": 5, "flag": True, "list": ["${SET}", 1], "r": Reset("${SET}"),
             "o": Override(["$SET"])}
    assert interpolate(model, ENV) == {"labels": {"$SET": "v"}, "n": 5, "flag": True, "list": ["v", 1],
                                       "r": Reset("v"), "o": Override(["v"])}


def test_variables_lists_every_reference() -> None:
    model = {"a": "${A:-${B}} $$C $D", "b": [Reset("${E:?msg}")], "c": {"$KEY": 1}}
    assert list(variables(model)) == [Reference("A", ":-", "${B}"), Reference("B", None, ""),
                                      Reference("D", None, ""), Reference("E", ":?", "msg")]


def test_loading_knows_compose_tags_and_yaml_merge_keys() -> None:
    model = parse_compose("""
x-common: &common
  restart: unless-stopped
services:
  app:
    <<: *common
    image: app:1
    deploy: !reset {}
    ports: !override ["8443:443"]
    command: !reset null
""")
    app = model["services"]["app"]
    assert app == {"restart": "unless-stopped", "image": "app:1", "deploy": Reset({}),
                   "ports": Override(["8443:443"]), "command": Reset(None)}
    assert plain(app)["deploy"] == {} and plain(app)["ports"] == ["8443:443"]


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just text"])
def test_loading_refuses_what_is_not_a_mapping(text: str) -> None:
    with pytest.raises(ValueError, match="mapping"):
        parse_compose(text)


def test_env_file(tmp_path: Path) -> None:
    path = tmp_path / ".env"
    path.write_text("# comment\n\nA=1\n B = two words \nURL=http://x/?a=b\nEMPTY=\n")
    assert read_env_file(path) == {"A": "1", "B": "two words", "URL": "http://x/?a=b", "EMPTY": ""}


def test_short_syntax() -> None:
    assert volume_mount("data:/var/lib/x") == Mount("data", "/var/lib/x", False)
    assert volume_mount("./conf:/etc/x:ro,z") == Mount("./conf", "/etc/x", True)
    assert volume_mount("/cache") == Mount("", "/cache", False)
    assert volume_mount({"type": "bind", "source": "./a", "target": "/a", "read_only": True}) == \
        Mount("./a", "/a", True)
    assert port_spec("127.0.0.1:8000:80") == Port("127.0.0.1", "8000", "80", "tcp")
    assert port_spec("8000:80/udp") == Port("", "8000", "80", "udp")
    assert port_spec(9000) == Port("", "", "9000", "tcp")
    assert port_spec("[::1]:53:53") == Port("[::1]", "53", "53", "tcp")
    assert port_spec({"target": 80, "published": 8080, "host_ip": "0.0.0.0"}) == \
        Port("0.0.0.0", "8080", "80", "tcp")


def _service(**attributes: Any) -> dict[str, Any]:
    return {"services": {"foo": attributes}}


def test_merge_follows_compose_rules() -> None:
    """The specification's own examples, one per rule."""
    assert merge(_service(key1="value1", key2="value2"), _service(key2="VALUE", key3="value3")) == \
        _service(key1="value1", key2="VALUE", key3="value3")
    assert merge(_service(dns=["1.1.1.1"]), _service(dns=["8.8.8.8"])) == _service(dns=["1.1.1.1", "8.8.8.8"])
    assert merge(_service(command=["echo", "foo"]), _service(command=["echo", "bar"])) == \
        _service(command=["echo", "bar"])
    assert merge(_service(volumes=["foo:/work"]), _service(volumes=["bar:/work"])) == \
        _service(volumes=["bar:/work"])
    base = _service(image="myapp", ports=["8080:80"], environment={"FOO": "BAR"})
    reset = _service(image="myapp", ports=Reset([]), environment={"FOO": Reset(None)})
    assert merge(base, reset) == _service(image="myapp", environment={})
    assert merge(base, _service(ports=Override(["8443:443"])))["services"]["foo"]["ports"] == ["8443:443"]
    assert merge(base, _service(ports=["8443:443"]))["services"]["foo"]["ports"] == ["8080:80", "8443:443"]


def test_merge_replaces_shell_commands_only() -> None:
    base = _service(entrypoint=["a"], healthcheck={"test": ["CMD", "a"], "interval": "5s"}, cap_add=["X"])
    over = _service(entrypoint=["b"], healthcheck={"test": ["CMD", "b"]}, cap_add=["Y"])
    assert merge(base, over) == _service(entrypoint=["b"], cap_add=["X", "Y"],
                                         healthcheck={"test": ["CMD", "b"], "interval": "5s"})
    assert merge({"x-list": [1]}, {"x-list": [2]}) == {"x-list": [1, 2]}
    assert merge({"x-test": {"test": [1]}}, {"x-test": {"test": [2]}}) == {"x-test": {"test": [1, 2]}}


def test_merge_unique_resources_by_key() -> None:
    ports = merge(_service(ports=["8080:80", "9000:90"]),
                  _service(ports=["127.0.0.1:8080:80", "8080:80/udp", {"target": 90, "published": "9000"}]))
    assert ports == _service(ports=["8080:80", {"target": 90, "published": "9000"}, "127.0.0.1:8080:80",
                                    "8080:80/udp"])
    volumes = merge(_service(volumes=[{"type": "volume", "source": "a", "target": "/d"}, "/tmp"]),
                    _service(volumes=[{"target": "/d", "read_only": True}, "b:/tmp"]))
    assert volumes == _service(volumes=[{"type": "volume", "source": "a", "target": "/d", "read_only": True},
                                        "b:/tmp"])
    secrets = merge(_service(secrets=["token", {"source": "a", "target": "t"}]),
                    _service(secrets=[{"source": "token", "mode": 0o400}, {"source": "b", "target": "t"}]))
    assert secrets == _service(secrets=[{"source": "token", "mode": 0o400}, {"source": "b", "target": "t"}])


def test_merge_environment_and_labels_by_name_in_either_syntax() -> None:
    merged = merge(_service(environment={"A": "1", "B": "2"}, labels=["x=1"], build={"args": ["V=1"]}),
                   _service(environment=["B=3", "C"], labels={"y": "2"}, build={"args": {"V": "2"}}))
    assert merged == _service(environment={"A": "1", "B": "3", "C": None}, labels={"x": "1", "y": "2"},
                              build={"args": {"V": "2"}})
    assert merge(_service(environment=["A=1"]), {}) == _service(environment=["A=1"])


def test_reset_and_override_in_a_new_or_absent_place() -> None:
    assert merge(_service(image="a"), _service(ports=Reset([]))) == _service(image="a")
    assert merge({}, _service(image="b", volumes=Reset([]), deploy=Override({"x": 1}))) == \
        _service(image="b", deploy={"x": 1})
    assert merge(_service(deploy={"a": 1, "b": 2}), _service(deploy=Override({"c": [Override(3)]}))) == \
        _service(deploy={"c": [3]})


def test_load_model_interpolates_each_file_then_merges(tmp_path: Path) -> None:
    (tmp_path / "base.yml").write_text(
        "services:\n  app:\n    image: app:${TAG:-1}\n    ports: ['${PORT:?set PORT}:80']\n"
        "    environment: {A: $$A}\n    deploy: {replicas: 2}\n")
    (tmp_path / "over.yml").write_text(
        "services:\n  app:\n    deploy: !reset {}\n    ports: ['${PORT}:80', '9090:90']\n"
        "    environment: ['B=${TAG:-none}']\n")
    model = load_model([tmp_path / "base.yml", tmp_path / "over.yml"], {"PORT": "8080"})
    assert model["services"]["app"] == {"image": "app:1", "ports": ["8080:80", "9090:90"],
                                        "environment": {"A": "$A", "B": "none"}}
    with pytest.raises(InterpolationError, match="set PORT"):
        load_model([tmp_path / "base.yml"], {})
    assert load_model([tmp_path / "base.yml"], {"PORT": "1"})["services"]["app"]["deploy"] == {"replicas": 2}
