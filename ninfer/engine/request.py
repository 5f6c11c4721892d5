"""What one generation request asks of the Engine: token ids in, budgets, sampler and stops.

The server fills these from a rendered prompt; the Engine validates them at ``ticket.submit`` and
rejects bad values with a ``ValueError`` naming the field (a client error), or a typed capacity
error from :mod:`ninfer.engine.errors`.
"""

from __future__ import annotations

from typing import Sequence

import attrs

MAX_CACHE_HINTS = 4


def _ids(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen(kw_only=True)
class SamplingOverrides:
    """Request-level sampler fields; ``None`` inherits the process flag, then the preset."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None


@attrs.frozen(kw_only=True)
class ThinkingControl:
    """Reasoning-channel facts the Engine needs; the template and tokenizer supply the ids.

    ``budget`` caps model-origin thinking tokens (None: no cap). At the cap, unless the model
    closed thinking itself (``end_think_id``), the Engine commits ``close_ids`` (the template's
    early-close guidance followed by the close marker) without sampling them.
    """

    starts_in_thinking: bool = False
    budget: int | None = None
    close_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    end_think_id: int | None = None


@attrs.frozen(kw_only=True)
class GenerationRequest:
    prompt: tuple[int, ...] = attrs.field(converter=_ids)
    max_tokens: int
    sampling: SamplingOverrides = SamplingOverrides()
    # Token ids that end generation with finish "stop" (EOS and the like); the Engine adds the
    # model's own EOS ids when it opened an artifact.
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    thinking: ThinkingControl = ThinkingControl()
    # Prompt length before the response's generation prologue: the stable boundary a later turn
    # may keep while re-rendering the rest. None: no input checkpoint.
    input_checkpoint: int | None = None
    # Up to four extra exact prompt frontiers worth retaining (cache hints), in tokens.
    cache_boundaries: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    # Responses chains: the latest endpoint of this key is retained preferentially.
    session_key: str | None = None
    # Whether the completed endpoint (prompt + output) is retained for a continuation.
    capture_endpoint: bool = True
    # Free-form identity copied into scheduling records (e.g. the server's request id).
    request_id: str | None = None
