"""The KV transfer wire format: msgpack frames with a checksum each, in a numbered sequence.

Torch-free. One transfer moves one request's KV from a prefill engine to a decode engine:

    begin (seq 0): request id, prompt length, page size, KV format and shape, first sampled
                   token, first logical page sent (the decode side may hold the ones before),
                   the seeded generator's state after the first draw (bytes or nil) and the
                   first token's logprobs ([[token id, logprob], ...] or nil); for MLA models
                   `latent` true, num_kv_heads 1, head_dim the latent's width and rope_dim its
                   RoPE part
    pages (seq 1..n): a layer range [lo, hi) and logical page positions, and a payload holding,
                   per layer, K then V of the valid tokens of those pages ([kv_heads, tokens,
                   head_dim] in the sender's KV format; fp8 and int8 add K then V scales,
                   bf16 [kv_heads, tokens], and the sender's smoothing); MLA latent pages send
                   one row per token instead (runtime/disagg/latent.py)
    end (seq n+1): the number of page frames sent

Positions are logical (page i of the request), never physical page ids: the receiver maps
them onto pages it reserved, so a stale index from a retry or from the sender's pool can never
name a receiver page. Every frame carries `nbytes` (payload length) and `crc32`, zlib's CRC-32
over the header fields and then the payload: a flipped bit anywhere in a frame fails the
check. Decoding a frame validates types and ranges only; ordering, coverage and sizes are the
importer's job (`runtime/disagg/importer.py`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import msgpack

VERSION = 1
# Nothing on this wire is larger: a frame past it is refused before it is unpacked.
MAX_FRAME_BYTES = 64 << 20
_KINDS = ("begin", "pages", "end")


class FrameError(ValueError):
    """A frame that cannot be trusted: malformed, of another version, or failing its checksum."""


@dataclass(frozen=True)
class Frame:
    kind: str  # begin | pages | end
    request_id: str
    seq: int
    header: dict[str, Any]  # kind-specific fields, see the module docstring
    payload: bytes = b""

    @property
    def layers(self) -> tuple[int, int]:
        lo, hi = self.header["layers"]
        return int(lo), int(hi)

    @property
    def pages(self) -> list[int]:
        return [int(p) for p in self.header["pages"]]


def _checksum(fields: dict[str, Any], payload: bytes) -> int:
    head = msgpack.packb(fields, use_bin_type=True)
    return zlib.crc32(payload, zlib.crc32(head))


def encode(frame: Frame) -> bytes:
    """The frame as bytes on the wire."""
    if frame.kind not in _KINDS:
        raise ValueError(f"unknown frame kind {frame.kind!r}")
    fields = {"v": VERSION, "kind": frame.kind, "rid": frame.request_id, "seq": frame.seq,
              "h": frame.header, "nbytes": len(frame.payload)}
    return msgpack.packb({**fields, "crc32": _checksum(fields, frame.payload),
                          "payload": frame.payload}, use_bin_type=True)


def decode(data: bytes) -> Frame:
    """Bytes from the wire -> a checked frame. Raises FrameError on anything untrustworthy."""
    if len(data) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(data)} bytes is over the {MAX_FRAME_BYTES} byte limit")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise FrameError(f"frame is not msgpack: {type(e).__name__}") from None
    if not isinstance(raw, dict):
        raise FrameError("frame is not a map")
    payload = raw.pop("payload", None)
    crc = raw.pop("crc32", None)
    if not isinstance(payload, bytes) or not isinstance(crc, int):
        raise FrameError("frame lacks its payload or checksum")
    if raw.get("v") != VERSION:
        raise FrameError(f"frame version {raw.get('v')!r}, expected {VERSION}")
    if raw.get("nbytes") != len(payload):
        raise FrameError(f"payload is {len(payload)} bytes, header says {raw.get('nbytes')!r}")
    if _checksum(raw, payload) != crc:
        raise FrameError("checksum mismatch")
    kind, rid, seq, header = raw.get("kind"), raw.get("rid"), raw.get("seq"), raw.get("h")
    if kind not in _KINDS or not isinstance(rid, str) or not isinstance(seq, int) \
            or not isinstance(header, dict):
        raise FrameError("frame header fields have the wrong types")
    frame = Frame(kind, rid, seq, header, payload)
    if kind == "pages":
        _check_pages_header(frame)
    return frame


def _check_pages_header(frame: Frame) -> None:
    try:
        lo, hi = frame.layers
        pages = frame.pages
    except (KeyError, TypeError, ValueError):
        raise FrameError("a pages frame needs `layers` [lo, hi) and `pages`") from None
    if not 0 <= lo < hi or not pages or min(pages) < 0 or len(set(pages)) != len(pages):
        raise FrameError(f"bad layer range [{lo}, {hi}) or page positions")


def begin_frame(request_id: str, *, num_tokens: int, page_size: int, kv_format: str,
                num_layers: int, num_kv_heads: int, head_dim: int, first_token: int,
                first_page: int, latent: bool = False, rope_dim: int = 0,
                generator_state: bytes | None = None,
                first_logprobs: list[list[float]] | None = None) -> Frame:
    return Frame("begin", request_id, 0, {
        "num_tokens": num_tokens, "page_size": page_size, "format": kv_format,
        "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "latent": latent, "rope_dim": rope_dim, "first_token": first_token,
        "first_page": first_page,
        "generator_state": generator_state, "first_logprobs": first_logprobs})


def pages_frame(request_id: str, seq: int, layers: tuple[int, int], pages: list[int],
                payload: bytes) -> Frame:
    return Frame("pages", request_id, seq, {"layers": list(layers), "pages": pages}, payload)


def end_frame(request_id: str, seq: int, num_page_frames: int) -> Frame:
    return Frame("end", request_id, seq, {"page_frames": num_page_frames})
