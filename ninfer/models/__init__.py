"""Model descriptions: configs with derived shapes and canonical tensor names (no compute)."""

from ninfer.models.dense import ARCHITECTURES, DenseConfig, RopeScaling, tensor_names

__all__ = ["ARCHITECTURES", "DenseConfig", "RopeScaling", "tensor_names"]
