"""A tiny GGUF writer and llama.cpp-style quantizers, for tests only.

Written from the format description (little-endian header, typed metadata, tensor infos with dims
ne0 first, data aligned to general.alignment), independently of ninfer.convert.gguf_reader, so the
reader is tested against a second implementation rather than against itself.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.text.synthetic import byte_alphabet  # GPT-2 byte spelling, not part of the GGUF reader

TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q5_0": 6, "Q4_K": 12, "BF16": 30}

# Metadata value type ids of the GGUF format.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}


class Typed:
    """A metadata value with an explicit GGUF type (``elem`` is the element type of an array)."""

    def __init__(self, vtype: int, value: Any, elem: int | None = None) -> None:
        self.vtype, self.value, self.elem = vtype, value, elem


def _infer(value: Any) -> Typed:
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(BOOL, value)
    if isinstance(value, int):
        return Typed(U32 if value >= 0 else I32, value)
    if isinstance(value, float):
        return Typed(F32, value)
    if isinstance(value, str):
        return Typed(STRING, value)
    if isinstance(value, (list, tuple)):
        elem = _infer(value[0]).vtype if value else U32
        return Typed(ARRAY, list(value), elem)
    raise TypeError(f"no GGUF type for {value!r}")


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(t: Typed) -> bytes:
    if t.vtype == STRING:
        return _string(t.value)
    if t.vtype == ARRAY:
        out = struct.pack("<IQ", t.elem, len(t.value))
        for item in t.value:
            out += _value(item if isinstance(item, Typed) else Typed(t.elem, item))
        return out
    return struct.pack(_FMT[t.vtype], t.value)


def write_gguf(path: Path, metadata: dict[str, Any], tensors: list[tuple[str, str, tuple[int, ...], bytes]],
               *, version: int = 3, alignment: int = 32) -> Path:
    """Write a GGUF file. ``tensors``: (name, type name, NumPy shape, raw bytes)."""
    meta = dict(metadata)
    if alignment != 32:
        meta["general.alignment"] = Typed(U32, alignment)
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(meta)))
    for key, value in meta.items():
        t = _infer(value)
        out += _string(key) + struct.pack("<I", t.vtype) + _value(t)
    offset, blobs = 0, []
    for name, tname, shape, raw in tensors:
        dims = list(reversed(shape))  # GGUF lists ne0 (the fastest dimension) first
        out += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", TYPE_IDS[tname], offset)
        blobs.append((offset, raw))
        offset += -(-len(raw) // alignment) * alignment
    out += bytes(-len(out) % alignment)
    data_start = len(out)
    out += bytes(offset)
    for off, raw in blobs:
        out[data_start + off:data_start + off + len(raw)] = raw
    path.write_bytes(bytes(out))
    return path


# --- quantizers following llama.cpp's reference (quantize_row_*_ref) ---------------------------------

def quantize(x: np.ndarray, tname: str) -> bytes:
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if tname == "F32":
        return flat.tobytes()
    if tname == "F16":
        return flat.astype("<f2").tobytes()
    if tname == "BF16":
        return (flat.view(np.uint32) >> 16).astype("<u2").tobytes()  # truncation is fine for a test
    blocks = flat.reshape(-1, 32)
    return b"".join(_QUANT[tname](b) for b in blocks)


def _q8_0(b: np.ndarray) -> bytes:
    amax = float(np.abs(b).max())
    d = amax / 127.0
    q = np.round(b / d) if d else np.zeros(32)
    return struct.pack("<e", d) + q.astype(np.int8).tobytes()


def _q4_0(b: np.ndarray) -> bytes:
    big = float(b[np.argmax(np.abs(b))])  # signed value of largest magnitude
    d = big / -8.0
    inv = 1.0 / d if d else 0.0
    q = np.minimum(15, (b * inv + 8.5).astype(np.int8)).astype(np.uint8)
    return struct.pack("<e", d) + (q[:16] | (q[16:] << 4)).astype(np.uint8).tobytes()


def _q4_1(b: np.ndarray) -> bytes:
    lo, hi = float(b.min()), float(b.max())
    d = (hi - lo) / 15.0
    inv = 1.0 / d if d else 0.0
    q = np.minimum(15, ((b - lo) * inv + 0.5).astype(np.int8)).astype(np.uint8)
    return struct.pack("<ee", d, lo) + (q[:16] | (q[16:] << 4)).astype(np.uint8).tobytes()


_QUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}


def dequantize_reference(raw: bytes, tname: str) -> np.ndarray:
    """Slow per-element dequantization straight from the block layouts, for comparison."""
    out: list[float] = []
    if tname in ("F32", "F16"):
        return np.frombuffer(raw, dtype="<f4" if tname == "F32" else "<f2").astype(np.float32)
    if tname == "BF16":
        return np.array([struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)],
                        dtype=np.float32)
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[tname]
    for start in range(0, len(raw), size):
        blk = raw[start:start + size]
        if tname == "Q8_0":
            d = struct.unpack("<e", blk[:2])[0]
            out += [d * struct.unpack("<b", blk[2 + j:3 + j])[0] for j in range(32)]
            continue
        d, m = (struct.unpack("<e", blk[:2])[0], 0.0) if tname == "Q4_0" else struct.unpack("<ee", blk[:4])
        qs = blk[2:] if tname == "Q4_0" else blk[4:]
        nib = [qs[j] & 0x0F for j in range(16)] + [qs[j] >> 4 for j in range(16)]
        out += [(q - 8) * d for q in nib] if tname == "Q4_0" else [q * d + m for q in nib]
    return np.array(out, dtype=np.float32)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF halves → interleaved pairs)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# --- a tiny byte-level BPE vocabulary in GGUF form -----------------------------------------------------

def tiny_tokenizer_metadata(pre: str = "gpt2") -> dict[str, Any]:
    """256 byte tokens, a few merges ("Ġ" + "t", "h" + "e", "Ġt" + "he"), ChatML control tokens."""
    tokens = byte_alphabet() + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    types = [1] * 259 + [3, 3, 3, 4]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": Typed(ARRAY, types, I32),
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.bos_token_id": 259 + 1,
        "tokenizer.ggml.eos_token_id": 259 + 2,
        "tokenizer.ggml.padding_token_id": 259,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
    }


# --- a tiny llama model in GGUF form (the layout llama.cpp's converter writes) ---------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, VOCAB = 64, 4, 2, 16, 96, 2, 263

# One type per tensor role, so every supported block format passes through the converter.
TYPES = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "F16", "attn_output": "BF16",
         "ffn_gate": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "Q4_0", "output": "F16"}


def tiny_llama_metadata(**extra):
    md = {
        "general.architecture": "llama", "general.name": "tiny test llama",
        "llama.block_count": LAYERS, "llama.context_length": 1024, "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS, "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-6, "llama.vocab_size": VOCAB,
        "llama.rope.dimension_count": HEAD_DIM,
    }
    md.update(tiny_tokenizer_metadata())
    md.update(extra)
    return md


def hf_weights(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights in Hugging Face layout, keyed by GGUF tensor name (before llama.cpp's q/k permutation)."""
    rng = np.random.default_rng(seed)
    w = {"token_embd.weight": rng.normal(size=(VOCAB, HIDDEN)), "output_norm.weight": 1 + rng.normal(size=HIDDEN) / 10}
    if not tied:
        w["output.weight"] = rng.normal(size=(VOCAB, HIDDEN)) / 8
    for i in range(LAYERS):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = 1 + rng.normal(size=HIDDEN) / 10
        w[b + "ffn_norm.weight"] = 1 + rng.normal(size=HIDDEN) / 10
        w[b + "attn_q.weight"] = rng.normal(size=(HEADS * HEAD_DIM, HIDDEN)) / 8
        w[b + "attn_k.weight"] = rng.normal(size=(KV_HEADS * HEAD_DIM, HIDDEN)) / 8
        w[b + "attn_v.weight"] = rng.normal(size=(KV_HEADS * HEAD_DIM, HIDDEN)) / 8
        w[b + "attn_output.weight"] = rng.normal(size=(HIDDEN, HEADS * HEAD_DIM)) / 8
        w[b + "ffn_gate.weight"] = rng.normal(size=(FFN, HIDDEN)) / 8
        w[b + "ffn_up.weight"] = rng.normal(size=(FFN, HIDDEN)) / 8
        w[b + "ffn_down.weight"] = rng.normal(size=(HIDDEN, FFN)) / 8
    return {k: v.astype(np.float32) for k, v in w.items()}


def type_of(name: str) -> str:
    return TYPES.get(name.split(".")[-2], "F32")


def write_tiny_llama(path, *, tied=False, types=type_of, metadata=None, seed=0, extra_tensors=()):
    """A tiny llama GGUF as llama.cpp's converter would write it; returns the raw bytes per tensor."""
    hf = hf_weights(tied, seed)
    raws, tensors = {}, []
    for name, w in hf.items():
        if name.endswith("attn_q.weight"):
            w = permute_rope_rows(w, HEADS)
        elif name.endswith("attn_k.weight"):
            w = permute_rope_rows(w, KV_HEADS)
        raws[name] = quantize(w, types(name))
        tensors.append((name, types(name), w.shape, raws[name]))
    write_gguf(path, metadata or tiny_llama_metadata(), tensors + list(extra_tensors))
    return hf, raws
