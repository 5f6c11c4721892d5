"""The `.ninfer` v3 artifact: one mmap-able file holding a model's config, text assets and tensors.

See docs/artifact.md for the layout and docs/internals.md for this package's contract.
"""

from ninfer.artifact.errors import ArtifactError
from ninfer.artifact.format import ALIGNMENT, COMPONENTS, DTYPES, VERSION, TensorInfo
from ninfer.artifact.reader import Artifact, open_artifact
from ninfer.artifact.writer import TensorSource, write_artifact

__all__ = [
    "ALIGNMENT", "COMPONENTS", "DTYPES", "VERSION", "Artifact", "ArtifactError", "TensorInfo",
    "TensorSource", "open_artifact", "write_artifact",
]
