"""README.md and the pages of docs/ that hold commands are true to the code: a newcomer can follow them.

- the README stays a map (at most 200 lines) that links every page of docs/;
- docs/configuration.md's table lists exactly the environment variables ``Settings`` accepts, with its
  defaults; docs/api.md's limits, scores and error codes are the code's;
- the REST examples (the README's API at a glance, docs/api.md's walk-through) run, in the order written,
  each as one strict bash script against a real gateway on the real Triton (any HTTP status >= 400 fails
  it) and every route they use is in the OpenAPI document;
- every ``python -m ...`` command of these pages exits 0 on ``--help`` and knows the options given it; the
  gallery, import, model-export and benchmark commands run (on temporary data, never the repository's);
- ``make run`` / ``make test`` are what CI runs, the start-up banner is what ``python -m service`` prints,
  and every relative link, anchor and repository path these pages name exists.

Commands that write files run in a temporary folder that links the repository's ``.venv``, ``export/``
and ``artifacts/`` (the pages' relative paths resolve as in a checkout), so nothing in the checkout
changes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from bench.calibration import build_parser as calibration_parser
from bench.gpu import build_parser as gpu_parser
from export.__main__ import parser as export_parser
from facecore.settings import GallerySettings, GatewaySettings
from gallery.__main__ import parser as gallery_parser
from recognition.__main__ import parser as recognition_parser
from service.app import create_app
from tests import ROOT
from tests.readme_runner import (
    README,
    Command,
    CurlCall,
    anchors,
    code_blocks,
    comment_of,
    curl_calls,
    curl_log,
    curl_script,
    explain,
    free_port,
    local_links,
    logical_lines,
    openapi_route,
    page_text,
    prose,
    python_commands,
    readme_text,
    relative_links,
    run,
    section,
    serve,
    strip_comment,
    table,
    unquote_code,
)

if TYPE_CHECKING:
    from export.defaults import DefaultModels
    from service.launcher import TritonServer

DEFAULT_FPIR = GallerySettings().default_fpir
ADMIN_KEY = "readme-admin-key-0123456789abcdef"
API, CONFIGURATION, DEVELOPMENT = "docs/api.md", "docs/configuration.md", "docs/development.md"
GALLERY, IMPORT, MODELS = "docs/gallery.md", "docs/import.md", "docs/models.md"
#: The pages whose commands, links and paths are checked: the README and the docs/ pages the project keeps
#: true to the code (docs/benchmarks/, gallery-scale, gpu-plan, compat and calibration report runs and
#: designs, and have tests of their own where they hold commands).
PAGES = (README, API, CONFIGURATION, GALLERY, IMPORT, MODELS, DEVELOPMENT, "docs/deploy.md",
         "docs/architecture.md")
AT_A_GLANCE = "The API at a glance"


def _subcommands(parser: Any) -> set[str]:
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(action.choices)


SUBCOMMANDS = {"export": _subcommands(export_parser()), "gallery": _subcommands(gallery_parser()),
               "recognition": _subcommands(recognition_parser()),
               "bench.gpu": _subcommands(gpu_parser()),
               "bench.calibration": _subcommands(calibration_parser())}


@pytest.fixture(scope="module")
def text() -> str:
    return readme_text()


def workdir(folder: Path, *links: str) -> Path:
    """A scratch folder standing in for the checkout: ``links`` point at the repository's own."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in links:
        (folder / name).symlink_to(ROOT / name)
    return folder


def lines_of(text: str, title: str, pattern: str) -> list[str]:
    """The logical sh lines of section ``title`` that match ``pattern`` (comments kept)."""
    return [line for block in code_blocks(section(text, title), "sh") for line in logical_lines(block.body)
            if re.search(pattern, line)]


# --- 1. configuration --------------------------------------------------------------------------------

