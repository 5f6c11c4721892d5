"""The .ninfer v3 artifact: round trips through the real writer and reader, and every bad file
fails with one ArtifactError naming its problem."""

from __future__ import annotations

import json
import math
import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from ninfer.artifact import ALIGNMENT, ArtifactError, TensorSource, open_artifact, write_artifact
from ninfer.artifact.bf16 import from_float32, to_float32
from ninfer.artifact.format import PREAMBLE, align_up
from ninfer.convert.random_model import PRESETS, make_random_artifact, random_weight
from ninfer.models import tensor_names


@pytest.fixture
def qwen_path(tmp_path):
    path = tmp_path / "tiny.ninfer"
    make_random_artifact(path, "tiny-qwen3", seed=7)
    return path


def _plain_fields(components=("vision",)):
    return {"metadata": {"architecture": "TestArch"}, "config": {}, "tokenizer": {"json": "{}"},
            "components": list(components)}


# ----- round trip


def test_round_trip_values_and_header(qwen_path):
    config = PRESETS["tiny-qwen3"]
    with open_artifact(qwen_path) as art:
        assert art.components == ("text",)
        assert art.metadata["architecture"] == "Qwen3ForCausalLM"
        assert art.config == config.to_json()
        assert set(art.tensor_names()) == set(tensor_names(config))
        for name, shape in tensor_names(config).items():
            got = art.tensor(name)
            assert got.shape == shape and got.dtype == np.uint16
            np.testing.assert_array_equal(got, from_float32(random_weight(name, shape, seed=7)))
        assert art.tensor_info("embed").quantization is None
        assert art.special_tokens["eos_token_ids"]
        assert "<|im_start|>" in art.chat_template


def test_tensors_are_zero_copy_aligned_readonly_views(qwen_path):
    with open(qwen_path, "rb") as f:
        _, _, _, hlen = PREAMBLE.unpack(f.read(PREAMBLE.size))
    data_start = align_up(PREAMBLE.size + hlen)
    art = open_artifact(qwen_path)
    for name in art.tensor_names():
        info = art.tensor_info(name)
        assert (data_start + info.offset) % ALIGNMENT == 0
        view = art.tensor(name)
        assert not view.flags.owndata and not view.flags.writeable
    # Bytes on disk at the recorded offset are the tensor's bytes: the view reads the file itself.
    info = art.tensor_info("final_norm")
    with open(qwen_path, "rb") as f:
        f.seek(data_start + info.offset)
        assert f.read(info.nbytes) == art.tensor("final_norm").tobytes()
    art.close()


def test_tokenizer_json_loads_with_tokenizers(qwen_path):
    from tokenizers import Tokenizer

    art = open_artifact(qwen_path)
    tok = Tokenizer.from_str(art.tokenizer_json)
    ids = tok.encode("héllo <|im_end|>").ids
    assert tok.decode(ids, skip_special_tokens=False) == "héllo <|im_end|>"


def test_only_enabled_components_are_readable(tmp_path):
    path = tmp_path / "two.ninfer"
    patch = np.arange(12, dtype=np.float32).reshape(3, 4)
    fields = {**_plain_fields(("vision", "mtp")), "metadata": {"architecture": "TestArch"}}
    write_artifact(path, fields, [TensorSource.from_array("v.patch", "vision", "f32", patch),
                                  TensorSource.from_array("m.ids", "mtp", "i32", np.arange(5, dtype=np.int32))])
    art = open_artifact(path, components=("vision",))
    assert art.components == ("vision", "mtp") and art.enabled == ("vision",)
    np.testing.assert_array_equal(art.tensor("v.patch"), patch)
    with pytest.raises(ArtifactError, match="component 'mtp', which this process did not enable"):
        art.tensor("m.ids")
    with pytest.raises(ArtifactError, match=r"component\(s\) text requested"):
        open_artifact(path, components=("text",))
    assert open_artifact(path, components=None).tensor("m.ids").tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("dtype,np_dtype", [("f16", np.float16), ("f32", np.float32), ("i32", np.int32),
                                            ("u8", np.uint8), ("i8", np.int8), ("bf16", np.uint16)])
def test_every_dtype_round_trips(tmp_path, dtype, np_dtype):
    values = (np.arange(-6, 6) * 3).astype(np_dtype).reshape(2, 2, 3)
    path = tmp_path / f"{dtype}.ninfer"
    write_artifact(path, _plain_fields(), [TensorSource.from_array("t", "vision", dtype, values)])
    np.testing.assert_array_equal(open_artifact(path, components=None).tensor("t"), values)


# ----- bf16


