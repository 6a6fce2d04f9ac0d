"""The docs say what is true: every runnable example of README.md and docs/*.md runs against a
real `tessera serve` (one for all of them) and prints what the page shows; every relative link
and anchor resolves; the README stays a front page."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.doc_examples import (
    REPO,
    Example,
    anchors_of,
    doc_pages,
    examples_in,
    fenced_blocks,
    output_matches,
)

KEY = "key-docs"
EXAMPLES = [example for page in doc_pages() for example in examples_in(page)]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tessera serve` as the README starts it, on free ports, with one API key."""

    def __init__(self, tmp: Path) -> None:
        self.grpc_port, self.http_port = _free_port(), _free_port()
        self.env = {**os.environ, "TMPDIR": str(tmp),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                os.environ.get("PYTHONPATH")])),
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                             os.environ.get("PATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "serve", "--grpc-port", str(self.grpc_port),
             "--http-port", str(self.http_port)],
            env={**self.env, "TESSERA_API_KEYS": f"{KEY}=docs"}, cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith("REST shim on") for line in self.lines):
            assert self.proc.poll() is None, f"tessera serve exited: {''.join(self.lines)}"
            assert time.monotonic() < deadline, f"not ready: {''.join(self.lines)}"
            time.sleep(0.1)

    def localize(self, code: str) -> str:
        """The example as a reader runs it against this server: its key and its ports."""
        code = code.replace("127.0.0.1:50051", f"127.0.0.1:{self.grpc_port}")
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{self.http_port}")
        return re.sub(r"\bKEY\b", KEY, code)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # As the README's install does: build (or load) the C++ ops before any worker starts.
    subprocess.run([sys.executable, "-m", "kernels"], cwd=REPO, check=True, timeout=1800,
                   capture_output=True)
    served = Server(tmp_path_factory.mktemp("docs"))
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.where for e in EXAMPLES])
def test_example_runs_and_prints_what_the_page_shows(server: Server, example: Example) -> None:
    code = server.localize(example.code)
    argv = ["bash", "-euo", "pipefail", "-c", code] if example.language == "sh" else \
        [sys.executable, "-c", code]
    done = subprocess.run(argv, cwd=REPO, env=server.env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{example.where} failed:\n{done.stdout}\n{done.stderr}"
    if example.expected is not None:
        assert output_matches(example.expected, done.stdout), (
            f"{example.where} printed\n{done.stdout}\nwhere the page shows\n{example.expected}")


def test_the_pages_show_runnable_examples_of_every_interface() -> None:
    where = {Path(e.where.split(":")[0]).name for e in EXAMPLES}
    assert {"README.md", "api.md", "formats.md"} <= where
    readme = [e for e in EXAMPLES if e.where.startswith("README.md")]
    code = "\n".join(e.code for e in readme)
    for interface in ("curl ", "from openai import OpenAI", "from gateway.client import",
                      "from runtime import LLM", "tessera plan"):
        assert interface in code, interface
    assert all(e.expected is not None for e in readme), "every README example shows its output"


def test_the_offline_chat_example_does_not_stop_at_the_default_16_tokens() -> None:
    offline = [e for e in EXAMPLES if e.where.startswith("README.md") and "llm.chat(" in e.code]
    assert offline and all("max_tokens=None" in e.code for e in offline)
    assert all(e.expected and "stop" in e.expected.split() for e in offline)


def test_readme_is_a_front_page_of_at_most_150_lines_with_the_ci_commands() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    commands = [b.body.strip() for b in fenced_blocks(text) if b.info == "sh"]
    assert "bash ops/install.sh && tessera serve" in commands
    assert "bash ops/install.sh --test && python3 -m pytest -q" in commands


@pytest.mark.parametrize("page", [*doc_pages(), REPO / "ops/bench/RESULTS.md"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.name}: {target}"
        if anchor and path.suffix == ".md":
            assert anchor in anchors_of(path), f"{page.name}: {target}"


def test_a_block_marked_example_in_another_language_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```js example\nconsole.log(1)\n```\n")
    with pytest.raises(ValueError, match="'sh example' or 'python example'"):
        examples_in(page)
    page.write_text("```output\n1\n```\n")
    with pytest.raises(ValueError, match="must follow an example"):
        examples_in(page)


def test_ellipsis_stands_for_any_text_and_the_rest_must_match() -> None:
    assert output_matches('{"id":"...","n":8}', '{"id":"chatcmpl-1a2b","n":8}\n')
    assert output_matches("first\n...\nlast", "first\nmiddle\nmore\nlast")
    assert not output_matches('{"n":8}', '{"n":9}')
    assert not output_matches("a...c", "a b")
    assert output_matches("x  \ny", "x\ny  \n")


def test_every_results_anchor_cited_in_the_code_resolves() -> None:
    cited = re.compile(r"(RESULTS(?:-log)?\.md)#([\w-]+)")
    bench = REPO / "ops" / "bench"
    anchors = {name: anchors_of(bench / name) for name in ("RESULTS.md", "RESULTS-log.md")}
    found = 0
    for folder in ("kernels", "runtime", "gateway", "ops", "loadtest", "tests"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix not in (".py", ".cpp", ".h", ".toml", ".yml", ".yaml"):
                continue
            for name, anchor in cited.findall(path.read_text(errors="replace")):
                found += 1
                assert anchor in anchors[name], f"{path.relative_to(REPO)}: {name}#{anchor}"
    assert found > 10
