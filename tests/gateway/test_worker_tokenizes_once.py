"""A worker's Generate call, over real gRPC on a unix socket, tokenizes its prompt once (text,
text with split special tokens, chat; n > 1 too), in a pool thread: the servicer hands the
processed prompt to the engine, which admits it without a second pass."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import grpc
import pytest

from gateway._proto.tessera.v1 import gateway_pb2 as pb
from gateway._proto.tessera.v1 import worker_pb2 as wpb
from gateway._proto.tessera.v1 import worker_pb2_grpc
from gateway.worker import WorkerServicer, _served
from runtime.async_engine import AsyncLLM

pytestmark = pytest.mark.slow
TIMEOUT_S = 120


def _request(kind: str, n: int = 1) -> wpb.WorkerGenerateRequest:
    sampling = pb.SamplingOptions(max_tokens=3, temperature=0.0, ignore_eos=True, n=n)
    if kind == "chat":
        chat = wpb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi <|im_end|>")])
        return wpb.WorkerGenerateRequest(request_id=f"tok-{kind}-{n}", chat=chat,
                                         sampling=sampling)
    return wpb.WorkerGenerateRequest(request_id=f"tok-{kind}-{n}", text="Hello <|im_end|> there",
                                     split_special_tokens=kind == "split", sampling=sampling)


@pytest.mark.parametrize(("kind", "n"), [("text", 1), ("split", 1), ("chat", 1), ("text", 3)])
def test_a_generate_call_tokenizes_its_prompt_once_off_the_engine_thread(
        engine, monkeypatch, tmp_path, kind, n):
    count: Counter[str] = Counter()
    threads: set[str] = set()
    for name in ("encode", "encode_chat"):
        real = getattr(engine.tokenizer, name)

        def counted(*args, _name=name, _real=real, **kwargs):
            count[_name] += 1
            threads.add(threading.current_thread().name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(engine.tokenizer, name, counted)
    allm = AsyncLLM(engine)
    socket = f"unix:{tmp_path}/w.sock"

    async def main() -> list:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(
            WorkerServicer(allm, _served(engine, None, "w-test")), server)
        server.add_insecure_port(socket)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(socket) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                return [r async for r in stub.Generate(_request(kind, n), timeout=TIMEOUT_S)]
        finally:
            await server.stop(grace=None)

    try:
        replies = asyncio.run(main())
    finally:
        allm.shutdown()
    assert replies and replies[-1].HasField("final")
    assert count == Counter({"encode_chat" if kind == "chat" else "encode": 1})
    assert "tessera-engine" not in threads and threading.main_thread().name not in threads
