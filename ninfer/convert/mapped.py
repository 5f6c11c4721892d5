"""Read-only file maps for the source readers (safetensors, GGUF): tensors are viewed, not copied."""

from __future__ import annotations

import mmap
import os

from ninfer.convert.errors import ConversionError


def map_readonly(path: str, min_size: int, too_short: str,
                 error: type[ConversionError] = ConversionError) -> mmap.mmap:
    """Map ``path`` read-only; a file under ``min_size`` bytes raises ``error("{path}: {too_short} (N bytes)")``
    (an empty file cannot even be mapped)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < min_size:
            raise error(f"{path}: {too_short} ({size} bytes)")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
