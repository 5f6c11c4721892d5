"""The GGUF reader against files written by the independent test writer (tests/gguf_testing.py)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from gguf_testing import (ARRAY, F64, I8, I16, I32, I64, STRING, U8, U16, U64, Typed, dequantize_reference,
                          quantize, write_gguf)
from ninfer.convert.gguf_reader import GGUFError, GGUFFile


def _random_blocks(tname: str, n_blocks: int, rng: np.random.Generator) -> bytes:
    """Arbitrary block bytes (every nibble/int8 pattern) with finite f16 scales."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[tname]
    raw = bytearray(rng.integers(0, 256, size=n_blocks * size, dtype=np.uint8).tobytes())
    scales = 2 if tname == "Q4_1" else 1
    for b in range(n_blocks):
        for s in range(scales):
            struct.pack_into("<e", raw, b * size + 2 * s, float(rng.normal(0, 0.05)))
    return bytes(raw)


@pytest.mark.parametrize("version", [2, 3])
def test_metadata_of_every_value_type(tmp_path, version):
    meta = {
        "general.architecture": "llama",
        "u8": Typed(U8, 250), "i8": Typed(I8, -5), "u16": Typed(U16, 65000), "i16": Typed(I16, -300),
        "u32": 4_000_000_000, "i32": -7, "f32": 0.5, "yes": True, "no": False,
        "u64": Typed(U64, 2**40), "i64": Typed(I64, -(2**40)), "f64": Typed(F64, 1e-300),
        "s": "héllo ✓",
        "ints": Typed(ARRAY, [1, -2, 3], I32),
        "strs": ["a", "", "日本"],
        "bools": [True, False, True],
        "nested": Typed(ARRAY, [Typed(ARRAY, [1, 2], U8), Typed(ARRAY, ["x"], STRING)], ARRAY),
    }
    path = write_gguf(tmp_path / "m.gguf", meta, [], version=version)
    with GGUFFile(path) as g:
        assert g.version == version
        md = g.metadata
    assert md["u8"] == 250 and md["i8"] == -5 and md["u16"] == 65000 and md["i16"] == -300
    assert md["u32"] == 4_000_000_000 and md["i32"] == -7 and md["f32"] == 0.5
    assert md["yes"] is True and md["no"] is False
    assert md["u64"] == 2**40 and md["i64"] == -(2**40) and md["f64"] == 1e-300
    assert md["s"] == "héllo ✓"
    assert md["ints"] == [1, -2, 3] and md["strs"] == ["a", "", "日本"] and md["bools"] == [True, False, True]
    assert md["nested"] == [[1, 2], ["x"]]


@pytest.mark.parametrize("tname", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_dequantization_matches_the_formulas(tmp_path, tname):
    rng = np.random.default_rng(1)
    raw = _random_blocks(tname, 3 * 4, rng)  # shape (3, 128): 4 blocks a row
    path = write_gguf(tmp_path / "q.gguf", {}, [("w", tname, (3, 128), raw)])
    with GGUFFile(path) as g:
        got = g.dequantize("w")
    assert got.dtype == np.float32 and got.shape == (3, 128)
    np.testing.assert_array_equal(got.reshape(-1), dequantize_reference(raw, tname))


@pytest.mark.parametrize("tname", ["F32", "F16", "BF16"])
def test_float_types(tmp_path, tname):
    x = np.random.default_rng(2).normal(size=(4, 6)).astype(np.float32)
    raw = quantize(x, tname)
    path = write_gguf(tmp_path / "f.gguf", {}, [("w", tname, (4, 6), raw)])
    with GGUFFile(path) as g:
        got = g.dequantize("w")
    np.testing.assert_array_equal(got.reshape(-1), dequantize_reference(raw, tname))
    tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2}[tname]
    np.testing.assert_allclose(got, x, rtol=tol, atol=tol)


@pytest.mark.parametrize("tname,step", [("Q8_0", 1 / 127), ("Q4_0", 1 / 8), ("Q4_1", 1 / 15)])
def test_quantize_then_dequantize_is_close(tmp_path, tname, step):
    x = np.random.default_rng(3).normal(size=(2, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "q.gguf", {}, [("w", tname, (2, 64), quantize(x, tname))])
    with GGUFFile(path) as g:
        got = g.dequantize("w")
    # Each value is within one quantization step of the block's range (plus f16 scale rounding).
    block_range = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) * (2 if tname == "Q4_1" else 1)
    assert np.all(np.abs(got.reshape(-1, 32) - x.reshape(-1, 32)) <= block_range * step * 1.01)


def test_custom_alignment_and_several_tensors(tmp_path):
    a = np.arange(5, dtype=np.float32)
    b = np.arange(64, dtype=np.float32).reshape(2, 32) / 7
    path = write_gguf(tmp_path / "a.gguf", {}, [("a", "F32", (5,), quantize(a, "F32")),
                                                 ("b", "F16", (2, 32), quantize(b, "F16"))], alignment=256)
    with GGUFFile(path) as g:
        assert g.alignment == 256 and g.data_offset % 256 == 0
        assert g.tensors["b"].offset % 256 == 0
        np.testing.assert_array_equal(g.dequantize("a"), a)
        np.testing.assert_allclose(g.dequantize("b"), b, rtol=1e-3)
        assert list(g.tensors) == ["a", "b"] and g.tensors["b"].shape == (2, 32)


def test_unsupported_type_names_tensor_and_type(tmp_path):
    path = write_gguf(tmp_path / "k.gguf", {}, [("blk.0.ffn_up.weight", "Q4_K", (1, 256), bytes(144))])
    with GGUFFile(path) as g:
        with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_up\.weight' has type Q4_K.*cannot dequantize"):
            g.dequantize("blk.0.ffn_up.weight")


def test_bad_magic(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(path)


def test_version_1_is_refused(tmp_path):
    path = tmp_path / "v1.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(GGUFError, match="unsupported GGUF version 1"):
        GGUFFile(path)


def test_big_endian_is_refused(tmp_path):
    path = tmp_path / "be.gguf"
    path.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    with pytest.raises(GGUFError, match="big-endian"):
        GGUFFile(path)


def test_truncated_tensor_data(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", {}, [("w", "F32", (64,), bytes(256))])
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(GGUFError, match=r"tensor 'w' ends at byte .* past the end"):
        GGUFFile(path)


def test_truncated_metadata(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", {"general.name": "x" * 100}, [])
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(GGUFError, match="truncated while reading value of 'general.name'"):
        GGUFFile(path)


def test_missing_tensor_name(tmp_path):
    path = write_gguf(tmp_path / "e.gguf", {}, [])
    with GGUFFile(path) as g, pytest.raises(GGUFError, match="no tensor named 'nope'"):
        g.dequantize("nope")
