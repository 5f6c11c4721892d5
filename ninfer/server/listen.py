"""Listening sockets and the hypercorn trio worker.

On Linux, options set on a listening socket are inherited by the sockets it accepts, so TCP
keepalive and TCP_USER_TIMEOUT are set once here: a peer that vanishes or stops acknowledging is
noticed within about 20 seconds even while its request waits or prefills (spec: Endpoints).
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Awaitable, Callable

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio import serve as hypercorn_serve

USER_TIMEOUT_MS = 15_000
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3


def configure_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; other systems keep their keepalive defaults
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


class _Config(Config):
    def create_sockets(self) -> Sockets:
        sockets = super().create_sockets()
        for sock in sockets.insecure_sockets:
            configure_socket(sock)
        return sockets


def hypercorn_config(host: str, port: int) -> Config:
    config = _Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None  # request lifecycle goes to our own log records
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = 75
    config.graceful_timeout = 3
    return config


async def serve(app: Any, host: str, port: int, *,
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` until ``shutdown_trigger`` returns; ``task_status`` gets the bound URLs."""
    await hypercorn_serve(app, hypercorn_config(host, port), shutdown_trigger=shutdown_trigger,
                          task_status=task_status)
