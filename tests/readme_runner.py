"""Reading README.md and the pages of docs/ for ``tests/test_readme.py``: sections, code blocks, commands,
tables, links and anchors, curl calls; plus a real gateway (uvicorn in a thread) for the curl examples to
run against.

Nothing here knows what the pages say: the tests decide what must hold.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from tests import ROOT

README = "README.md"

_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_HEADING = re.compile(r"^## (?!#)(.+?)[ \t]*$", re.M)
_INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # an inline span may wrap onto the next line
_COMMAND = re.compile(r"(?:\.venv/bin/)?python3? -m ([A-Za-z_][\w.]*)(.*)")
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_ANY_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def page_text(name: str = README) -> str:
    """A page of the repository by its path from the root (``README.md``, ``docs/api.md``)."""
    return (ROOT / name).read_text(encoding="utf-8")


def readme_text() -> str:
    return page_text(README)


def sections(text: str) -> dict[str, str]:
    """``## Title`` -> its text up to the next ``## `` heading (``###`` sub-sections stay inside)."""
    # Headings inside code blocks are not headings: blank the blocks out while locating them.
    masked = _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets
    heads = list(_HEADING.finditer(masked))
    out = {}
    for head, following in zip(heads, [*heads[1:], None], strict=True):
        out[head.group(1)] = text[head.end(): following.start() if following else len(text)]
    return out


def section(text: str, title: str) -> str:
    found = sections(text)
    assert title in found, f"the page has no '## {title}' section (sections: {list(found)})"
    return found[title]


@dataclass(frozen=True)
class CodeBlock:
    lang: str
    body: str


def code_blocks(text: str, lang: str | None = None) -> list[CodeBlock]:
    """Fenced code blocks in order; ``lang`` filters on the info string (``""``: plain blocks)."""
    blocks = [CodeBlock(m.group(1), m.group(2)) for m in _FENCE.finditer(text)]
    return [b for b in blocks if lang is None or b.lang == lang]


def prose(text: str) -> str:
    """The text without its fenced code blocks."""
    return _FENCE.sub("", text)


