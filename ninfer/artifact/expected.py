"""Which tensors a declared component must hold, from the model descriptions in ninfer.models.

Returns None where no description exists yet (e.g. a `vision` component before its model lands);
such components are then only checked for placement, not completeness.
"""

from __future__ import annotations

from typing import Any

from ninfer.models import ARCHITECTURES, HYBRID_ARCHITECTURES, DenseConfig, HybridConfig, tensor_names
from ninfer.models.hybrid import tensor_names as hybrid_tensor_names


def expected_tensors(header: dict[str, Any], component: str) -> dict[str, tuple[int, ...]] | None:
    architecture = header["metadata"]["architecture"]
    if component == "text" and architecture in HYBRID_ARCHITECTURES:
        try:
            return hybrid_tensor_names(HybridConfig.from_json(header["config"]))
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"header JSON invalid: config is not a valid {architecture} config: {exc}") from exc
    if component != "text" or architecture not in ARCHITECTURES:
        return None
    try:
        config = DenseConfig.from_json(header["config"])
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"header JSON invalid: config is not a valid {architecture} config: {exc}") from exc
    return tensor_names(config)
