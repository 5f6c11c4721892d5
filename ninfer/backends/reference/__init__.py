"""The NumPy reference backend: the executable specification of the model and the CPU path."""

from ninfer.backends.reference.runner import ReferenceRunner
from ninfer.backends.reference.hybrid_runner import HybridRunner

__all__ = ["HybridRunner", "ReferenceRunner"]
