"""The one table of protocol error codes, and the typed error every protocol layer raises.

A protocol layer (parsing, preparation, the server's own checks) raises ``ProtocolError(code,
message, param=...)``; the HTTP status and the error type of each API family come from ``CODES``,
never from the raising site, so one code always means one status on every endpoint.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class ErrorKind:
    status: int
    openai_type: str  # OpenAI envelope "type"
    anthropic_type: str  # Anthropic envelope "error.type"


_BAD = ErrorKind(400, "invalid_request_error", "invalid_request_error")

# code -> kind. Codes are the wire `code` field; add a row here before raising a new one.
CODES: dict[str, ErrorKind] = {
    # Malformed or missing protocol values (field-specific).
    "invalid_json": _BAD,
    "invalid_type": _BAD,
    "invalid_value": _BAD,
    "missing_required_parameter": _BAD,
    "unknown_parameter": _BAD,
    # Recognized but not executable: the field names the guarantee NInfer cannot give.
    "unsupported_parameter": _BAD,
    "vision_disabled": _BAD,
    "conflicting_template_option": _BAD,
    # Prompt preparation.
    "invalid_prompt": _BAD,
    "invalid_media": _BAD,
    "media_budget_exceeded": _BAD,
    "invalid_assistant_history": _BAD,
    "invalid_tool_history": _BAD,
    "context_length_exceeded": _BAD,
    "thinking_budget_capacity_insufficient": _BAD,
    "response_store_capacity_exceeded": _BAD,
    "compaction_not_supported": _BAD,
    # Routing and identity.
    "model_not_found": ErrorKind(404, "invalid_request_error", "not_found_error"),
    "not_found": ErrorKind(404, "invalid_request_error", "not_found_error"),
    "response_not_found": ErrorKind(404, "invalid_request_error", "not_found_error"),
    "method_not_allowed": ErrorKind(405, "invalid_request_error", "invalid_request_error"),
    "invalid_api_key": ErrorKind(401, "authentication_error", "authentication_error"),
    "request_too_large": ErrorKind(413, "invalid_request_error", "request_too_large"),
    # Capacity and availability.
    "server_overloaded": ErrorKind(429, "server_error", "overloaded_error"),
    "request_queue_timeout": ErrorKind(503, "server_error", "timeout_error"),
    "engine_unavailable": ErrorKind(503, "server_error", "api_error"),
    # Internal invariant failures stay internal.
    "internal_error": ErrorKind(500, "server_error", "api_error"),
}

# Anthropic maps local capacity failures to its own statuses (overloaded 529, timeouts 504).
ANTHROPIC_STATUS = {"server_overloaded": 529, "request_queue_timeout": 504}


class ProtocolError(Exception):
    """A client-visible failure: code from ``CODES``, a specific message, the offending field."""

    def __init__(self, code: str, message: str, param: str | None = None, **extra: object):
        if code not in CODES:
            raise KeyError(f"unregistered protocol error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.extra = extra  # additional envelope members (e.g. token counts)

    @property
    def kind(self) -> ErrorKind:
        return CODES[self.code]

    @property
    def status(self) -> int:
        return self.kind.status

    def openai_body(self) -> dict:
        body = {"message": self.message, "type": self.kind.openai_type, "param": self.param, "code": self.code}
        body.update(self.extra)
        return {"error": body}

    def anthropic_body(self, request_id: str | None) -> dict:
        body = {"type": "error", "error": {"type": self.kind.anthropic_type, "message": self.message}}
        if request_id is not None:
            body["request_id"] = request_id
        return body

    def anthropic_status(self) -> int:
        return ANTHROPIC_STATUS.get(self.code, self.status)

    def __repr__(self) -> str:
        return f"ProtocolError({self.code!r}, {self.message!r}, param={self.param!r})"


# Short constructors for the common shapes, so messages stay uniform across families.
def invalid_type(param: str, expected: str) -> ProtocolError:
    return ProtocolError("invalid_type", f"'{param}' must be {expected}.", param)


def invalid_value(param: str, why: str) -> ProtocolError:
    return ProtocolError("invalid_value", f"Invalid value for '{param}': {why}", param)


def missing(param: str) -> ProtocolError:
    return ProtocolError("missing_required_parameter", f"Missing required parameter: '{param}'.", param)


def unsupported(param: str, guarantee: str) -> ProtocolError:
    """A recognized request NInfer cannot execute; ``guarantee`` says what it cannot provide."""
    return ProtocolError("unsupported_parameter", f"'{param}' is not supported: {guarantee}", param)


def vision_disabled(param: str, media: str = "image and video") -> ProtocolError:
    return ProtocolError("vision_disabled", f"This server was started without --vision; {media} input is disabled.",
                         param)


# Guarantees NInfer cannot give, named the same way by every family's capability rejections.
NO_CONSTRAINED_OUTPUT = "NInfer has no constrained decoding, so the output cannot be guaranteed to match it."
NO_STRICT_TOOLS = "strict schema adherence needs constrained decoding."
NO_SINGLE_CALL = ("single-call enforcement needs constrained decoding; parallel calls cannot be disabled while tools "
                  "are callable.")
NO_LOGPROBS = "NInfer does not return token log probabilities."
NO_MODERATION = "NInfer has no moderation service."
