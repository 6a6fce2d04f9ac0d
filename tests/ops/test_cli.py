"""The `tessera` command in a real subprocess: generate, chat over stdin, and a bad model path.

Each model-loading run costs a model load (~15 s), so there are only two of them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def tessera(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], input=stdin, text=True,
                          capture_output=True, cwd=REPO, env=env, timeout=TIMEOUT_S)


def test_generate_completes_a_prompt():
    proc = tessera("generate", "The capital of France is", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "### The capital of France is" in proc.stdout
    assert " Paris" in proc.stdout
    assert "tok/s" in proc.stderr  # the summary line goes to stderr, not into the output


def test_chat_answers_a_line_from_stdin_and_quits_on_an_empty_line():
    proc = tessera("chat", "--max-tokens", "24", "--kv-cache-bytes", str(64 << 20),
                   stdin="What is 2+2?\n\n")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "you> What is 2+2?", proc.stdout  # piped input echoed on its own line
    replies = [line for line in lines if "bot> " in line]
    assert len(replies) == 1, proc.stdout
    assert replies[0].startswith("bot> ") and replies[0][5:].strip()  # a non-empty answer
    assert proc.stdout.count("you> ") == 2  # asked once more, then the empty line ended it


def test_chat_at_end_of_input_ends_its_prompt_line_and_reports_the_kv_budget():
    proc = tessera("chat", "--max-tokens", "8", stdin="Hi\n")  # no empty line: stdin ends
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("you> \n"), proc.stdout[-40:]
    assert re.search(r"KV in \d+ MiB", proc.stderr), proc.stderr  # the auto-sized budget


def test_unknown_model_path_exits_non_zero_with_model_not_found(tmp_path):
    missing = tmp_path / "missing.gguf"
    proc = tessera("generate", "Hello", "--model", str(missing))
    assert proc.returncode != 0
    assert "MODEL_NOT_FOUND" in proc.stderr
    assert str(missing) in proc.stderr
    assert "Traceback" not in proc.stderr  # a clean error line, not a crash
    assert proc.stdout == ""


def test_generate_checks_its_sampling_flags_before_loading_the_model(tmp_path):
    # the missing model would be found only by loading it: the flag's error comes first
    proc = tessera("generate", "Hello", "--max-tokens", "0",
                   "--model", str(tmp_path / "missing.gguf"))
    assert proc.returncode != 0
    assert "INVALID_ARGUMENT: max_tokens must be at least 1" in proc.stderr, proc.stderr
    assert "MODEL_NOT_FOUND" not in proc.stderr
