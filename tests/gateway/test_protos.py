"""The committed stubs are what `python -m gateway.protos` generates from proto/ today."""

from __future__ import annotations

from pathlib import Path

from gateway import protos


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    fresh = {p.relative_to(tmp_path): p.read_text() for p in protos.generate(tmp_path)}
    committed = {p.relative_to(protos.DEFAULT_OUT): p.read_text()
                 for p in protos.DEFAULT_OUT.rglob("*_pb2*.py*")}
    assert fresh, "the generator wrote nothing"
    assert set(fresh) == set(committed), "stub files differ: run python -m gateway.protos"
    stale = [str(name) for name, text in fresh.items() if committed[name] != text]
    assert not stale, f"stale stubs {stale}: run python -m gateway.protos and commit"


def test_stubs_import_without_the_generator() -> None:
    from gateway._proto.tessera.v1 import gateway_pb2, worker_pb2_grpc

    assert gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name == "tessera.v1.Gateway"
    assert hasattr(worker_pb2_grpc, "WorkerStub")
