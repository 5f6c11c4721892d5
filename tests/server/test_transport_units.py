"""Transport pieces without a model: accepted-socket options, log format, argv redaction."""

from __future__ import annotations

import io
import logging
import re
import socket
import sys

import pytest

from ninfer.observability import logs
from ninfer.observability.request_log import redact_argv
from ninfer.server import listen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_USER_TIMEOUT is Linux-only")
def test_accepted_sockets_inherit_keepalive_and_user_timeout():
    server = socket.create_server(("127.0.0.1", 0))
    listen.configure_socket(server)
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 15_000
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == listen.KEEPALIVE_IDLE_S
    finally:
        for s in (accepted, client, server):
            s.close()


def test_hypercorn_listener_sockets_are_configured():
    config = listen.hypercorn_config("127.0.0.1", 0)
    sockets = config.create_sockets()
    try:
        (sock,) = sockets.insecure_sockets
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 15_000
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    finally:
        for s in sockets.insecure_sockets:
            s.close()


def test_pretty_log_format_and_levels():
    out = io.StringIO()
    handler = logs.setup("info", out)
    try:
        log = logging.getLogger("ninfer.server")
        log.debug("hidden")
        log.info("ready: serving %s", "m")
        log.warning("careful")
    finally:
        logging.getLogger("ninfer").removeHandler(handler)
        logging.getLogger("hypercorn.error").removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    pattern = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (INFO|WARNING) [ -~]+$"  # plain printable, no escapes
    assert all(re.match(pattern, line) for line in lines), lines
    assert lines[0].endswith("INFO ready: serving m")


def test_argv_redaction():
    assert redact_argv(["serve", "--api-key", "s3", "--api-key=s4", "--port", "1"]) == [
        "serve", "--api-key", "<redacted>", "--api-key=<redacted>", "--port", "1"]


def test_load_checker_names_each_stream_problem():
    from ninfer.server.load import _stream_problem

    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    text = {"choices": [{"delta": {"content": "hi"}}]}
    finish = {"choices": [{"delta": {}, "finish_reason": "stop"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 1}}
    assert _stream_problem([role, text, finish, usage, "[DONE]"]) is None
    assert _stream_problem([role, text, {"error": {"code": "internal_error"}}]) == "error frame in stream"
    assert _stream_problem([role, text, finish, usage]) == "stream did not end with a usage chunk and [DONE]"
    assert _stream_problem([role, text, finish, "[DONE]"]) == "no final usage chunk"
    assert _stream_problem([text, text, finish, usage, "[DONE]"]) == "stream did not start with the assistant role chunk"
    assert _stream_problem([role, text, text, usage, "[DONE]"]) == "no finish_reason chunk"


def test_worker_built_runner_builds_on_first_use_and_forwards_what_the_runner_has(tiny_artifact):
    from ninfer.backends.reference import ReferenceRunner
    from ninfer.engine.signature import model_signature
    from ninfer.server.backend import WorkerBuiltRunner

    built = []

    def build():
        built.append(ReferenceRunner(tiny_artifact, num_pages=4, max_batch=1, max_context=32))
        return built[-1]

    lazy = WorkerBuiltRunner(build)
    assert not built
    lazy.close()  # closing an unbuilt runner builds nothing
    assert not built
    assert lazy.info is built[0].info and lazy.config is built[0].config  # config: the Engine's model signature
    assert model_signature(lazy) == model_signature(built[0]) is not None
    assert getattr(lazy, "copy_state", None) is None  # a dense runner: the Engine's recurrent probe sees none
    lazy.close()
