"""Model signature: a stable name for "this architecture at these shapes with this KV dtype".

Context-cost presets (``--context-cost-presets``) key their prefill entries by it, since prefill
cost per token depends on the model's shapes, not on its weights. The signature is derived from
what every runner already exposes: its parsed model config (``runner.config``, an attrs class
or a dict) and the dtype of one KV page as ``read_pages`` returns it (uint16 pages are bf16 bit
patterns, named ``bfloat16``). Only the architecture
name and the integer and categorical shape fields count; floats (norm eps, RoPE theta), flags
and ``max_position_embeddings`` do not change the cost of a token and are left out, so the same
model converted twice, or with another context setting, keeps its signature.

The form is ``<architecture>-h<hidden>-l<layers>-<kv dtype>-<12 hex digits>``: readable enough to
recognise in a log, and the digest (SHA-256 of the canonical JSON of every counted field) tells
apart shapes the readable part does not show.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs
import numpy as np

# Integer fields that do not change the per-token cost of a model.
_IGNORED = frozenset({"max_position_embeddings"})


def model_signature(runner: Any) -> str | None:
    """The runner's model signature, or None when it exposes no model config (a test double).
    Reads one KV page, so call it on the thread that owns the runner."""
    config = getattr(runner, "config", None)
    if config is None:
        return None
    if attrs.has(type(config)):
        config = attrs.asdict(config, recurse=True)
    if not isinstance(config, dict) or not isinstance(config.get("architecture"), str):
        return None
    dtype = runner.read_pages([0]).dtype
    kv_dtype = "bfloat16" if dtype == np.uint16 else str(dtype)
    return signature_of(config, kv_dtype)


def signature_of(config: dict, kv_dtype: str) -> str:
    """The signature of a model config (its ``architecture`` and shape fields) and KV dtype."""
    counted = {k: _shape(v) for k, v in sorted(config.items()) if k not in _IGNORED and _shape(v) is not None}
    counted["architecture"] = config["architecture"]
    counted["kv_dtype"] = kv_dtype
    digest = hashlib.sha256(json.dumps(counted, sort_keys=True).encode()).hexdigest()[:12]
    hidden, layers = config.get("hidden_size", "?"), config.get("num_layers", "?")
    return f"{config['architecture']}-h{hidden}-l{layers}-{kv_dtype}-{digest}"


def _shape(value: Any) -> Any:
    """``value`` when it is a shape (an int, a kind name, or a sequence of them), else None."""
    if isinstance(value, bool) or isinstance(value, float) or value is None:
        return None
    if isinstance(value, (int, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_shape(v) for v in value]
        return items if all(v is not None for v in items) else None
    return None  # nested objects (RoPE scaling: floats and a kind) do not change the cost
