"""Listening ports, bound exclusively: `tessera serve` checks every port it will listen on before
it starts a worker, and refuses one that another process holds with one line ("port 50051 is in
use"), instead of sharing it (gRPC's default SO_REUSEPORT would split clients between the two
servers) or failing half-started on a traceback."""

from __future__ import annotations

import socket

# gRPC server option: no SO_REUSEPORT, so a second server cannot bind the same port.
GRPC_EXCLUSIVE = ("grpc.so_reuseport", 0)


class PortInUse(OSError):
    """A port this server must listen on is taken (or cannot be bound); the message is the one
    line to show."""

    def __init__(self, port: int, flag: str, why: str = "is in use") -> None:
        self.port, self.flag = port, flag
        super().__init__(f"port {port} {why} ({flag}): stop what holds it or pick another port")


def check_free(host: str, ports: dict[str, int | None]) -> None:
    """Raise PortInUse for the first of `ports` (flag -> port; 0 or None: skipped) that cannot be
    bound on host now. Binds as the servers do (SO_REUSEADDR, no SO_REUSEPORT): a port only in
    TIME_WAIT is free, one with any listener is not."""
    for flag, port in ports.items():
        if not port:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                why = "is in use" if e.errno == 98 else f"cannot be bound: {e.strerror}"
                raise PortInUse(port, flag, why) from None
