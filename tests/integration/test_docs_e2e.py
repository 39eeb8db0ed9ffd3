"""The docs' commands run against a real edge, and their links resolve.

The snippets of the pages in `RUN_PAGES` (the front page, docs/getting-started.md
and docs/simulated-node.md) are run against a real `iop-edge` process with its
embedded simulated node (what `make run` starts). The convention, for whoever
writes those pages:

- A fenced block is run when its info string is `sh`, `bash`, `console` or
  `python`; any other fence (`toml`, `ini`, `text`, none) is not.
- `sh` / `bash`: the whole block is one bash script (`set -eo pipefail`); it
  must exit 0.
- `console`: each line starting with `$ ` is a command (a line ending with
  `\\` continues on the next one); the lines after it, up to the next `$ `,
  are its expected output: the non-blank lines of what it prints must match
  them one for one, where `...` stands for any text. A command with no lines
  after it only has to exit 0.
- `python`: the block runs as a script (`__main__`) with this venv's Python,
  in a subprocess shared by the pages' Python snippets (one after the other,
  so the SDKs are imported once); it must end without an exception.
- HTML comments on the lines right above a fence steer it:
  `<!-- docs-test: skip -->` does not run it (it needs what the test cannot
  have: a model server, systemd, root); `<!-- docs-test: expect TEXT -->`
  also requires TEXT in what it prints.
- The snippets address the edge as `127.0.0.1:8080` (`make run`'s address);
  the test rewrites that to the address of the edge it started.

Every page's relative links (README.md and docs/*.md) must point at a file
that exists and, with a `#fragment`, at one of its headings (GitHub's anchors).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import trio

from tests.integration.edgeproc import edge_process

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUN_PAGES = ("README.md", "docs/getting-started.md", "docs/simulated-node.md")
DOCS_ADDRESS = "127.0.0.1:8080"
RUN_LANGUAGES = ("sh", "bash", "console", "python")
SNIPPET_TIMEOUT_S = 30.0
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(skip|expect\s+(.+?))\s*-->$")
_FENCE = re.compile(r"^(```+)\s*([\w-]*)")

CONFIG = """
[server]
listen = "127.0.0.1:0"

[[nodes]]
name = "embedded"
address = "embedded"
"""


@dataclass
class Snippet:
    """One fenced block of a page: where it is, its language, its text, its markers."""

    page: str
    line: int
    language: str
    text: str
    skip: bool = False
    expect: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.language})"


def snippets(page: Path) -> list[Snippet]:
    """Every fenced block of `page` (run or not), with the markers right above it."""
    lines = page.read_text().splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, language = opening.group(1), opening.group(2)
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        snippet = Snippet(page.name, start + 1, language, "\n".join(body) + "\n")
        above = start - 1
        while above >= 0 and (marker := _MARKER.match(lines[above].strip())):
            if marker.group(1) == "skip":
                snippet.skip = True
            else:
                snippet.expect.append(marker.group(2))
            above -= 1
        found.append(snippet)
    return found


def console_commands(text: str) -> list[tuple[str, list[str]]]:
    """The commands of a `console` block, each with the output lines shown after it."""
    commands: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            if lines[i].strip():
                raise AssertionError(f"console output before any command: {lines[i]!r}")
            i += 1
            continue
        command = [lines[i][2:]]
        while command[-1].endswith("\\") and i + 1 < len(lines):
            i += 1
            command.append(lines[i])
        i += 1
        expected: list[str] = []
        while i < len(lines) and not lines[i].startswith("$ "):
            if lines[i].strip():
                expected.append(lines[i].rstrip())
            i += 1
        commands.append(("\n".join(command), expected))
    return commands


def matches(expected: str, actual: str) -> bool:
    """`actual` is `expected` with each `...` standing for any text."""
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, actual.rstrip()) is not None


def _env() -> dict[str, str]:
    """This environment, with the venv's scripts first and no proxy for 127.0.0.1."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


