"""The listening socket of ``ridge serve`` and ``ridge router``, bound before anything slow
starts (a taken port fails at once)."""

from __future__ import annotations

import socket

DEFAULT_HOST = "127.0.0.1"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (IPv4 or IPv6 by ``host``); ValueError when it cannot bind."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
