"""The NumPy reference backend: the executable specification of the model and the CPU path."""

from ninfer.backends.reference.runner import ReferenceRunner

__all__ = ["ReferenceRunner"]