async def _run(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    with trio.fail_after(SNIPPET_TIMEOUT_S):
        done = await trio.run_process(
            argv, cwd=cwd, env=_env(), capture_stdout=True, capture_stderr=True, check=False
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


# Runs each Python snippet (a file named on the command line) as `__main__` in this one
# interpreter, so that the SDKs are imported once, not once per snippet; prints, as JSON,
# each one's exit code and output.
_PYTHON_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
results = []
for path in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def check(
    snippet: Snippet, what: str, code: int, out: str, err: str, expected: list[str]
) -> list[str]:
    """What went wrong with one command of `snippet` (nothing: it did what the page shows)."""
    shown = f"{what}\nstdout: {out[-2000:]!r}\nstderr: {err[-2000:]!r}"
    if code != 0:
        return [f"{snippet.where}: exit {code}: {shown}"]
    failures: list[str] = []
    actual = [line for line in out.splitlines() if line.strip()]
    if expected and (
        len(actual) != len(expected)
        or not all(matches(e, a) for e, a in zip(expected, actual, strict=True))
    ):
        failures.append(f"{snippet.where}: output differs from {expected!r}: {shown}")
    failures += [
        f"{snippet.where}: {want!r} not in the output: {shown}"
        for want in snippet.expect
        if want not in out
    ]
    return failures


async def run_shell(snippet: Snippet, address: str, tmp: Path) -> list[str]:
    """A `sh`, `bash` or `console` snippet's failures."""
    text = snippet.text.replace(DOCS_ADDRESS, address)
    commands = console_commands(text) if snippet.language == "console" else [(text, [])]
    failures: list[str] = []
    for command, expected in commands:
        code, out, err = await _run(["bash", "-eo", "pipefail", "-c", command], tmp)
        failures += check(snippet, repr(command), code, out, err, expected)
    return failures


async def run_python(python: list[Snippet], address: str, tmp: Path) -> list[str]:
    """The `python` snippets' failures; they run one after the other in one subprocess."""
    paths: list[str] = []
    for snippet in python:
        script = tmp / f"{Path(snippet.page).stem}_{snippet.line}.py"
        script.write_text(snippet.text.replace(DOCS_ADDRESS, address))
        paths.append(str(script))
    code, out, err = await _run([sys.executable, "-c", _PYTHON_DRIVER, *paths], tmp)
    assert code == 0, f"the Python snippets' driver failed ({code}):\n{err}"
    results = json.loads(out)
    failures: list[str] = []
    for snippet, path, result in zip(python, paths, results, strict=True):
        failures += check(snippet, path, result["code"], result["stdout"], result["stderr"], [])
    return failures


def test_console_blocks_and_markers_are_read_as_documented(tmp_path: Path) -> None:
    """The convention itself: markers apply to the fence right below them, a console
    command may continue over lines, and `...` stands for any text."""
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- docs-test: skip -->\n```sh\nvllm serve m\n```\n\n"
        "<!-- docs-test: expect hi -->\n```python\nprint('hi')\n```\n\n"
        '```console\n$ curl -s a \\\n    -d b\n{"id":"x-..."}\n\n$ true\n```\n'
        "```toml\n[a]\n```\n"
    )
    found = snippets(page)
    assert [(s.language, s.skip, s.expect) for s in found] == [
        ("sh", True, []),
        ("python", False, ["hi"]),
        ("console", False, []),
        ("toml", False, []),
    ]
    assert console_commands(found[2].text) == [
        ("curl -s a \\\n    -d b", ['{"id":"x-..."}']),
        ("true", []),
    ]
    assert matches('{"id":"x-..."}', '{"id":"x-123"}')
    assert not matches('{"id":"x-..."}', '{"id":"y-123"}')


async def test_docs_snippets_run_against_a_real_edge(tmp_path: Path) -> None:
    """Every shell and Python snippet of the pages in RUN_PAGES not marked skip runs
    against a real edge (embedded simulated node) and does what the page shows."""
    todo: list[Snippet] = []
    for name in RUN_PAGES:
        runnable = [s for s in snippets(ROOT / name) if s.language in RUN_LANGUAGES]
        assert [s for s in runnable if not s.skip], f"{name}: no snippet is run"
        todo += runnable
    run = [s for s in todo if not s.skip]
    assert len(run) >= 5, [s.where for s in run]  # curl and an SDK for each API, at least
    # A snippet shown on two pages (the front page repeats getting-started's) runs once.
    distinct = list({(s.language, s.text, tuple(s.expect)): s for s in reversed(run)}.values())
    python = [s for s in distinct if s.language == "python"]
    shell = [s for s in distinct if s.language != "python"]
    failures: list[str] = []

    async def collect(run: Callable[[], Awaitable[list[str]]]) -> None:
        failures.extend(await run())

    async with edge_process(tmp_path, CONFIG) as edge:
        address = edge.url.removeprefix("http://")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, partial(run_python, python, address, tmp_path))
            for snippet in shell:  # each a few curl calls: one after the other
                await collect(partial(run_shell, snippet, address, tmp_path))
    assert not failures, "\n\n".join(sorted(failures))


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`+[^`]*`+")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of `page` (outside fenced blocks)."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if fenced or heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def test_docs_links_resolve() -> None:
    """Each relative link of README.md and docs/*.md names a file that exists, and a
    heading of it when it has a #fragment; the docs index lists every page."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken: list[str] = []
    for page in pages:
        fenced = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
            if fenced:
                continue
            for target in _LINK.findall(_CODE_SPAN.sub("", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                path, _, fragment = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(ROOT)}:{number}: {target}"
                if not file.exists():
                    broken.append(f"{where}: no such file")
                elif fragment and fragment not in anchors(file):
                    broken.append(f"{where}: no such heading")
    assert not broken, "\n".join(broken)
    index = (DOCS / "README.md").read_text()
    unlisted = [p.name for p in DOCS.glob("*.md") if p.name != "README.md" and p.name not in index]
    assert not unlisted, f"docs/README.md does not list {unlisted}"
