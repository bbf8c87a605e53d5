"""The listening socket, bound before anything slow is imported or loaded."""

from __future__ import annotations

import errno
import socket


def listen(host: str, port: int) -> socket.socket:
    """Bind the server's socket now, before anything slow, so that a port in use is
    reported at once rather than after the model has loaded. Pass it to run(sockets=)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # listening now makes the check atomic (two binds with SO_REUSEADDR both succeed
        # until one listens) and queues early clients rather than refusing them
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = " (another server is running there? pick another with --port)" if (
            e.errno == errno.EADDRINUSE) else ""
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock
