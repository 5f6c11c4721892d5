"""Model descriptions: configs with derived shapes and canonical tensor names (no compute)."""

from ninfer.models.dense import ARCHITECTURES, DenseConfig, RopeScaling, tensor_names
from ninfer.models.hybrid import ARCHITECTURES as HYBRID_ARCHITECTURES, HybridConfig

__all__ = ["ARCHITECTURES", "DenseConfig", "HYBRID_ARCHITECTURES", "HybridConfig", "RopeScaling", "tensor_names"]