def settings_variables() -> dict[str, object]:
    """``FACEREC_...`` variable -> the code's default (``...`` when required)."""
    out: dict[str, object] = {}
    for name, field in GatewaySettings.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and is_dataclass(annotation):  # limits, quality: plain dataclasses
            for sub in fields(annotation):
                out[f"FACEREC_{name.upper()}__{sub.name.upper()}"] = getattr(field.get_default(), sub.name)
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            section_default = None if field.is_required() else field.get_default(call_default_factory=True)
            for sub, sub_field in annotation.model_fields.items():
                variable = f"FACEREC_{name.upper()}__{sub.upper()}"
                if section_default is not None:
                    out[variable] = getattr(section_default, sub)
                else:
                    out[variable] = ... if sub_field.is_required() else sub_field.get_default()
        else:
            out[f"FACEREC_{name.upper()}"] = ... if field.is_required() else field.get_default()
    return out


def as_readme_value(value: object) -> str:
    if value is None or value == "":
        return "(none)"
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_configuration_table_is_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = table(section(page_text(CONFIGURATION), "Environment variables"))
    readme = {unquote_code(row["variable"]): unquote_code(row["default"]) for row in rows}
    assert all(row["meaning"].strip() for row in rows), "a configuration row without a meaning"
    assert len(readme) == len(rows), "a variable is listed twice"
    code = settings_variables()
    assert sorted(readme) == sorted(code), (
        f"{CONFIGURATION} lists {sorted(set(readme) - set(code))} that GatewaySettings ignores and misses "
        f"{sorted(set(code) - set(readme))}")
    for variable, default in code.items():
        if default is ...:
            assert readme[variable] == "(required)", f"{variable}: required in the code"
            continue
        documented = readme[variable].replace("<repo>", str(ROOT))
        assert documented == as_readme_value(default), (
            f"{variable}: documented default {readme[variable]!r}, code default {as_readme_value(default)!r}")
    assert readme["FACEREC_SECURITY__ADMIN_KEY"] == "(required)"
    # The documented variables really are read: one nested and one top-level, from the environment.
    monkeypatch.setenv("FACEREC_LIMITS__MAX_K", "7")
    monkeypatch.setenv("FACEREC_LOG_LEVEL", "DEBUG")
    settings = GatewaySettings(security={"admin_key": ADMIN_KEY})
    assert (settings.limits.max_k, settings.log_level) == (7, "DEBUG")


def test_limits_and_scores_prose_matches_the_code() -> None:
    text = page_text(API)
    limits = GatewaySettings(security={"admin_key": ADMIN_KEY}).limits
    stated = " ".join(section(text, "Limits").split())
    expected = (f"Request body {limits.max_upload_bytes // 2**20} MiB, "
                f"{limits.max_pixels // 10**6} megapixels, {limits.max_faces} faces per image, "
                f"{limits.max_batch_images} images per batch call, "
                f"top-k ≤ {limits.max_k}, {limits.request_timeout_s:g} s per request")
    assert expected in stated, f"the Limits section differs from the defaults: expected {expected!r}"
    assert limits.max_upload_bytes % 2**20 == 0 and limits.max_pixels % 10**6 == 0
    sface = tomllib.loads((ROOT / "export" / "specs" / "sface_2021dec.toml").read_text())["model"]
    threshold = sface["match_threshold"]
    words = " ".join(section(text, "Scores, thresholds, unknown").split())
    assert f"SFace: {threshold}," in words, "the SFace threshold differs from its spec"
    assert ("`confidence` is the probability that the candidate is the person and not a stranger's "
            "look-alike") in words
    assert f'`{{"fpir": {DEFAULT_FPIR}}}`' in words, "the default policy differs from the settings'"


def test_error_codes_exist_in_the_code() -> None:
    rows = table(section(page_text(API), "Errors"))
    codes = {c for row in rows for c in re.findall(r"`([a-z_]+)`", row["codes"])}
    assert len(codes) >= 20
    sources = "\n".join(p.read_text() for folder in ("service", "gallery", "recognition")
                        for p in (ROOT / folder).rglob("*.py"))
    missing = sorted(c for c in codes if f'"{c}"' not in sources)
    assert not missing, f"error codes in {API} that the code never returns: {missing}"


# --- 2. REST examples ----------------------------------------------------------------------------------

