"""Typed Engine errors: the server maps each to one protocol error code (protocols/errors.py)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the Engine raises on purpose."""


class Overloaded(EngineError):
    """Lifetime capacity (max_concurrency + max_pending_requests) is full (429 / 529)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(f"server overloaded: all {capacity} request slots are in use")
        self.capacity = capacity


class QueueTimeout(EngineError):
    """Admission did not happen before the pending deadline (503 / 504)."""

    def __init__(self, timeout_ms: int) -> None:
        super().__init__(f"request was not admitted within the {timeout_ms} ms pending timeout")
        self.timeout_ms = timeout_ms


class EngineUnavailable(EngineError):
    """The Engine failed or is closed; /health reports unavailable."""


class InvalidPrompt(EngineError, ValueError):
    """The prompt itself cannot run: no tokens, or ids outside the model's vocabulary (400
    invalid_prompt). Other ValueErrors of ``submit`` are a caller's bug, not the client's."""


class ContextLengthExceeded(EngineError):
    """The prompt does not fit the context ceiling (400 context_length_exceeded)."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(
            f"prompt has {prompt_tokens} tokens; the context ceiling is {limit} tokens "
            "including at least one output position"
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class ThinkingBudgetCapacityInsufficient(EngineError):
    """The output capacity passes the thinking cap but cannot hold the close suffix + 1 token."""

    def __init__(self, budget: int, capacity: int, suffix: int) -> None:
        super().__init__(
            f"output capacity {capacity} extends past the thinking budget {budget} but cannot fit "
            f"the {suffix}-token thinking close suffix plus one answer token"
        )
        self.budget = budget
        self.capacity = capacity
        self.suffix = suffix


class ContextCostPresetsError(EngineError):
    """The --context-cost-presets file is malformed (startup aborts)."""
