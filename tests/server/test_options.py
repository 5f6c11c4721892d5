"""`ninfer serve` options: one definition feeds argparse, validation and docs/cli.md."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from ninfer import options
from ninfer.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_follow_the_spec_table():
    a = parse()
    assert a.artifact is None
    assert (a.host, a.port, a.max_context, a.max_concurrency, a.max_pending_requests) == ("127.0.0.1", 8080, 8192, 1, 16)
    assert (a.pending_timeout_ms, a.prefill_chunk, a.log_stats_interval_ms, a.log_level) == (30000, 1024, 5000, "info")
    assert (a.max_request_mib, a.default_max_tokens, a.kv_dtype) == (384, 8192, "bf16")
    assert a.api_key is None and a.kv_capacity is None and not a.cors and not a.greedy
    assert a.device == 0  # the spec's executable default: CUDA device 0
    options.check_capabilities(a, cuda_available=True)  # the defaults start where a GPU is usable
    with pytest.raises(options.OptionError, match="--device cpu serves on the reference"):
        options.check_capabilities(a)  # and say where they cannot
    assert parse("--device", "cpu").device == "cpu"


def test_an_api_key_with_inner_spaces_is_accepted():
    assert parse("--api-key", "two words").api_key == "two words"


@pytest.mark.parametrize("argv", [
    ["--max-concurrency", "9"], ["--max-concurrency", "0"], ["--top-k", "21"], ["--temperature", "3"],
    ["--top-p", "nan"], ["--port", "70000"], ["--log-level", "loud"], ["--kv-dtype", "fp4"],
    ["--spec", "eagle"], ["--default-thinking-budget", "0"], ["--max-context", "x"],
    ["--device", "gpu"], ["--device", "-1"], ["--device", ""],
    ["--api-key", ""], ["--api-key", "clé"], ["--api-key", "key "], ["--api-key", "a\tb"],
])
def test_malformed_values_fail_argparse(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--spec", "mtp"], "--spec"), (["--draft-tokens", "3"], "--draft-tokens"), (["--lm-head-draft"], "--lm-head-draft"),
    (["--vision"], "--vision"), (["--kv-dtype", "fp8"], "--kv-dtype"), (["--device", "0"], "--device"),
    (["--kv-capacity", "auto", "--device", "cpu"], "--kv-capacity"),
])
def test_unbuilt_capabilities_refuse_to_start(argv, flag):
    with pytest.raises(options.OptionError, match=flag):
        options.check_capabilities(parse(*argv))


def test_cli_exits_with_clear_message_for_unbuilt_option():
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", "--spec", "mtp"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2
    assert "--spec" in r.stderr and "not built" in r.stderr


def test_every_spec_option_is_defined():
    flags = {o.flag for o in options.SERVE_OPTIONS}
    spec_flags = ["--host", "--port", "--api-key", "--model-id", "--max-context", "--kv-capacity", "--max-concurrency",
                  "--max-pending-requests", "--pending-timeout-ms", "--prefill-chunk", "--log-stats-interval-ms",
                  "--log-level", "--device", "--context-cost-presets", "--max-request-mib", "--media-cache-mib",
                  "--media-live-mib", "--media-preprocess-threads", "--request-log-jsonl",
                  "--response-store-max-records", "--response-store-max-mib", "--kv-dtype", "--spec",
                  "--draft-tokens", "--lm-head-draft", "--default-max-tokens", "--default-thinking-budget",
                  "--vision", "--no-cuda-graph", "--no-prefix-reuse", "--device-state-slots", "--host-context-mib",
                  "--no-thinking", "--preserve-thinking", "--cors", "--temperature", "--top-p", "--top-k", "--min-p",
                  "--presence-penalty", "--frequency-penalty", "--seed", "--greedy", "--chat-template"]
    assert set(spec_flags) <= flags


def test_docs_cli_table_matches_the_definition():
    doc = (ROOT / "docs" / "cli.md").read_text()
    assert options.markdown_table() in doc, "regenerate the table in docs/cli.md from options.markdown_table()"
