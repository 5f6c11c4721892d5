"""The JSONL request log (``--request-log-jsonl FILE``): one schema-versioned object per line.

Opened in append mode and flushed after every event, so several server runs can share one
campaign file. Records carry counts, seconds and ids — never prompts, outputs or credentials.
The schema is documented in docs/request-log.md; ``EVENT_FIELDS`` lists each event's required
members and a test validates written lines against it.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import time
from typing import Any

SCHEMA = "ninfer_serve_request_log"
SCHEMA_VERSION = 24  # the spec's "ninfer_serve_request_log schema-v24"

COMMON_FIELDS = ("schema", "schema_version", "event", "timestamp_unix_ms", "server_instance_id")

EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "server_start": ("artifact", "architecture", "model_id", "backend", "formats", "model_signature", "engine",
                     "sampling_defaults", "sampling_overrides", "thinking", "argv"),
    "request_start": ("request_id", "request_seq", "protocol", "stream", "shape", "sampling", "max_tokens",
                      "requested_reasoning_effort", "enable_thinking", "preserve_thinking", "thinking_budget",
                      "prompt_tokens", "payload_bytes", "acquisition_seconds", "tokenizer", "media"),
    "request_rejected": ("request_id", "request_seq", "protocol", "phase", "shape", "requested_reasoning_effort",
                         "media_items", "status", "type", "code", "param", "message"),
    "request_done": ("request_id", "request_seq", "protocol", "result", "timings_seconds", "engine_timing",
                     "first_output_timing", "generation", "work"),
    # The resolved configuration request_start logged, then the terminal message.
    "request_error": ("request_id", "request_seq", "protocol", "stream", "shape", "sampling", "max_tokens",
                      "requested_reasoning_effort", "enable_thinking", "preserve_thinking", "thinking_budget",
                      "prompt_tokens", "phase", "message"),
    "request_scheduling": ("request_id", "request_seq", "transition", "progress"),
    "throughput": ("interval_seconds", "prefill_tokens", "decode_tokens", "generation_tokens", "scheduler",
                   "decode_rounds", "decode_row_rounds", "average_size", "scheduling", "context_cache", "host_work"),
}


class RequestLog:
    def __init__(self, path: str, *, artifact_path: str | None = None):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise OSError(f"--request-log-jsonl: directory {parent} does not exist")
        if artifact_path is not None and os.path.exists(path) and os.path.samefile(path, artifact_path):
            raise OSError("--request-log-jsonl resolves to the model artifact; refusing to append to it")
        self.path = path
        self._file = open(path, "a", encoding="utf-8")
        self.instance_id = secrets.token_hex(8)
        self._seq = itertools.count(1)

    def next_seq(self) -> int:
        """A request number, monotonic within this server instance."""
        return next(self._seq)

    def write(self, event: str, **fields: Any) -> None:
        assert event in EVENT_FIELDS, event
        record = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "event": event,
                  "timestamp_unix_ms": int(time.time() * 1000), "server_instance_id": self.instance_id}
        record.update(fields)
        self._file.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def redact_argv(argv: list[str]) -> list[str]:
    """argv with the --api-key value replaced by <redacted> (both spellings)."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append("<redacted>")
            hide_next = False
        elif arg == "--api-key":
            out.append(arg)
            hide_next = True
        elif arg.startswith("--api-key="):
            out.append("--api-key=<redacted>")
        else:
            out.append(arg)
    return out