def test_bf16_round_to_nearest_even_and_specials():
    one = 0x3F800000
    cases = {
        one: 0x3F80,                # exact
        one + 0x8000: 0x3F80,       # half-way, lower kept bit even: stays
        one + 0x18000: 0x3F82,      # half-way, lower kept bit odd: rounds up to even
        one + 0x8001: 0x3F81,       # just above half-way rounds up
        one + 0x7FFF: 0x3F80,       # just below half-way rounds down
        0x7F7FFFFF: 0x7F80,         # largest float rounds to +inf
        0xFF800000: 0xFF80,         # -inf stays
        0x80000000: 0x8000,         # -0 stays
    }
    bits = np.array(list(cases), dtype=np.uint32)
    np.testing.assert_array_equal(from_float32(bits.view(np.float32)), np.array(list(cases.values()), np.uint16))
    nan = from_float32(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(to_float32(nan)).all()
    values = np.array([1.5, -2.25, 2.0**100, -(2.0**-130)], dtype=np.float32)
    np.testing.assert_array_equal(to_float32(from_float32(values)), values)  # bf16-exact values, subnormal too


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 2**32 - 1))
@example(0x7F7FFFFF)  # above half-way past the largest bf16: overflows to +inf
@example(0x7F7F7FFF)  # just below half-way: stays the largest finite bf16
@example(0x80018000)  # negative subnormal tie
def test_bf16_rounding_matches_exact_nearest_even(bits):
    """Against exact arithmetic: the nearest bf16 (ties to the even mantissa) of any finite f32,
    rounding as if the exponent were unbounded (so past the largest bf16 it becomes infinity)."""
    value = np.array([bits], np.uint32).view(np.float32)
    assume(np.isfinite(value[0]))
    lo = bits >> 16

    def as_float(b):
        f = float(np.array([b << 16], np.uint32).view(np.float32)[0])
        return math.copysign(2.0**128, f) if math.isinf(f) else f  # the unbounded next value

    exact = float(value[0])
    below, above = abs(as_float(lo) - exact), abs(as_float(lo + 1) - exact)
    want = lo if below < above or (below == above and lo % 2 == 0) else lo + 1
    got = int(from_float32(value)[0])
    assert got == want, f"{bits:#010x} -> {got:#06x}, want {want:#06x}"


# ----- writer behaviour


def test_writer_streams_one_tensor_at_a_time(tmp_path):
    size = 4 << 20  # 4 MiB per tensor, 8 tensors

    def loader(i):
        return lambda: np.full(size, i, dtype=np.uint8)

    sources = [TensorSource(f"t{i}", "vision", "u8", (size,), loader(i)) for i in range(8)]
    tracemalloc.start()
    try:
        write_artifact(tmp_path / "big.ninfer", _plain_fields(), sources)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * size, f"peak {peak} bytes: the writer held more than about one tensor"
    art = open_artifact(tmp_path / "big.ninfer", components=None)
    assert [int(art.tensor(f"t{i}")[-1]) for i in range(8)] == list(range(8))


def test_failed_write_leaves_no_file(tmp_path):
    def boom():
        raise RuntimeError("source vanished")

    path = tmp_path / "out.ninfer"
    sources = [TensorSource.from_array("a", "vision", "f32", np.zeros(3, np.float32)),
               TensorSource("b", "vision", "f32", (3,), boom)]
    with pytest.raises(RuntimeError, match="source vanished"):
        write_artifact(path, _plain_fields(), sources)
    assert os.listdir(tmp_path) == []


def test_writer_rejects_load_that_disagrees_with_declaration(tmp_path):
    bad = TensorSource("a", "vision", "f32", (4,), lambda: np.zeros(3, np.float32))
    with pytest.raises(ArtifactError, match=r"tensor 'a': load\(\) gave shape \[3\], declared \[4\]"):
        write_artifact(tmp_path / "x.ninfer", _plain_fields(), [bad])
    wrong = TensorSource("a", "vision", "bf16", (3,), lambda: np.zeros(3, np.float32))
    with pytest.raises(ArtifactError, match="load\\(\\) gave float32, declared bf16"):
        write_artifact(tmp_path / "x.ninfer", _plain_fields(), [wrong])
    assert os.listdir(tmp_path) == []


def test_writer_needs_an_existing_output_directory(tmp_path):
    with pytest.raises(ArtifactError, match="the output directory .*nowhere does not exist"):
        write_artifact(tmp_path / "nowhere" / "x.ninfer", _plain_fields(),
                       [TensorSource.from_array("a", "vision", "u8", np.zeros(2, np.uint8))])


def test_writer_refuses_incomplete_text_component(tmp_path):
    config = PRESETS["tiny-llama"]
    names = dict(tensor_names(config))
    del names["layers.1.down"]
    sources = [TensorSource(n, "text", "bf16", s, lambda: pytest.fail("loaded before validation"))
               for n, s in names.items()]
    fields = {"metadata": {"architecture": config.architecture}, "config": config.to_json(),
              "tokenizer": {"json": "{}"}}
    with pytest.raises(ArtifactError, match="tensor 'layers.1.down' missing for declared component 'text'"):
        write_artifact(tmp_path / "x.ninfer", fields, sources)