def rest_blocks(text: str) -> list[str]:
    """docs/api.md's walk-through: every sh block of its Examples section."""
    blocks = [b.body for b in code_blocks(section(text, "Examples"), "sh")]
    assert len(blocks) >= 8, f"{API} lost its examples"
    return blocks


def glance_blocks(text: str) -> list[str]:
    """The README's API at a glance: the sh blocks of that section that call the API."""
    blocks = [b.body for b in code_blocks(section(text, AT_A_GLANCE), "sh") if "curl " in b.body]
    assert blocks, "the README lost its API at a glance"
    return blocks


def test_curl_routes_are_in_the_openapi_document(text: str) -> None:
    app = create_app(GatewaySettings(security={"admin_key": ADMIN_KEY}))  # the schema needs no lifespan
    paths = app.openapi()["paths"]
    api = page_text(API)
    calls = curl_calls("\n".join(rest_blocks(api) + glance_blocks(text)))
    # ... and the operations named in the prose: `GET /health/live`, `GET /metrics`.
    calls += [CurlCall(method, path, ()) for method, path in
              re.findall(r"`(GET|POST|PATCH|PUT|DELETE) (/[^`\s]*)`", prose(api + text))]
    assert len(calls) >= 38
    for call in calls:
        template = openapi_route(paths, call.path)
        assert template is not None, f"{call.method} {call.path}: no such route in the OpenAPI document"
        operation = paths[template].get(call.method.lower())
        assert operation is not None, f"{call.method} {call.path}: {template} has no {call.method}"
        parameters = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
        unknown = set(call.query) - parameters
        assert not unknown, f"{call.method} {call.path}: query parameters {unknown} not in {template}"
    # The prose's options: identify's `?threshold=`, enroll's `face=largest` or a `box`.
    identify = paths["/v1/collections/{collection}/identify"]["post"]
    assert "`?threshold=`" in api and "threshold" in {p["name"] for p in identify["parameters"]}
    enroll = paths["/v1/collections/{collection}/identities/{external_id}/faces"]["post"]
    assert "`face=largest`" in api and "a `box`" in api
    for content in enroll["requestBody"]["content"].values():
        fields = content["schema"]["properties"]
        assert "largest" in fields["face"]["enum"] and "box" in fields, fields


class CurlRun:
    """The sh blocks of a page run in order against a real gateway, and what each curl answered."""

    def __init__(self, blocks: list[str], triton: TritonServer, photos: dict[str, Path], tmp_path: Path,
                 **settings: Any) -> None:
        # The pages' relative paths (data/admin_key, artifacts/photos) as in a checkout after `make run`.
        cwd = tmp_path / "checkout"
        (cwd / "artifacts").mkdir(parents=True)
        (cwd / "artifacts" / "photos").symlink_to(photos["obama.jpg"].parent)
        (cwd / "data").mkdir()
        (cwd / "data" / "admin_key").write_text(ADMIN_KEY + "\n")
        log = tmp_path / "curl.log"
        log.touch()
        gateway = GatewaySettings(security={"admin_key": ADMIN_KEY}, triton={"url": triton.grpc_url},
                                  database={"url": f"sqlite:///{tmp_path / 'gallery.db'}"},
                                  gallery={"snapshot_dir": tmp_path / "index"}, **settings)
        with serve(create_app(gateway)) as base:
            self.result = run(curl_script(blocks, base), cwd, {"README_CURL_LOG": str(log)}, timeout=120)
        assert self.result.returncode == 0, explain(self.result)
        self.calls = curl_log(log.read_text())
        expected = len(curl_calls("\n".join(blocks)))
        assert len(self.calls) == expected, f"{len(self.calls)} curl calls ran, the page has {expected}"

    def response(self, fragment: str, method: str = "") -> Any:
        """The JSON response of the first call whose arguments contain ``fragment`` (and ``-X method``;
        GET: no ``-X``, ``-d`` nor ``-F``)."""
        def matches(args: str) -> bool:
            if method == "GET":
                return not re.search(r"(^| )-[XdF] ", args)
            return not method or f"-X {method} " in args
        found = [body for args, body in self.calls if fragment in args and matches(args)]
        assert found, f"no {method or 'call'} with {fragment!r} ran"
        return json.loads(found[0])


