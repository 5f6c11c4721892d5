"""Request rules the two OpenAI families (Chat Completions, Responses) share, written once.

Model identity, the prompt-caching hints (``prompt_cache_options``, ``prompt_cache_breakpoint``),
the text-output controls (``response_format``/``text.format``, ``verbosity``) and ``tool_choice``
mean the same in both; only where the field sits differs, so each reader takes the field's path for
its errors.
"""

from __future__ import annotations

from typing import Any, Callable

from protocols import fields as f
from protocols.errors import NO_CONSTRAINED_OUTPUT, ProtocolError, invalid_type, invalid_value, missing, unsupported


def check_model(body: dict, public_model_id: str) -> str:
    model = body.get("model")
    if model is None:
        raise missing("model")
    if not isinstance(model, str) or not model:
        raise invalid_type("model", "a non-empty string")
    if model != public_model_id:
        raise ProtocolError(
            "model_not_found", f"The model '{model}' does not exist; this server serves '{public_model_id}'.", "model")
    return model


def check_advisory(body: dict) -> None:
    """Fields that only label a request (caching and abuse keys): no generation effect, but a wrong
    type or an unknown retention is still a field error."""
    for key in ("prompt_cache_key", "safety_identifier", "user"):
        f.opt_str(body, key)
    if body.get("prompt_cache_retention") not in (None, "in-memory", "in_memory", "24h"):
        raise invalid_value("prompt_cache_retention", "must be 'in-memory' or '24h'.")


def implicit_cache(body: dict) -> bool:
    """Whether the automatic prompt-cache candidate is on (``prompt_cache_options.mode``)."""
    opts = f.opt_object(body, "prompt_cache_options")
    if opts is None:
        return True
    mode = opts.get("mode", "implicit")
    if mode not in ("implicit", "explicit"):
        raise invalid_value("prompt_cache_options.mode", "must be 'implicit' or 'explicit'.")
    return mode == "implicit"


def cache_breakpoint(part: dict, where: str) -> bool:
    """Whether a content part carries an explicit ``prompt_cache_breakpoint``."""
    bp = part.get("prompt_cache_breakpoint")
    if bp is None:
        return False
    if not isinstance(bp, dict) or bp.get("mode") != "explicit":
        raise invalid_value(f"{where}.prompt_cache_breakpoint", "must be {\"mode\": \"explicit\"}.")
    return True


def check_text_format(fmt: dict, param: str) -> None:
    """Only plain text output: JSON modes need constrained decoding."""
    kind = fmt.get("type")
    if kind in ("json_object", "json_schema"):
        raise unsupported(param, NO_CONSTRAINED_OUTPUT)
    if kind != "text":
        raise invalid_value(f"{param}.type", "must be 'text', 'json_object' or 'json_schema'.")


def check_verbosity(verbosity: Any, param: str) -> None:
    if verbosity in (None, "medium"):
        return
    if verbosity not in ("low", "high"):
        raise invalid_value(param, "must be 'low', 'medium' or 'high'.")
    raise unsupported(param, "the model has no verbosity control; only 'medium' is accepted.")


def string_tool_choice(choice: Any, declared: list[str]) -> tuple[str, ...] | None:
    """The callable tools of a string ``tool_choice``; None when it is an object (the family reads it)."""
    if choice is None or choice == "auto":
        return tuple(declared)
    if choice == "none":
        return ()
    if choice == "required":
        raise unsupported("tool_choice", "'required' needs constrained decoding to force a call.")
    if not isinstance(choice, dict):
        raise invalid_value("tool_choice", "must be 'auto', 'none', 'required' or an object.")
    return None


def allowed_tools(allowed: dict, where: str, declared: list[str],
                  identity: Callable[[Any, str], str]) -> tuple[str, ...]:
    """An ``allowed_tools`` choice in auto mode: the listed tools, in declaration order.

    ``identity(entry, where)`` names one listed entry as a declared identity or raises naming it.
    """
    if allowed.get("mode", "auto") != "auto":
        raise unsupported(f"{where}.mode", "only 'auto' is supported; 'required' needs constrained decoding.")
    listed = allowed.get("tools")
    if not isinstance(listed, list):
        raise invalid_type(f"{where}.tools", "an array")
    picked = {identity(t, f"{where}.tools[{j}]") for j, t in enumerate(listed)}
    return tuple(i for i in declared if i in picked)  # declaration order, not selection order
