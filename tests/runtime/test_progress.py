"""Long work shows progress: a bar on a terminal, logfmt lines otherwise (a pipe, a log file),
for model load, native builds, convert and calibration alike."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, *, tty: bool = False) -> str:
    """stderr of `code` run in a fresh interpreter, a pipe or a pseudo-terminal."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if not tty:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=REPO, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr
    main, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=child,
                            stdout=subprocess.DEVNULL, cwd=REPO, env=env)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(main)
    return b"".join(chunks).decode(errors="replace")


def _lines(stderr: str, task: str) -> list[dict[str, str]]:
    out = []
    for line in stderr.splitlines():
        if line.startswith("progress ") and (f'task="{task}"' in line or f"task={task} " in line):
            out.append(dict(w.split("=", 1) for w in line.split()[1:] if "=" in w))
    return out


def test_a_piped_run_logs_start_progress_and_end_lines():
    err = _run("import time\nfrom runtime.progress import Progress\n"
               "with Progress('demo', total=4, unit='steps', every_s=0.05) as p:\n"
               "    for _ in range(4):\n        time.sleep(0.1); p.update()\n")
    lines = _lines(err, "demo")
    assert [ln["state"] for ln in (lines[0], lines[-1])] == ["start", "done"]
    assert any(ln["state"] == "running" and "eta_s" in ln for ln in lines), err
    assert (lines[-1]["done"], lines[-1]["total"], lines[-1]["unit"]) == ("4", "4", "steps")


def test_a_long_silent_call_reports_elapsed_time():
    err = _run("import time\nfrom runtime.progress import waiting\n"
               "with waiting('build', every_s=0.1):\n    time.sleep(0.5)\n")
    states = [ln["state"] for ln in _lines(err, "build")]
    assert states[0] == "start" and states[-1] == "done" and "running" in states, err


def test_model_load_logs_progress_when_not_on_a_terminal():
    err = _run("from tests.helpers import tiny_random_checkpoint\n"
               "from runtime.config import EngineConfig\nfrom runtime.engine import LLMEngine\n"
               "LLMEngine(tiny_random_checkpoint(), EngineConfig(kv_cache_bytes=8 << 20))\n")
    done = _lines(err, "load weights")[-1]
    assert done["state"] == "done" and done["done"] == str(2 + 2 * 9), err


def test_a_terminal_gets_a_bar_not_log_lines():
    err = _run("from runtime.progress import progress\n"
               "for _ in progress(range(50), 'demo', unit='steps'): pass\n", tty=True)
    assert "demo" in err and "steps" in err
    assert "progress task=" not in err and "demo: 50 steps in" in err
