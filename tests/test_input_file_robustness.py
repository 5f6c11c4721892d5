"""Malformed input files end in one error naming the file and the field, never a traceback.

Each case is a real file on disk: a Hugging Face checkpoint directory or a GGUF file for `ninfer
convert`, a `.ninfer` header for what opens artifacts (`inspect`, `generate`, `serve`), an output
path the writer cannot create, and a URL that `ninfer bench http` cannot load.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs
import pytest

from gguf_testing import tiny_llama_metadata, write_tiny_llama
from hf_fixtures import LLAMA, hf_weights, write_checkpoint
from ninfer.artifact import ArtifactError, open_artifact
from ninfer.artifact.format import PREAMBLE, align_up
from ninfer.cli import main
from ninfer.convert import ConversionError, convert
from ninfer.convert.gguf_reader import GGUFError
from ninfer.convert.random_model import PRESETS, make_random_artifact
from ninfer.models import HYBRID_ARCHITECTURES

HYBRID_FIXTURES = Path(__file__).parent / "fixtures" / "hybrid"


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


# ----- Hugging Face checkpoint directories


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("hf") / "llama", LLAMA, hf_weights(LLAMA))


def _variant(src: Path, tmp_path: Path, files: dict[str, Any]) -> Path:
    """A copy of the checkpoint ``src`` with ``files`` (name → JSON value, or raw bytes) replaced."""
    directory = tmp_path / src.name
    shutil.copytree(src, directory)
    for name, content in files.items():
        raw = content if isinstance(content, bytes) else json.dumps(content).encode()
        (directory / name).write_bytes(raw)
    return directory


def _config(**change: Any) -> dict[str, Any]:
    return {"config.json": {**LLAMA, **change}}


# (files to replace, the file the message names, the rest of the message)
HF_CASES = {
    "config is a list": ({"config.json": [LLAMA]}, "config.json", "must hold a JSON object, holds an array"),
    "config not utf-8": ({"config.json": b"\xff\xfe{}"}, "config.json", "not UTF-8 text"),
    "zero heads": (_config(num_attention_heads=0), "config.json",
                   "num_attention_heads must be a positive integer, got 0"),
    "null hidden size": (_config(hidden_size=None), "config.json", "hidden_size must be a positive integer, got null"),
    "string rope_scaling": (_config(rope_scaling="x"), "config.json", "rope_scaling must be an object, got a string"),
    "string rope_parameters": (_config(rope_parameters="x"), "config.json",
                               "rope_parameters must be an object, got a string"),
    "non-numeric vocab": (_config(vocab_size="abc"), "config.json", "vocab_size must be a positive integer, got 'abc'"),
    "fractional layers": (_config(num_hidden_layers=2.5), "config.json",
                          "num_hidden_layers must be a positive integer, got 2.5"),
    "boolean layers": (_config(num_hidden_layers=True), "config.json",
                       "num_hidden_layers must be a positive integer, got true"),
    "negative max position": (_config(max_position_embeddings=-5), "config.json",
                              "max_position_embeddings must be a positive integer, got -5"),
    "infinite max position": (_config(max_position_embeddings=math.inf), "config.json",
                              "max_position_embeddings must be a positive integer, got inf"),
    "nan epsilon": (_config(rms_norm_eps=math.nan), "config.json", "rms_norm_eps must be a positive number, got nan"),
    "string rope theta": (_config(rope_theta="x"), "config.json", "rope_theta must be a positive number, got 'x'"),
    "string rope factor": (_config(rope_scaling={"rope_type": "linear", "factor": "x"}), "config.json",
                           "rope_scaling.factor must be a positive number, got 'x'"),
    "string original max position": (
        _config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": "x"}),
        "config.json", "rope_scaling.original_max_position_embeddings must be a positive integer"),
    "list hidden_act": (_config(hidden_act=["silu"]), "config.json", "hidden_act must be a string"),
    "heads exceed hidden": (_config(num_attention_heads=128, num_key_value_heads=128), "config.json",
                            r"num_attention_heads \(128\) exceeds hidden_size \(64\)"),
    "kv heads not a divisor": (_config(num_key_value_heads=3), "config.json",
                               r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    "architectures object": (_config(architectures={"a": 1}), "config.json", "unsupported architecture"),
    "generation config list": ({"generation_config.json": [1]}, "generation_config.json",
                               "must hold a JSON object"),
    "string eos": ({"generation_config.json": {"eos_token_id": "x"}}, "generation_config.json",
                   "eos_token_id must be a non-negative integer, got 'x'"),
    "eos outside vocabulary": ({"generation_config.json": {"eos_token_id": [2, 5000]}}, "generation_config.json",
                               "eos_token_id 5000 is outside the 1024-token vocabulary"),
    "list bos": ({"generation_config.json": {"bos_token_id": [1]}}, "generation_config.json",
                 "bos_token_id must be a non-negative integer, got \\[1\\]"),
    "string temperature": ({"generation_config.json": {"temperature": "hot"}}, "generation_config.json",
                           "temperature must be a finite number, got 'hot'"),
    "tokenizer config list": ({"tokenizer_config.json": [1]}, "tokenizer_config.json", "must hold a JSON object"),
    "tokenizer list": ({"tokenizer.json": [1]}, "tokenizer.json", "must hold a JSON object"),
    "string added_tokens": ({"tokenizer.json": {"added_tokens": "x"}}, "tokenizer.json",
                            "added_tokens must be an array, got a string"),
    "added token without content": ({"tokenizer.json": {"added_tokens": [{"id": 3, "special": True}]}},
                                    "tokenizer.json", "lacks 'added_tokens\\[0\\].content'"),
    "tokenizer without a model": ({"tokenizer.json": {}}, "tokenizer.json", "invalid tokenizer JSON"),
}


@pytest.mark.parametrize("files, file, message", list(HF_CASES.values()), ids=list(HF_CASES))
def test_malformed_checkpoint_files_are_named(llama_dir, tmp_path, files, file, message):
    src = _variant(llama_dir, tmp_path, files)
    with pytest.raises(ConversionError, match=message) as info:
        convert(src, tmp_path / "out.ninfer")
    assert file in _one_line(info.value)
    assert not list(tmp_path.glob("out.ninfer*"))


def test_unsupported_architecture_lists_the_hybrid_classes_too(llama_dir, tmp_path):
    src = _variant(llama_dir, tmp_path, _config(architectures=["MistralForCausalLM"]))
    with pytest.raises(ConversionError, match="unsupported architecture") as info:
        convert(src, tmp_path / "out.ninfer")
    assert all(name in str(info.value) for name in ("LlamaForCausalLM", *HYBRID_ARCHITECTURES))


def _hybrid(name: str, **change: Any) -> tuple[str, dict[str, Any]]:
    cfg = json.loads((HYBRID_FIXTURES / name / "config.json").read_text())
    if "text_config" in cfg and "text_config" not in change:
        cfg["text_config"].update(change)
    else:
        cfg.update(change)
    return name, cfg


HYBRID_CASES = {
    "string text_config": (_hybrid("qwen3_5", text_config="x"), "text_config must be an object, got a string"),
    "zero heads": (_hybrid("qwen3_next", num_attention_heads=0),
                   "num_attention_heads must be a positive integer, got 0"),
    "list rope_parameters": (_hybrid("qwen3_next", rope_parameters=[1]),
                             "rope_parameters must be an object, got an array"),
    "number layer_types": (_hybrid("qwen3_next", layer_types=4), "layer_types must be an array of strings, got 4"),
    "nested mlp_only_layers": (_hybrid("qwen3_next", mlp_only_layers=[[1]]),
                               "mlp_only_layers must be an array of non-negative integers"),
    "zero sparse step": (_hybrid("qwen3_next", decoder_sparse_step=0),
                         "decoder_sparse_step must be a positive integer, got 0"),
    "zero linear key heads": (_hybrid("qwen3_next", linear_num_key_heads=0),
                              "linear_num_key_heads must be a positive integer, got 0"),
    "negative max position": (_hybrid("qwen3_next", max_position_embeddings=-5),
                              "max_position_embeddings must be a positive integer, got -5"),
    "string mrope section": (_hybrid("qwen3_5", rope_parameters={"rope_type": "default", "mrope_section": ["a"]}),
                             "text_config.rope_parameters.mrope_section must be an array of non-negative integers"),
    "zero intermediate size": (_hybrid("qwen3_5", intermediate_size=0),
                               "text_config.intermediate_size must be a positive integer, got 0"),
}


@pytest.mark.parametrize("fixture_and_config, message", list(HYBRID_CASES.values()), ids=list(HYBRID_CASES))
def test_malformed_hybrid_configs_are_named(tmp_path, fixture_and_config, message):
    name, cfg = fixture_and_config
    src = _variant(HYBRID_FIXTURES / name, tmp_path, {"config.json": cfg})
    with pytest.raises(ConversionError, match=message) as info:
        convert(src, tmp_path / "out.ninfer")
    assert _one_line(info.value).startswith("config.json: ")


def test_a_directory_named_safetensors_is_no_shard(llama_dir, tmp_path):
    src = _variant(llama_dir, tmp_path, {})
    (src / "notes.safetensors").mkdir()
    convert(src, tmp_path / "out.ninfer")  # the real shard alone is the checkpoint
    assert open_artifact(tmp_path / "out.ninfer").config["num_layers"] == 2
    (src / "model.safetensors").unlink()
    with pytest.raises(ConversionError, match="no \\*.safetensors weights found"):
        convert(src, tmp_path / "out2.ninfer")


def test_index_entries_must_name_shard_files(llama_dir, tmp_path):
    index = {"weight_map": {"model.norm.weight": {"file": "model.safetensors"}}}
    src = _variant(llama_dir, tmp_path, {"model.safetensors.index.json": index})
    with pytest.raises(ConversionError, match=r"weight_map\['model.norm.weight'\] must name a shard file") as info:
        convert(src, tmp_path / "out.ninfer")
    assert "model.safetensors.index.json" in _one_line(info.value)


def _safetensors(header: Any) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(64)


@pytest.mark.parametrize("header, message", [
    ([1], "safetensors header must be a JSON object"),
    ({"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, r"unsupported dtype \['F32'\]"),
    ({"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}, "must be non-negative integers"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, "must be non-negative integers"),
], ids=["list header", "list dtype", "string shape", "float offsets"])
def test_malformed_safetensors_headers_are_named(llama_dir, tmp_path, header, message):
    src = _variant(llama_dir, tmp_path, {"model.safetensors": _safetensors(header)})
    with pytest.raises(ConversionError, match=message) as info:
        convert(src, tmp_path / "out.ninfer")
    assert "model.safetensors" in _one_line(info.value)


# ----- GGUF files


GGUF_CASES = {
    "zero heads": ({"llama.attention.head_count": 0}, "llama.attention.head_count must be a positive integer, got 0"),
    "string heads": ({"llama.attention.head_count": "x"}, "llama.attention.head_count must be a positive integer"),
    "string hidden": ({"llama.embedding_length": "x"}, "llama.embedding_length must be a positive integer"),
    "array block count": ({"llama.block_count": [1, 2]}, "llama.block_count must be a positive integer"),
    "zero context": ({"llama.context_length": 0}, "llama.context_length must be a positive integer, got 0"),
    "string epsilon": ({"llama.attention.layer_norm_rms_epsilon": "x"},
                       "llama.attention.layer_norm_rms_epsilon must be a positive number"),
    "negative rope base": ({"llama.rope.freq_base": -1.0}, "llama.rope.freq_base must be a positive number"),
    "string rope factor": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": "x"},
                           "llama.rope.scaling.factor must be a positive number"),
    "string original context": ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0,
                                 "llama.rope.scaling.original_context_length": "x"},
                                "llama.rope.scaling.original_context_length must be a positive integer"),
    "kv heads not a divisor": ({"llama.attention.head_count_kv": 3},
                               r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    "tokens a string": ({"tokenizer.ggml.tokens": "abc"}, "tokenizer.ggml.tokens must be an array of strings"),
    "tokens a number": ({"tokenizer.ggml.tokens": 5}, "tokenizer.ggml.tokens must be an array of strings"),
    "string token types": ({"tokenizer.ggml.token_type": ["a"] * 263},
                           "tokenizer.ggml.token_type must be an array of non-negative integers"),
    "number merges": ({"tokenizer.ggml.merges": [1, 2]}, "tokenizer.ggml.merges must be an array of strings"),
    "string bos": ({"tokenizer.ggml.bos_token_id": "x"}, "tokenizer.ggml.bos_token_id must be a non-negative integer"),
    "array pre": ({"tokenizer.ggml.pre": ["gpt2"]}, "tokenizer.ggml.pre must be a string"),
    "number chat template": ({"tokenizer.chat_template": 5}, "tokenizer.chat_template must be a string"),
    "string add_bos": ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token must be true or false"),
    "string alignment": ({"general.alignment": "x"}, "general.alignment must be a non-negative integer"),
}


@pytest.mark.parametrize("change, message", list(GGUF_CASES.values()), ids=list(GGUF_CASES))
def test_malformed_gguf_metadata_is_named(tmp_path, change, message):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, metadata=tiny_llama_metadata(**change))
    with pytest.raises(GGUFError, match=message) as info:
        convert(path, tmp_path / "m.ninfer")
    assert _one_line(info.value).startswith(f"{path}: ")
    assert not (tmp_path / "m.ninfer").exists()


# ----- artifact headers


def _header_and_data(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    _, _, _, hlen = PREAMBLE.unpack_from(raw)
    return json.loads(raw[PREAMBLE.size:PREAMBLE.size + hlen]), raw[align_up(PREAMBLE.size + hlen):]


def _write(path: Path, header: dict[str, Any], data: bytes) -> Path:
    raw = json.dumps(header).encode()
    head = PREAMBLE.pack(b"NINFER\x00\x00", 3, 0, len(raw)) + raw
    path.write_bytes(head + bytes(align_up(len(head)) - len(head)) + data)
    return path


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts")
    make_random_artifact(out / "dense.ninfer", "tiny-qwen3", seed=1)
    make_random_artifact(out / "hybrid.ninfer", "tiny-qwen3.5", seed=1)
    return {kind: _header_and_data(out / f"{kind}.ninfer") for kind in ("dense", "hybrid")}


def _set(kind: str, path: str, value: Any) -> tuple[str, str, Any]:
    return kind, path, value


# (artifact kind, dotted path in the header, new value) → what the message says
HEADER_CASES = {
    "special_tokens a list": (_set("dense", "special_tokens", [1]), "special_tokens must be an object"),
    "eos_token_ids a string": (_set("dense", "special_tokens.eos_token_ids", "x"),
                               "special_tokens.eos_token_ids must be a list of token ids"),
    "eos_token_ids a number": (_set("dense", "special_tokens.eos_token_ids", 5),
                               "special_tokens.eos_token_ids must be a list of token ids"),
    "negative eos id": (_set("dense", "special_tokens.eos_token_ids", [-1]),
                        "special_tokens.eos_token_ids must be a list of token ids"),
    "string bos id": (_set("dense", "special_tokens.bos_token_id", "a"), "special_tokens.bos_token_id must be"),
    "special spellings a list": (_set("dense", "special_tokens.tokens", [1]),
                                 "special_tokens.tokens must be an object"),
    "string special id": (_set("dense", "special_tokens.tokens", {"<x>": "1"}),
                          r"special_tokens.tokens\['<x>'\] must be a token id"),
    "numeric chat template": (_set("dense", "chat_template", 5), "chat_template must be a string or null, got 5"),
    "generation a list": (_set("dense", "generation", [1]), "generation must be an object"),
    "defaults a list": (_set("dense", "generation.defaults", [1]), "generation.defaults must be an object"),
    "presets a string": (_set("dense", "generation.presets", "x"), "generation.presets must be an object"),
    "string preset temperature": (_set("dense", "generation.presets", {"thinking": {"temperature": "hot"}}),
                                  "generation.presets.thinking.temperature must be a number or null"),
    "string do_sample": (_set("dense", "generation.defaults", {"do_sample": "yes"}),
                         "generation.defaults.do_sample must be true, false or null"),
    "numeric model name": (_set("dense", "metadata.name", 5), "metadata.name must be a string or null"),
    "negative max position": (_set("dense", "config.max_position_embeddings", -5),
                              "max_position_embeddings must be a positive integer, got -5"),
    "string rope theta": (_set("dense", "config.rope_theta", "x"), "rope_theta must be a positive number"),
    "unknown rope kind": (_set("dense", "config.rope_scaling", {"kind": "dynamic"}),
                          "rope_scaling.kind 'dynamic' is not supported"),
    "string tied flag": (_set("dense", "config.tie_word_embeddings", "no"),
                         "tie_word_embeddings must be true or false"),
    "list dtype": (_set("dense", "tensors.0.dtype", ["bf16"]), r"unsupported dtype \['bf16'\]"),
    "boolean data size": (_set("dense", "data_size", True), "data_size must be a non-negative integer"),
    "hybrid layer_types a number": (_set("hybrid", "config.layer_types", 5), "layer_types must be a list, got 5"),
    "hybrid zero key heads": (_set("hybrid", "config.linear_num_k_heads", 0),
                              "linear_num_k_heads must be a positive integer, got 0"),
    "hybrid negative max position": (_set("hybrid", "config.max_position_embeddings", -5),
                                     "max_position_embeddings must be a positive integer, got -5"),
}


def _malformed(artifacts, tmp_path: Path, kind: str, where: str, value: Any) -> Path:
    header, data = artifacts[kind]
    header = json.loads(json.dumps(header))
    *parents, last = where.split(".")
    node = header
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return _write(tmp_path / "bad.ninfer", header, data)


@pytest.mark.parametrize("change, message", list(HEADER_CASES.values()), ids=list(HEADER_CASES))
def test_malformed_headers_are_refused_on_open(artifacts, tmp_path, change, message):
    path = _malformed(artifacts, tmp_path, *change)
    with pytest.raises(ArtifactError, match=message) as info:
        open_artifact(path)
    assert _one_line(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize("command", [["inspect"], ["generate", "--prompt", "hi", "--max-tokens", "2"]])
def test_inspect_and_generate_end_in_one_line(artifacts, tmp_path, capsys, command):
    path = _malformed(artifacts, tmp_path, "dense", "special_tokens.eos_token_ids", 5)
    try:
        code = main([command[0], str(path), *command[1:]])
        message = capsys.readouterr().err.strip()
    except SystemExit as exc:  # generate ends through SystemExit(message)
        code, message = 1, str(exc.code)
    assert code == 1 and "\n" not in message
    assert str(path) in message and "special_tokens.eos_token_ids" in message


def test_serve_ends_in_one_line(artifacts, tmp_path):
    path = _malformed(artifacts, tmp_path, "dense", "special_tokens.eos_token_ids", 5)
    run = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", str(path), "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"ninfer serve: {path}: header JSON invalid: special_tokens.eos_token_ids must be a list of token ids, got 5")


def test_serve_refuses_a_tokenizer_the_tokenizer_library_rejects(artifacts, tmp_path):
    path = _malformed(artifacts, tmp_path, "dense", "tokenizer.json", "{}")  # a string, but no tokenizer
    run = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", str(path), "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("ninfer serve: the artifact's tokenizer: ")


# ----- model configs, the writer's output path


def test_dense_config_refuses_non_positive_sizes():
    with pytest.raises(ValueError, match="max_position_embeddings must be a positive integer, got -5"):
        attrs.evolve(PRESETS["tiny-llama"], max_position_embeddings=-5)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive integer, got 0"):
        attrs.evolve(PRESETS["tiny-llama"], num_kv_heads=0)


def test_an_unwritable_output_names_the_output_not_its_temporary_file(tmp_path):
    out = tmp_path / ("a" * 240 + ".ninfer")  # fits the 255-byte name limit; OUT.partial-PID does not
    with pytest.raises(ArtifactError, match="cannot write") as info:
        make_random_artifact(out, "tiny-llama")
    assert _one_line(info.value).startswith(f"{out}: ") and "partial" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


# ----- `ninfer bench http` against URLs that are not a NInfer server's base URL


class _OtherServer(BaseHTTPRequestHandler):
    """Answers as servers that are not NInfer do: a model list without ``data``, HTML 404s, and a
    chat stream whose frames are not chunks."""

    ROUTES = {
        ("GET", "/v1/models"): (200, b'{"object": "list"}'),
        ("GET", "/html/v1/models"): (200, b"<html>hello</html>"),
        ("GET", "/garbled/v1/models"): (200, b'{"data": [{"id": "m"}]}'),
        ("POST", "/garbled/v1/chat/completions"): (200, b"data: not json\n\ndata: [DONE]\n\n"),
    }

    def _answer(self, method: str) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        status, body = self.ROUTES.get((method, self.path), (404, b"<h1>Not Found</h1>"))
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def other_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtherServer)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()
    server.server_close()


@pytest.mark.parametrize("suffix, answer", [
    ("", "HTTP 200 without a model list"),  # another server's /v1/models
    ("/v1", "HTTP 404 without a model list"),  # a base URL ending in /v1
    ("/html", "HTTP 200 without a model list"),
], ids=["no data", "ends in /v1", "html"])
def test_bench_http_names_a_url_that_is_no_ninfer_server(other_server, capsys, suffix, answer):
    assert main(["bench", "http", other_server + suffix, "--requests", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"ninfer bench http: {other_server}{suffix}: GET ")
    assert answer in err and "/v1/models" in err


@pytest.mark.parametrize("suffix, extra, problem", [
    ("/v1", ["--model", "m"], "HTTP 404"),  # an HTML 404 for the chat request
    ("/garbled", [], "stream frame is not a chat completion chunk: 'not json'"),
], ids=["html 404", "garbled stream"])
def test_bench_http_reports_answers_of_another_shape(other_server, capsys, suffix, extra, problem):
    assert main(["bench", "http", other_server + suffix, "--requests", "1", "--clients", "1", *extra]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["completed"] == 0 and report["incorrect"] == [problem]
