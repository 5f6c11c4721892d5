"""Which tensors a declared component must hold, from the model descriptions in ninfer.models.

Returns None where no description exists yet (e.g. a `vision` component before its model lands);
such components are then only checked for placement, not completeness.
"""

from __future__ import annotations

from typing import Any, Callable

from ninfer.models import dense, hybrid

# architecture -> (config class, canonical names of its text component)
_TEXT_MODELS: dict[str, tuple[Any, Callable[[Any], dict[str, tuple[int, ...]]]]] = {
    **{a: (dense.DenseConfig, dense.tensor_names) for a in dense.ARCHITECTURES},
    **{a: (hybrid.HybridConfig, hybrid.tensor_names) for a in hybrid.ARCHITECTURES},
}


def expected_tensors(header: dict[str, Any], component: str) -> dict[str, tuple[int, ...]] | None:
    architecture = header["metadata"]["architecture"]
    if component != "text" or architecture not in _TEXT_MODELS:
        return None
    config_cls, tensor_names = _TEXT_MODELS[architecture]
    try:
        config = config_cls.from_json(header["config"])
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"header JSON invalid: config is not a valid {architecture} config: {exc}") from exc
    return tensor_names(config)