# ----- bad files: one clear message each


def _split(path):
    raw = path.read_bytes()
    magic, version, flags, hlen = PREAMBLE.unpack_from(raw)
    header = json.loads(raw[PREAMBLE.size:PREAMBLE.size + hlen])
    data = raw[align_up(PREAMBLE.size + hlen):]
    return header, data


def _rewrite(path, header, data, version=3, magic=b"NINFER\x00\x00"):
    raw = json.dumps(header).encode()
    start = align_up(PREAMBLE.size + len(raw))
    out = PREAMBLE.pack(magic, version, 0, len(raw)) + raw
    path.write_bytes(out + b"\0" * (start - len(out)) + data)


def _expect(path, pattern):
    with pytest.raises(ArtifactError, match=pattern) as info:
        open_artifact(path)
    assert str(info.value).startswith(str(path))


def test_wrong_magic(qwen_path):
    header, data = _split(qwen_path)
    _rewrite(qwen_path, header, data, magic=b"GGUF\x03\x00\x00\x00")
    _expect(qwen_path, "not a .ninfer artifact: wrong magic")


def test_unsupported_version(qwen_path):
    header, data = _split(qwen_path)
    _rewrite(qwen_path, header, data, version=2)
    _expect(qwen_path, "unsupported format version 2")


def test_truncated_data(qwen_path):
    raw = qwen_path.read_bytes()
    qwen_path.write_bytes(raw[:-100])
    _expect(qwen_path, "truncated: tensor data needs")


def test_truncated_preamble_and_header(qwen_path):
    raw = qwen_path.read_bytes()
    qwen_path.write_bytes(raw[:10])
    _expect(qwen_path, "truncated: 10 bytes is shorter than the 24-byte preamble")
    qwen_path.write_bytes(raw[:500])
    _expect(qwen_path, "truncated: header of .* bytes does not fit")


def test_offset_out_of_range(qwen_path):
    header, data = _split(qwen_path)
    header["tensors"][-1]["offset"] += 100 * ALIGNMENT
    _rewrite(qwen_path, header, data)
    _expect(qwen_path, f"tensor '{header['tensors'][-1]['name']}' at offset .* is out of range")


def test_overlapping_tensors(qwen_path):
    header, data = _split(qwen_path)
    header["tensors"][2]["offset"] = header["tensors"][1]["offset"]
    _rewrite(qwen_path, header, data)
    _expect(qwen_path, "tensors .* and .* overlap")


def test_missing_tensor_for_declared_component(qwen_path):
    header, data = _split(qwen_path)
    header["tensors"] = [t for t in header["tensors"] if t["name"] != "layers.0.q_norm"]
    _rewrite(qwen_path, header, data)
    _expect(qwen_path, "tensor 'layers.0.q_norm' missing for declared component 'text'")


def test_wrong_shape_for_config(qwen_path):
    header, data = _split(qwen_path)
    entry = next(t for t in header["tensors"] if t["name"] == "final_norm")
    entry["shape"], entry["nbytes"] = [32], 64
    _rewrite(qwen_path, header, data)
    _expect(qwen_path, "tensor 'final_norm' has shape \\[32\\], the 'text' config needs \\[64\\]")


def test_invalid_header_json(qwen_path):
    raw = bytearray(qwen_path.read_bytes())
    raw[PREAMBLE.size:PREAMBLE.size + 5] = b"{{{{{"
    qwen_path.write_bytes(bytes(raw))
    _expect(qwen_path, "header JSON invalid")


def test_header_missing_key(qwen_path):
    header, data = _split(qwen_path)
    del header["tokenizer"]
    _rewrite(qwen_path, header, data)
    _expect(qwen_path, "header JSON invalid: missing key\\(s\\) tokenizer")


def test_nbytes_disagreeing_with_shape(qwen_path):
    header, data = _split(qwen_path)
    header["tensors"][0]["nbytes"] += 2
    _rewrite(qwen_path, header, data)
    _expect(qwen_path, "nbytes .* does not match bf16")


def test_quantized_tensor_is_refused(qwen_path):
    header, data = _split(qwen_path)
    header["tensors"][0]["quantization"] = "nvfp4"
    _rewrite(qwen_path, header, data)
    _expect(qwen_path, "quantization 'nvfp4' is not supported by this build")


def test_close_keeps_live_views_valid_and_refuses_new_ones(qwen_path):
    art = open_artifact(qwen_path)
    view = art.tensor("final_norm")
    expected = view.copy()
    art.close()
    np.testing.assert_array_equal(view, expected)  # the map lives as long as its views
    with pytest.raises(ArtifactError, match="artifact is closed"):
        art.tensor("final_norm")
