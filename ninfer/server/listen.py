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


class ListenError(Exception):
    """The listen address cannot be bound (in use, not local, unresolvable)."""


class _Config(Config):
    bound: Sockets | None = None  # the sockets ``bind`` made; hypercorn serves these

    def create_sockets(self) -> Sockets:
        if self.bound is None:
            self.bound = super().create_sockets()
            for sock in self.bound.insecure_sockets:
                configure_socket(sock)
        return self.bound


def hypercorn_config(host: str, port: int) -> Config:
    config = _Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None  # request lifecycle goes to our own log records
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = 75
    config.graceful_timeout = 3
    return config


def bind(host: str, port: int) -> Config:
    """Bind the listening sockets now, so that an address in use or not local fails startup with
    one clear ``ListenError`` instead of a traceback from inside the server's task group."""
    config = hypercorn_config(host, port)
    try:
        config.create_sockets()
    except OSError as e:
        raise ListenError(f"cannot listen on {config.bind[0]}: {e.strerror or e}") from None
    return config


async def serve(app: Any, config: Config, *,
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on the sockets ``bind`` made until ``shutdown_trigger`` returns; ``task_status``
    gets the bound URLs."""
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
