"""One definition of the engine flags: every one is accepted, with the same meaning, by
`tessera generate`, `chat`, `serve` and the worker; `serve` hands the ones a user set to its
workers; every option of every subcommand says what it does and its default."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile

import pytest

from gateway.serve import POOL_ARG_FLAGS, pool_config, worker_args
from gateway.supervisor import WorkerPool
from gateway.worker import parse_args as parse_worker
from gateway.worker_handle import WorkerHandle
from ops.cli import build_parser
from runtime.engine_flags import FLAGS, Flag
from runtime.threads import share_of_cores

# A value other than the default for each flag (switches are simply given).
SAMPLES = {"model": "/models/x", "dtype": "bfloat16", "kv-cache-bytes": "123456",
           "max-model-len": "777", "max-num-seqs": "5", "max-num-batched-tokens": "256",
           "tenant-page-quota": "0.5", "integrity": "off", "attention-backend": "torch",
           "device": "cpu", "decode-graphs": "eager",
           "kv-cache-dtype": "fp8",
           "prefill-kv-cache-dtype": "bf16", "prefill-weights": "fp8",
           "decode-weights": "int4", "weight-group-size": "64", "serving-config": "/x.json",
           "gguf-weights": "dequantize", "gguf-activations": "int8", "worker-threads": "3"}
SERVE_EXCLUDES = ("max-num-seqs",)  # serve sizes workers with --max-inflight


def _argv(flags: list[Flag]) -> list[str]:
    out: list[str] = []
    for f in flags:
        out += [f"--{f.name}"] if f.switch else [f"--{f.name}", SAMPLES[f.name]]
    return out


def _values(args: argparse.Namespace, flags: list[Flag]) -> dict[str, object]:
    return {f.dest: getattr(args, f.dest) for f in flags}


def test_every_flag_has_a_sample_here() -> None:
    assert {f.name for f in FLAGS if not f.switch} == set(SAMPLES)


def test_every_engine_flag_means_the_same_to_generate_chat_serve_and_the_worker() -> None:
    parser = build_parser()
    flags = list(FLAGS)
    generate = parser.parse_args(["generate", "hi", *_argv(flags)])
    chat = parser.parse_args(["chat", *_argv(flags)])
    worker = parse_worker(["--socket", "/tmp/s", *_argv(flags)])
    served = [f for f in flags if f.name not in SERVE_EXCLUDES]
    serve = parser.parse_args(["serve", *_argv(served)])
    expected = _values(generate, flags)
    assert _values(chat, flags) == expected == _values(worker, flags)
    assert _values(serve, served) == _values(generate, served)


def test_serve_hands_the_flags_a_user_set_to_each_worker() -> None:
    parser = build_parser()
    pool_set = ("model", "kv-cache-bytes", "worker-threads")  # passed by the pool itself
    served = [f for f in FLAGS if f.name not in (*SERVE_EXCLUDES, *pool_set)]
    serve = parser.parse_args(["serve", *_argv(served)])
    worker = parse_worker(["--socket", "/tmp/s", *worker_args(serve)])
    assert _values(worker, served) == _values(serve, served)
    assert worker_args(parser.parse_args(["serve"])) == ()


def test_a_pool_that_starts_no_worker_leaves_no_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # mkdtemp's default folder
    WorkerPool(pool_config(build_parser().parse_args(["serve"])))
    assert list(tmp_path.iterdir()) == []


def test_serve_gives_each_worker_its_threads_and_kv_budget() -> None:
    parser = build_parser()
    pool = WorkerPool(pool_config(parser.parse_args(
        ["serve", "--worker-threads", "3", "--kv-cache-bytes", "123456"])))
    command = pool._command(WorkerHandle("w", "/tmp/w.sock", 1))
    worker = parse_worker(command[command.index("--socket"):])
    assert (worker.worker_threads, worker.kv_cache_bytes) == (3, 123456)
    default = WorkerPool(pool_config(parser.parse_args(["serve", "--max-workers", "2"])))
    command = default._command(WorkerHandle("w", "/tmp/w.sock", 1))
    worker = parse_worker(command[command.index("--socket"):])
    assert worker.worker_threads == share_of_cores(2)
    assert worker.kv_cache_bytes is None  # the worker sizes its pool from free memory


def test_prefill_and_decode_pools_split_the_cores_between_them() -> None:
    from gateway.serve import pool_configs

    parser = build_parser()
    args = parser.parse_args(["serve", "--prefill-workers", "1", "--decode-workers", "1"])
    pools = pool_configs(pool_config(args), args)
    assert [(p.role, p.worker_threads) for p in pools] == [
        ("decode", share_of_cores(2)), ("prefill", share_of_cores(2))]
    args = parser.parse_args(["serve", "--prefill-workers", "1", "--worker-threads", "3"])
    assert {p.worker_threads for p in pool_configs(pool_config(args), args)} == {3}


def test_the_pool_args_examples_in_serve_help_are_flags_a_worker_accepts() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.option_strings[0]: a.help for a in sub.choices["serve"]._actions
             if a.option_strings}
    for flag in POOL_ARG_FLAGS:
        example = re.search(r'e\.g\. "([^"]+)"', helps[flag])
        assert example, f"{flag} has no example"
        parse_worker(["--socket", "/tmp/s", *shlex.split(example.group(1))])


@pytest.mark.timeout(120)
def test_serve_refuses_pool_args_its_workers_would_reject_before_starting_any() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "serve", "--no-http", "--grpc-port", "0",
         "--prefill-workers", "1", "--prefill-pool-args", "--kv-cache-dtype bfloat16"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "tessera gateway on" not in proc.stdout  # nothing was started
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tessera serve: --prefill-pool-args: ")
    assert "'bfloat16'" in lines[0] and "'bf16'" in lines[0]


def test_serve_names_the_pool_flag_with_an_unknown_or_unquotable_word() -> None:
    from gateway.serve import check_pool_args

    args = build_parser().parse_args(["serve", "--decode-pool-args", "--kv-cache-dtype fp8",
                                      "--prefill-pool-args=--no-such-flag"])
    with pytest.raises(SystemExit, match="--prefill-pool-args: unrecognized arguments: "
                                         "--no-such-flag"):
        check_pool_args(args)
    args = build_parser().parse_args(["serve", "--decode-pool-args=--model 'x"])
    with pytest.raises(SystemExit, match="--decode-pool-args: No closing quotation"):
        check_pool_args(args)
    check_pool_args(build_parser().parse_args(
        ["serve", "--decode-pool-args", "--kv-cache-dtype fp8 --kv-transport grpc"]))


def test_serve_defaults_bind_loopback_on_50051() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.grpc_port, args.http_port, args.api_keys) == (
        "127.0.0.1", 50051, 8000, None)


@pytest.mark.parametrize("command", ["generate", "chat", "convert", "serve"])
def test_every_option_says_what_it_does_and_its_default(command) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cmd = sub.choices[command]
    options = [a for a in cmd._actions if a.option_strings and a.dest != "help"]
    assert options
    undocumented = [a.option_strings[0] for a in options if not a.help]
    assert undocumented == []
    text = cmd.format_help()
    assert text.count("(default:") >= len(options) - sum(a.required for a in options)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_with_weight_group_size_64_serves_int4_g64() -> None:
    from gateway.client import Client
    from gateway.runner import GatewayRunner
    from tests.gateway.conftest import KEYS, MODEL, api_keys, pool_config

    args = build_parser().parse_args(["serve", "--weight-group-size", "64",
                                      "--decode-weights", "int4"])
    runner = GatewayRunner([pool_config(max_workers=1, worker_args=worker_args(args))],
                           api_keys()).start()
    try:
        with Client(runner.target, api_key=KEYS["acme"]) as client:
            stream = client.generate("The capital of France is", model=MODEL, max_tokens=4)
            list(stream)
        assert stream.served.decode_weights == "int4-g64"
        assert stream.served.prefill_weights == "fp32"
    finally:
        runner.stop()
