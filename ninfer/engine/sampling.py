"""Sampler parameter resolution: architecture preset → process flags → request → ``--greedy``.

The preset comes from the artifact's generation block (``presets.thinking`` /
``presets.non_thinking``, else ``defaults``) for the request's initial thinking mode. Seeds: the
request's seed, else the process ``--seed``, else a fresh random signed 64-bit value. The runner's
RNG is keyed by (seed, output index), so a seeded request is reproducible in any batch.
"""

from __future__ import annotations

import secrets
from typing import Any, Mapping

import attrs

from ninfer.backends.runner import SamplingRow
from ninfer.engine.config import EngineConfig
from ninfer.engine.request import SamplingOverrides

FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
# Used when the artifact carries no generation defaults: softmax over the top-20 cap (top_k 0
# selects the cap, spec --top-k), no other truncation or penalty.
GENERIC_PRESET = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0}


def preset_for(generation: Mapping[str, Any] | None, thinking: bool) -> dict[str, float]:
    """The architecture preset for a thinking mode, completed with generic values."""
    generation = generation or {}
    presets = generation.get("presets") or {}
    chosen = presets.get("thinking" if thinking else "non_thinking") or generation.get("defaults") or {}
    merged = dict(GENERIC_PRESET)
    merged.update({k: chosen[k] for k in FIELDS if chosen.get(k) is not None})
    return merged


def validate_overrides(o: SamplingOverrides) -> None:
    """Reject out-of-range request fields, naming the field."""
    if o.temperature is not None and not 0.0 <= o.temperature <= 2.0:
        raise ValueError(f"sampling.temperature must be in [0, 2], got {o.temperature}")
    for name in ("top_p", "min_p"):
        value = getattr(o, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"sampling.{name} must be in [0, 1], got {value}")
    if o.top_k is not None and not 0 <= o.top_k <= 20:
        raise ValueError(f"sampling.top_k must be in 0..20, got {o.top_k}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(o, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise ValueError(f"sampling.{name} must be in [-2, 2], got {value}")
    if o.seed is not None and not -(2**63) <= o.seed < 2**63:
        raise ValueError(f"sampling.seed must be a signed 64-bit integer, got {o.seed}")


def fresh_seed() -> int:
    return secrets.randbits(64) - 2**63


def resolve(preset: Mapping[str, float], config: EngineConfig, request: SamplingOverrides) -> SamplingRow:
    """The row template of one request (``step`` is filled per sampled token)."""
    values = {k: preset[k] for k in FIELDS}
    for source in (config, request):
        for k in FIELDS:
            v = getattr(source, k)
            if v is not None:
                values[k] = v
    if config.greedy:
        values["temperature"] = 0.0
    seed = request.seed if request.seed is not None else config.seed
    if seed is None:
        seed = fresh_seed()
    return SamplingRow(
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        top_k=int(values["top_k"]),
        min_p=float(values["min_p"]),
        presence_penalty=float(values["presence_penalty"]),
        frequency_penalty=float(values["frequency_penalty"]),
        seed=int(seed),
    )


def at_step(row: SamplingRow, step: int) -> SamplingRow:
    return attrs.evolve(row, step=step)
