"""`tessera serve --tp N` refuses, before any worker starts and with one line naming the cause,
the tensor-parallel choices no worker could start with (its workers would fail and be
restarted until --worker-start-timeout-s)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from gateway.pool_config import PoolConfig
from runtime.config import ModelConfig
from runtime.distributed import check_tensor_parallel
from runtime.errors import InvalidArgument


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", "serve", *flags, "--grpc-port", str(_free_port()),
         "--http-port", str(_free_port())], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("flags", "why"), [
    (("--tp", "4"), "--tp 4: tensor_parallel_size=4 exceeds the model's 3 KV heads"),
    (("--tp", "2", "--decode-weights", "int4"), "serves float weights only for now, not int4"),
    (("--tp", "2", "--prefill-workers", "1"), "--tp works with colocated workers only"),
    (("--tp", "0"), "--tp must be at least 1"),
])
def test_serve_refuses_an_impossible_tp_before_any_worker_starts(flags, why):
    proc = serve(*flags)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert why in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "starting workers" not in proc.stdout


def _smollm2_like(**overrides: object) -> ModelConfig:
    fields: dict[str, object] = dict(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=8192, tie_word_embeddings=True)
    fields.update(overrides)
    return ModelConfig(**fields)  # type: ignore[arg-type]


def test_tp_over_fewer_cuda_devices_than_ranks_is_refused(monkeypatch):
    # NOTE: no GPU here: torch's device count is the one thing replaced
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidArgument, match="needs 2 CUDA devices, one per rank; torch sees 1"):
        check_tensor_parallel(_smollm2_like(), 2, "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_tensor_parallel(_smollm2_like(), 2, "cuda")


def test_uneven_head_splits_pass_and_mla_counts_query_heads():
    check_tensor_parallel(_smollm2_like(), 2, "cpu")  # 3 KV heads as 2 + 1
    check_tensor_parallel(_smollm2_like(), 3, "cpu")
    with pytest.raises(InvalidArgument, match="exceeds the model's 3 KV heads"):
        check_tensor_parallel(_smollm2_like(), 4, "cpu")
    # MLA: the latent is replicated, the query heads are what is split
    mla = _smollm2_like(num_key_value_heads=9, kv_latent_dim=576)
    check_tensor_parallel(mla, 8, "cpu")
    with pytest.raises(InvalidArgument, match="exceeds the model's 9 attention heads"):
        check_tensor_parallel(mla, 10, "cpu")


def test_pool_config_refuses_tp_for_disaggregated_pools():
    with pytest.raises(InvalidArgument, match="colocated pools only"):
        PoolConfig("m", role="decode", tensor_parallel_size=2)
    with pytest.raises(InvalidArgument, match="tensor_parallel_size must be >= 1"):
        PoolConfig("m", tensor_parallel_size=0)
    assert PoolConfig("m", tensor_parallel_size=2).tensor_parallel_size == 2


def test_worker_refuses_tp_with_a_prefill_or_decode_role(capsys):
    from gateway.worker import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--socket", "x.sock", "--tp", "2", "--role", "prefill"])
    assert "--tp serves colocated workers only" in capsys.readouterr().err