def logical_lines(script: str) -> list[str]:
    """Shell lines with backslash continuations joined, blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", script)
    return [line.strip() for line in joined.splitlines() if line.strip()]


def strip_comment(line: str) -> str:
    """A shell line without its trailing comment (the README writes them as ``  # ...``)."""
    return re.sub(r"\s+#\s.*$", "", line).strip()


def comment_of(line: str) -> str:
    match = re.search(r"\s+#\s(.*)$", line)
    return match.group(1).strip() if match else ""


@dataclass(frozen=True)
class Command:
    """A ``python -m module [subcommand] ...`` the README shows (in a block or inline)."""

    module: str
    subcommand: str | None
    text: str  # the whole command, continuations joined, comment stripped
    options: tuple[str, ...]


def python_commands(text: str, subcommand_modules: Mapping[str, set[str]]) -> list[Command]:
    """Every ``python -m`` command of the README: block lines and inline code spans.

    ``subcommand_modules`` maps a module with sub-commands to their names, so that ``python -m export
    inspect x.onnx`` is (``export``, ``inspect``) and ``python -m gallery --help`` is (``gallery``, None).
    """
    candidates = [strip_comment(line) for b in code_blocks(text) for line in logical_lines(b.body)]
    candidates += [" ".join(span.split()) for span in _INLINE.findall(prose(text))]
    out = []
    for candidate in candidates:
        match = _COMMAND.search(candidate)
        if not match:
            continue
        module, rest = match.group(1), match.group(2)
        words = rest.split()
        sub = words[0] if words and words[0] in subcommand_modules.get(module, set()) else None
        out.append(Command(module, sub, match.group(0).strip(), tuple(_OPTION.findall(rest))))
    return out


def table(text: str) -> list[dict[str, str]]:
    """The first Markdown table of ``text`` as rows keyed by its header cells (backticks kept)."""
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    header, separator, *body = rows
    assert all(set(cell) <= set("-: ") for cell in separator), f"not a table separator: {separator}"
    return [dict(zip(header, row, strict=True)) for row in body]


def unquote_code(cell: str) -> str:
    """``\\`value\\``` -> ``value``; other cells unchanged."""
    match = re.fullmatch(r"`([^`]*)`", cell.strip())
    return match.group(1) if match else cell.strip()


def relative_links(text: str) -> list[str]:
    """Targets of Markdown links that point into the repository (no scheme, no pure anchor)."""
    return [path for path, _ in local_links(text) if path]


def local_links(text: str) -> list[tuple[str, str]]:
    """``(path, anchor)`` of every Markdown link without a scheme; ``path`` is empty for ``(#anchor)``."""
    targets = [t for t in _LINK.findall(prose(text)) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]
    return [(path, anchor) for path, _, anchor in (t.partition("#") for t in targets)]


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of ``text``: lower case, punctuation dropped, spaces -> ``-``."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in _ANY_HEADING.findall(prose(text))}


# --- curl -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CurlCall:
    method: str
    path: str  # the URL path after $BASE, variables left as they are, e.g. /v1/collections/staff/faces/$FACE
    query: tuple[str, ...]  # query parameter names


def curl_calls(script: str) -> list[CurlCall]:
    """Every ``curl`` of a script: its method (``-X``, else POST with ``-d``/``-F``, else GET) and URL."""
    calls = []
    for line in logical_lines(script):
        for start in re.finditer(r"(?<![\w-])curl\s", line):
            command = line[start.end():].split("|", 1)[0]
            words = re.findall(r"\"[^\"]*\"|'[^']*'|\S+", command)
            words = [w[1:-1] if len(w) > 1 and w[0] in "'\"" and w[-1] == w[0] else w for w in words]
            url = next(w for w in words if w.startswith("$BASE"))
            method = words[words.index("-X") + 1] if "-X" in words else (
                "POST" if {"-d", "-F", "--data", "--form"} & set(words) else "GET")
            path, _, query = url.removeprefix("$BASE").partition("?")
            names = tuple(p.split("=", 1)[0] for p in query.split("&") if p)
            calls.append(CurlCall(method.upper(), path, names))
    return calls


def openapi_route(paths: Mapping[str, object], path: str) -> str | None:
    """The OpenAPI path template that ``path`` (literal segments or ``$VAR``) instantiates, if any."""
    for template in paths:
        pattern = re.sub(r"\\\{[^/]+?\\\}", r"[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            return template
    return None


CURL_WRAPPER = r"""
# Every curl of the README fails the script on an HTTP status >= 400, printing the body; each call and
# its response are appended to $README_CURL_LOG for the test's checks.
curl() {
  printf '\n>>> curl %.300s\n' "$*" >>"$README_CURL_LOG"
  command curl --fail-with-body --show-error -w '\n' "$@" | tee -a "$README_CURL_LOG"
}
"""


def curl_script(blocks: list[str], base_url: str) -> str:
    """The README's sh blocks as one strict script against ``base_url`` (the ``BASE=`` line replaced)."""
    body = "\n".join(blocks)
    body, count = re.subn(r"^BASE=\S+[ \t]*$", f"BASE={shlex.quote(base_url)}", body, flags=re.M)
    assert count == 1, f"expected exactly one 'BASE=...' line in the REST examples, found {count}"
    header = "set -euo pipefail\nshopt -s inherit_errexit\nset -x\n"
    return header + CURL_WRAPPER + body + "\n"


def curl_log(text: str) -> list[tuple[str, str]]:
    """``(arguments, response body)`` of each call recorded by the curl wrapper."""
    entries = []
    for chunk in text.split("\n>>> curl ")[1:]:
        args, _, body = chunk.partition("\n")
        entries.append((args, body.strip()))
    return entries


# --- processes ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(app: FastAPI, timeout: float = 60.0, host: str = "127.0.0.1") -> Iterator[str]:
    """Run ``app`` with uvicorn on a free port in a background thread (listening on ``host``: "0.0.0.0" for
    every address of this machine); yields its base URL on the loopback address."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, name="readme-gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive(), "the gateway stopped during start-up (see the log above)"
        assert time.monotonic() < deadline, f"the gateway did not start within {timeout} s"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def run(args: list[str] | str, cwd: Path, env: Mapping[str, str] | None = None,
        timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run a command (a list, or a bash script when a string) and capture its output."""
    command = ["bash", "-c", args] if isinstance(args, str) else args
    return subprocess.run(command, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, check=False)


def explain(result: subprocess.CompletedProcess[str], limit: int = 6000) -> str:
    return (f"exit {result.returncode}\n--- stdout (tail) ---\n{result.stdout[-limit:]}"
            f"\n--- stderr (tail) ---\n{result.stderr[-limit:]}")
