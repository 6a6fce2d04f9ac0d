"""KV frames over shared memory between two workers on one host: the same encoded frames
(`frames.py`, checksum included), written into a ring of slots instead of the gRPC stream.

The receiver (decode side) creates the ring and names it in its Prefill call; the sender writes
each frame into the next slot once the receiver has taken the frame that used it before (so at
most `slots` frames are in flight: backpressure), and sends only (slot, length) over the
stream; the receiver copies the frame out, marks it taken, and verifies it exactly as a frame
from the socket. Header: frames taken (u64, written by the receiver only) and the geometry.
The receiver unlinks the segment however the transfer ends (its resource tracker does if it
dies); the sender never does. Torch-free.
"""

from __future__ import annotations

import os
import struct
import sys
from multiprocessing import resource_tracker, shared_memory

from runtime.disagg.frames import FrameError

_HEADER = struct.Struct("<QII")  # frames taken, slots, slot bytes
_HEADER_BYTES = 64


class FrameRing:
    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self._owner = owner
        _, self.slots, self.slot_bytes = _HEADER.unpack_from(shm.buf, 0)
        self._written = 0  # sender side: frames put

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> FrameRing:
        """A new ring of `slots` x `slot_bytes` (the receiver's side). Raises OSError when
        shared memory cannot hold it now (the caller then uses the stream)."""
        if slots < 1 or slot_bytes < 1:
            raise ValueError("a ring needs at least one slot of one byte")
        size = _HEADER_BYTES + slots * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        try:
            # NOTE: backed now, or refused now: a write into a sparse segment of a full tmpfs
            # would kill the sender with SIGBUS mid-transfer.
            os.posix_fallocate(shm._fd, 0, size)  # type: ignore[attr-defined]
        except OSError:
            shm.close()
            shm.unlink()
            raise
        _HEADER.pack_into(shm.buf, 0, 0, slots, slot_bytes)
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> FrameRing:
        """The ring the receiver named (the sender's side). Raises OSError when there is no
        such segment on this host."""
        if sys.version_info >= (3, 13):
            return cls(shared_memory.SharedMemory(name=name, track=False),  # type: ignore
                       owner=False)
        # NOTE: before 3.13 attaching registers the segment for unlinking at our exit, which
        # is the owner's job: registration is off for the attach (nothing else here uses it).
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None
        try:
            return cls(shared_memory.SharedMemory(name=name), owner=False)
        finally:
            resource_tracker.register = register

    @property
    def name(self) -> str:
        return self._shm.name

    def _taken(self) -> int:
        return int(_HEADER.unpack_from(self._shm.buf, 0)[0])

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def try_put(self, data: bytes) -> int | None:
        """Sender: write a frame into the next slot and return the slot, or None while the
        receiver has not yet taken the frame that slot held."""
        if not self.fits(len(data)):
            raise FrameError(f"frame of {len(data)} bytes over the ring's {self.slot_bytes}")
        if self._written - self._taken() >= self.slots:
            return None
        slot = self._written % self.slots
        start = _HEADER_BYTES + slot * self.slot_bytes
        self._shm.buf[start : start + len(data)] = data
        self._written += 1
        return slot

    def take(self, slot: int, nbytes: int) -> bytes:
        """Receiver: copy out the frame the sender announced, and free its slot. Raises
        FrameError for an announcement out of order or out of bounds."""
        taken = self._taken()
        if slot != taken % self.slots or not 0 < nbytes <= self.slot_bytes:
            raise FrameError(f"ring announcement (slot {slot}, {nbytes} bytes) out of order")
        start = _HEADER_BYTES + slot * self.slot_bytes
        data = bytes(self._shm.buf[start : start + nbytes])
        _HEADER.pack_into(self._shm.buf, 0, taken + 1, self.slots, self.slot_bytes)
        return data

    def close(self) -> None:
        """Detach; the owner also unlinks the segment. Idempotent."""
        if self._shm.buf is None:
            return
        self._shm.close()
        if self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