@pytest.mark.triton
def test_api_examples_run_in_order(triton: TritonServer, photos: dict[str, Path], tmp_path: Path) -> None:
    ran = CurlRun(rest_blocks(page_text(API)), triton, photos, tmp_path)
    response, calls, result = ran.response, ran.calls, ran.result
    assert response("/v1/collections -H", "POST")["name"] == "staff"
    assert response("/identities -H", "POST")["metadata"] == {"team": "44"}
    assert response("/identities/obama -H", "PATCH")["name"] == "Barack H. Obama"
    assert response("create=true")["identity"]["name"] == "Joe Biden"
    assert len(response("/identities/obama/faces -H", "GET")) == 2  # obama.jpg, then obama3.jpg as base64
    identified = response("identify?k=3")["faces"]
    assert len(identified) == 1 and identified[0]["decision"] == "match", identified
    assert identified[0]["identity"]["external_id"] == "obama"
    batch = response("identify/batch")["results"]
    assert [item["result"] is not None for item in batch] == [True, True], batch
    assert response("/v1/verify")["same"] is True
    assert response("/obama/verify")["same"] is True
    assert len(response("/v1/detect")["faces"]) == 6
    assert response("/health/ready")["ready"] is True
    metrics = next(body for args, body in calls if "/metrics" in args)
    assert re.search(r"^facerec_", metrics, re.M)
    assert '"decision":"match"' in result.stdout
    deletes = [body for args, body in calls if "DELETE" in args]
    assert len(deletes) == 4 and not any(deletes), "the DELETEs answer 204 without a body"


@pytest.mark.triton
def test_api_at_a_glance_runs_in_order(
    text: str, triton: TritonServer, photos: dict[str, Path], tmp_path: Path
) -> None:
    """The README's one example per capability, the DeepStack API served on the collection its comment
    names."""
    blocks = glance_blocks(text)
    named = re.search(r"FACEREC_DEEPSTACK__COLLECTION=(\w+)", "\n".join(blocks))
    assert named, "the DeepStack example no longer says which setting it needs"
    ran = CurlRun(blocks, triton, photos, tmp_path, deepstack={"collection": named.group(1)})
    enrolled = ran.response("/identities/obama/faces?create=true")
    assert enrolled["identity"]["name"] == "Barack Obama" and len(enrolled["faces"]) == 2, enrolled
    identified = ran.response("identify?k=3")["faces"]
    assert [(f["decision"], f["identity"]["external_id"]) for f in identified] == [("match", "obama")]
    assert ran.response("/v1/verify")["same"] is True
    assert len(ran.response("/v1/detect")["faces"]) == 6
    searched = ran.response("/search?k=3")
    # the other photo of the same person: a possible duplicate
    assert searched["decision"] == "match" and searched["identity"]["external_id"] == "obama", searched
    subjects = ran.response("/api/v1/recognition/recognize")["result"][0]["subjects"]
    assert subjects[0]["subject"] == "obama", subjects
    predictions = ran.response("/v1/vision/face/recognize")["predictions"]
    assert [p["userid"] for p in predictions] == ["obama"], predictions
    assert ran.response("/health/ready")["ready"] is True


# --- 3. other commands ----------------------------------------------------------------------------------

