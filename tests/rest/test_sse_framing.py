"""A stream chunk's SSE event is serialized around its choice alone (the envelope once per
stream): the bytes are exactly those of the whole envelope serialized at every token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.rest.openai_api import _Shape
from gateway.rest.relay import sse
from gateway.wire import ServedInfo

CHOICES = [{"index": 0, "text": "h\u00e9\"llo\n", "logprobs": None, "finish_reason": None},
           {"index": 1, "delta": {"content": "\u2603"}, "logprobs": {"content": []},
            "finish_reason": "stop"}]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("usage", [True, False])
def test_a_chunk_event_is_the_whole_envelope_serialized(chat, usage):
    body = SimpleNamespace(model="", n=1, logprob_count=lambda: None)
    shape = _Shape(chat, body)
    stream = SimpleNamespace(served=None, usage=None)
    for served in (None, ServedInfo("m\u00e9", "r", "q4", "fp32", "q4", "fp32", "w-1"),
                   ServedInfo("other", "r2", "q4", "fp8", "q4", "fp8", "w-2")):
        stream.served = served  # the model and fingerprint follow the served configuration
        for choice in CHOICES:
            want = shape.envelope(shape.chunk_object, [choice], [stream], usage=False)
            if usage:
                want["usage"] = None
            assert shape.chunk_event(choice, [stream], usage) == sse(want)
