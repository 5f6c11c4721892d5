"""Converters that write `.ninfer` artifacts: Hugging Face directories, GGUF files, random weights.

``convert(src, out)`` picks the converter from the source: a directory is a Hugging Face
checkpoint, a ``*.gguf`` file goes to the GGUF converter. Each converter is imported only when
used, so the CLI starts without loading the others.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ninfer.convert.errors import ConversionError

__all__ = ["ConversionError", "convert"]


def convert(src: str | os.PathLike[str], out: str | os.PathLike[str], progress=None) -> dict[str, Any] | None:
    """Convert ``src`` into the artifact ``out``; returns the header when the converter gives it."""
    path = Path(src)
    if path.is_dir():
        from ninfer.convert.hf import convert_hf

        return convert_hf(path, out, progress=progress)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from ninfer.convert.gguf import convert_gguf

        return convert_gguf(path, out, progress=progress)
    if not path.exists():
        raise ConversionError(f"{src}: no such file or directory")
    raise ConversionError(f"{src}: not a Hugging Face checkpoint directory or a .gguf file")