def test_make_targets_are_what_ci_runs(text: str) -> None:
    first = code_blocks(text)[0].body
    assert re.search(r"^make run\b", first, re.M) and re.search(r"^make test\b", first, re.M), first
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), ".ci/run does not run `make test`"
    makefile = (ROOT / "Makefile").read_text()
    for target in ("run", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"no `{target}` target in the Makefile"
    # `make run accepts PORT=8080 and TRITON_PORTS="8000 8001 8002"`: the Makefile's defaults, passed on.
    configuration = page_text(CONFIGURATION)
    port = re.search(r"`PORT=(\d+)`", configuration)
    ports = re.search(r'`TRITON_PORTS="([\d ]+)"`', configuration)
    assert port and ports
    assert re.search(rf"^PORT \?= {port.group(1)}$", makefile, re.M)
    assert re.search(rf"^TRITON_PORTS \?= {ports.group(1)}$", makefile, re.M)
    assert re.search(r"^run:.*\n\t.*-m service --port \$\(PORT\) --triton-ports \$\(TRITON_PORTS\)",
                     makefile, re.M)


#: Commands the pages name whose options stand apart from the command (`--latest` to undo ...).
EXTRA_OPTIONS = {("service", None): {"--triton-url"}, ("export", "pin"): {"--latest"},
                 ("service.launcher", None): set(), ("export", None): set()}


def page_commands() -> dict[tuple[str, str | None], set[str]]:
    """Every ``python -m`` command of the checked pages, by (module, sub-command), with the options shown."""
    commands: dict[tuple[str, str | None], set[str]] = {}
    for command in python_commands("\n".join(page_text(name) for name in PAGES), SUBCOMMANDS):
        commands.setdefault((command.module, command.subcommand), set()).update(command.options)
    for key, options in EXTRA_OPTIONS.items():
        commands.setdefault(key, set()).update(options)
    return commands


def test_every_python_command_has_help_with_its_options() -> None:
    commands = page_commands()
    for needed in [("export", "inspect"), ("export", "pin"), ("export", "repository"),
                   ("gallery", None), ("recognition", "import"), ("service", None),
                   ("bench.gallery", None), ("bench.enroll", None)]:
        assert needed in commands, f"no page shows python -m {' '.join(filter(None, needed))} any more"

    def help_of(key: tuple[str, str | None]) -> subprocess.CompletedProcess[str]:
        module, sub = key
        return run([sys.executable, "-m", module, *([sub] if sub else []), "--help"], ROOT, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        helps = dict(zip(commands, pool.map(help_of, commands), strict=True))
    for (module, sub), options in commands.items():
        name = f"python -m {module}{' ' + sub if sub else ''}"
        result = helps[(module, sub)]
        assert result.returncode == 0, f"{name} --help: {explain(result)}"
        missing = sorted(o for o in options - {"--help"} if not re.search(rf"{o}\b", result.stdout))
        assert not missing, f"{name} --help does not know {missing}:\n{result.stdout}"
    # The sub-commands docs/gallery.md lists beside `python -m gallery --help` are the real ones.
    listed = [comment_of(line) for line in lines_of(page_text(GALLERY), "Commands", r"-m gallery --help")]
    assert listed and set(re.split(r",\s*", listed[0])) == SUBCOMMANDS["gallery"], listed


@pytest.mark.triton
def test_gallery_commands_run(triton: TritonServer, photos: dict[str, Path], tmp_path: Path) -> None:
    """docs/import.md's commands, then docs/gallery.md's, line by line as written, on a scratch database and
    a small people/ tree."""
    cwd = workdir(tmp_path / "checkout", ".venv")
    for person, names in {"obama": ["obama.jpg", "obama2.jpg"], "biden": ["biden.jpg"]}.items():
        (cwd / "people" / person).mkdir(parents=True)
        for name in names:
            shutil.copy(photos[name], cwd / "people" / person / name)
    shutil.copy(photos["obama3.jpg"], cwd / "obama3.jpg")
    (cwd / "people.csv").write_text("path,external_id,name\nobama3.jpg,obama,Barack Obama\n")

    lines = lines_of(page_text(IMPORT), "Run it", r".") + lines_of(page_text(GALLERY), "Commands", r".")
    assert all("-m gallery " in line or "-m recognition import " in line for line in lines), lines
    script = "\n".join(lines)
    assert "--url 127.0.0.1:8001" in script
    script = script.replace("--url 127.0.0.1:8001", f"--url {triton.grpc_url}")
    env = {"FACEREC_DATABASE__URL": f"sqlite:///{tmp_path / 'gallery.db'}",
           "FACEREC_GALLERY__SNAPSHOT_DIR": str(tmp_path / "index"),
           "FACEREC_TRITON__URL": triton.grpc_url}  # for the lines that rely on the default --url
    result = run("set -euo pipefail\nset -x\n" + script, cwd, env, timeout=180)
    assert result.returncode == 0, explain(result)

    report = (cwd / "import-report.csv").read_text()
    assert report.count("imported") == 3, report
    assert "ready: 1" in result.stdout, result.stdout  # the manifest's dry run
    assert "re-embedded 3 faces of staff" in result.stdout, result.stdout
    assert list((tmp_path / "index").iterdir()), "rebuild wrote no snapshot"


def bring_your_own_embedder(toml_file: Path, onnx_file: Path, default_models: DefaultModels) -> None:
    """What the user does after `cp arcface_r50_example.toml my_arcface.toml`: set onnx, tensor names,
    sizes and threshold. Here the "own" model is the default SFace ONNX under another name."""
    values = tomllib.loads(toml_file.read_text())["model"]
    sface = default_models.embedder
    values.update(onnx=str(onnx_file), input_name=sface.input_name, output_names=list(sface.output_names),
                  mean=list(sface.mean), std=list(sface.std), embedding_dim=sface.embedding_dim,
                  match_threshold=sface.match_threshold)
    toml_file.write_text("[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))


def test_bring_your_own_model_commands_run(cpu_repository: Path, default_models: DefaultModels,
                                           tmp_path: Path) -> None:
    """docs/models.md's "your own ArcFace" block in a scratch checkout holding the default CPU repository."""
    cwd = workdir(tmp_path / "checkout", ".venv", "export", "artifacts")
    shutil.copytree(cpu_repository, cwd / "model_repository" / "cpu")
    own = tmp_path / "w600k_r50.onnx"
    shutil.copy(default_models.embedder_file, own)
    lines = lines_of(page_text(MODELS), "Your own ArcFace (512-d) or RetinaFace R50", r".")
    assert lines and any("-m export repository" in line for line in lines), lines
    script = "\n".join(lines)
    assert "/path/to/w600k_r50.onnx" in script and "my_arcface.toml" in script
    script = script.replace("/path/to/w600k_r50.onnx", str(own))
    # Run up to the copy of the example description, edit it as the user would, then run the rest.
    head, tail = re.split(r"(?<=my_arcface\.toml)[^\n]*\n", script, maxsplit=1)
    first = run(f"set -euo pipefail\n{head}", cwd)
    assert first.returncode == 0, explain(first)
    assert "input  data" in first.stdout and "output fc1" in first.stdout, first.stdout  # `inspect`
    bring_your_own_embedder(cwd / "my_arcface.toml", own, default_models)
    second = run(f"set -euo pipefail\n{tail}", cwd)
    assert second.returncode == 0, explain(second)

    command = next(strip_comment(line) for line in lines if "-m export repository" in line)
    out = re.search(r"--out (\S+)", command)
    version = re.search(r"--version (\d+)", command)
    assert out, command
    served = cwd / out.group(1)
    assert not served.is_symlink() and served.resolve().is_relative_to(cwd.resolve())
    number = version.group(1) if version else "1"
    assert (served / "face_embedder" / number / "model.onnx").read_bytes() == own.read_bytes()
    assert "arcface_r50" in (served / "face_embedder" / "config.pbtxt").read_text()


def test_rollout_and_pin_commands_run(cpu_repository: Path, default_models: DefaultModels,
                                      tmp_path: Path) -> None:
    """`Roll out with --version N, roll back with python -m export pin ... --version 1 (and --latest)`."""
    cwd = tmp_path
    (cwd / "model_repository").mkdir()
    shutil.copytree(cpu_repository, cwd / "model_repository" / "cpu")
    own = tmp_path / "sface_v2.onnx"
    shutil.copy(default_models.embedder_file, own)
    spec = tmp_path / "sface_v2.toml"
    shutil.copy(ROOT / "export" / "specs" / "sface_2021dec.toml", spec)
    bring_your_own_embedder(spec, own, default_models)
    detector = tmp_path / "detector.toml"
    detector.write_text((ROOT / "export" / "specs" / "retinaface_mnet025.toml").read_text()
                        + f"onnx = {json.dumps(str(default_models.detector_file))}\n")
    python = [sys.executable, "-m", "export"]
    rollout = run([*python, "repository", "--profile", "cpu", "--detector", str(detector),
                   "--embedder", str(spec), "--out", "model_repository/cpu", "--version", "2"], cwd)
    assert rollout.returncode == 0, explain(rollout)

    pins = [c for c in python_commands(page_text(MODELS), SUBCOMMANDS)
            if (c.module, c.subcommand) == ("export", "pin")]
    assert pins, f"{MODELS} no longer shows `python -m export pin`"
    pin = pins[0].text.split()[2:]  # after `python -m`
    assert pin[:2] == ["export", "pin"] and "--version" in pin, pin
    config = cwd / "model_repository" / "cpu" / "face_embedder" / "config.pbtxt"
    result = run([sys.executable, "-m", *pin], cwd)
    assert result.returncode == 0, explain(result)
    assert re.search(r"specific \{\s*versions: 1\s*\}", config.read_text()), config.read_text()
    latest = [*pin[: pin.index("--version")], "--latest"]
    result = run([sys.executable, "-m", *latest], cwd)
    assert result.returncode == 0, explain(result)
    assert re.search(r"latest \{\s*num_versions: 1\s*\}", config.read_text()), config.read_text()

    # Why docs/models.md writes an ArcFace into a repository of its own: other tensors than the SFace
    # already served cannot be a version beside it.
    arcface = tmp_path / "arcface.toml"
    arcface.write_text((ROOT / "export" / "specs" / "arcface_r50_example.toml").read_text()
                       .replace("/path/to/w600k_r50.onnx", str(own)))
    refused = run([*python, "repository", "--detector", str(detector), "--embedder", str(arcface),
                   "--out", "model_repository/cpu", "--version", "3"], cwd)
    assert refused.returncode != 0 and "needs a new repository" in refused.stderr, explain(refused)


@pytest.mark.triton
def test_service_prints_the_banner_the_readme_shows(text: str, triton: TritonServer, tmp_path: Path) -> None:
    """`make run` runs `python -m service`; here with --triton-url (the README's own option) instead of the
    bundled Triton, and the admin key file in a scratch folder standing for <repo>/data/."""
    banner = code_blocks(text, "")[0].body
    assert "API docs:" in banner, banner
    port = free_port()
    key_file = tmp_path / "data" / "admin_key"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACEREC_")}
    env |= {"FACEREC_DATABASE__URL": f"sqlite:///{tmp_path / 'gallery.db'}",
            "FACEREC_GALLERY__SNAPSHOT_DIR": str(tmp_path / "index")}
    output = tmp_path / "service.out"
    with output.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", str(port), "--triton-url", triton.grpc_url,
             "--admin-key-file", str(key_file)], cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, output.read_text()
            try:
                if httpx.get(f"{base}/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, output.read_text()
            time.sleep(0.2)
        key = key_file.read_text().strip()
        assert len(key) >= 16 and key_file.stat().st_mode & 0o777 == 0o600
        assert httpx.get(f"{base}/v1/collections", headers={"X-API-Key": key}).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        rc = process.wait(timeout=60)
    printed = output.read_text()
    assert rc == 0, printed
    for line in banner.strip("\n").splitlines():
        expected = line.replace("<repo>", str(tmp_path)).replace(":8080", f":{port}").rstrip()
        assert expected in printed.splitlines(), f"README shows {expected!r}; the service printed:\n{printed}"


# --- 4. links and paths -------------------------------------------------------------------------------

#: Paths the pages name that a checkout has only after `make run` / `make test` or that the user makes.
GENERATED = ("data/", "artifacts/", "people/", "people.csv", "my_", "import-report.csv", "r50.onnx",
             "r100.onnx", "model_repository/cpu", "model_repository/gpu", "model_repository/arcface",
             "model_repository/ngc-cpu", "deploy/k8s/secrets.env")


@pytest.mark.parametrize("name", PAGES)
def test_relative_links_and_named_paths_exist(name: str) -> None:
    text = page_text(name)
    folder = (ROOT / name).parent
    for path, anchor in local_links(text):
        target = (folder / path).resolve() if path else ROOT / name
        assert target.exists(), f"{name} links to {path}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target.read_text()), f"{name} links to {path}#{anchor}: no such heading"
    tops = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} | {".ci"}
    named = {span for span in re.findall(r"`([^`\s]+)`", prose(text))
             if "/" in span and span.split("/", 1)[0] in tops and not span.startswith(GENERATED)
             and "*" not in span}  # a glob (`tests/service/test_api_*.py`) names several files
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{name} names paths that do not exist: {missing}"


def test_readme_is_a_map_to_every_page(text: str) -> None:
    """The README stays short and a newcomer finds every page of docs/ from it."""
    assert len(text.splitlines()) <= 200, "README.md is a map: its manuals belong in docs/"
    linked = {(ROOT / path).resolve() for path in relative_links(text)}
    pages = {p.resolve() for p in (ROOT / "docs").glob("*.md")} | {(ROOT / "docs" / "benchmarks").resolve()}
    assert not pages - linked, f"README.md does not link {sorted(str(p) for p in pages - linked)}"
    assert {"docs/calibration.md", "docs/deploy.md", "docs/benchmarks/"} <= set(relative_links(text))


def test_readme_helpers_parse_what_they_claim() -> None:
    """The parsers the tests above rely on, on a small example (a broken parser would pass vacuously)."""
    sample = ("# T\n## A\n```sh\nBASE=http://x\ncurl -s -X POST \"$BASE/v1/a?k=3\" \\\n  -F x=@y  # c\n"
              "K=$(curl -s $BASE/v1/b | python3 -c 'x')\n```\n### Sub\n`python -m export pin --model\nm "
              "--latest` [l](docs/x.md)\n## B\n| variable | default |\n|---|---|\n| `V` | `1` |\n")
    assert list(code_blocks(sample)) and section(sample, "A").count("```") == 2
    calls = curl_calls(section(sample, "A"))
    assert [(c.method, c.path, c.query) for c in calls] == [("POST", "/v1/a", ("k",)), ("GET", "/v1/b", ())]
    commands: list[Command] = python_commands(sample, SUBCOMMANDS)
    assert [(c.module, c.subcommand, c.options) for c in commands] == [
        ("export", "pin", ("--model", "--latest"))]
    assert table(section(sample, "B")) == [{"variable": "`V`", "default": "`1`"}]
    assert relative_links(sample) == ["docs/x.md"]
    script = curl_script([code_blocks(sample)[0].body], "http://y")
    assert "\nBASE=http://y\n" in script and "BASE=http://x" not in script


@pytest.mark.parametrize("line", [
    "curl -s $BASE/missing",
    "X=$(curl -s $BASE/missing | python3 -c 'import sys; sys.stdin.read(); print(1)')",
    "printf '{}' | curl -s -X POST $BASE/missing -d @-",
    "curl -s $BASE/missing | grep -c detail",
])
def test_curl_wrapper_fails_the_script_on_http_errors(line: str, tmp_path: Path) -> None:
    """An example answered 404 stops the script with the body shown, even with -s, in a command
    substitution or in a pipe; a 200 goes through."""
    app = FastAPI()

    @app.get("/ok")
    def ok() -> dict[str, str]:
        return {"ok": "yes"}

    log = tmp_path / "curl.log"
    with serve(app) as base:
        env = {"README_CURL_LOG": str(log)}
        good = run(curl_script(["BASE=http://127.0.0.1:8080\ncurl -s $BASE/ok\n"], base), tmp_path, env)
        script = curl_script([f"BASE=http://127.0.0.1:8080\n{line}\necho NOT-REACHED\n"], base)
        bad = run(script, tmp_path, env)
    assert good.returncode == 0 and '{"ok":"yes"}' in good.stdout, explain(good)
    assert bad.returncode != 0 and "NOT-REACHED" not in bad.stdout, explain(bad)
    assert '{"detail":"Not Found"}' in bad.stdout + bad.stderr + log.read_text(), explain(bad)
    assert "404" in bad.stderr, explain(bad)
