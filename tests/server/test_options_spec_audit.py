"""Audit of `ninfer serve` options against the spec's "Server options": the --help contract,
values that must not pass validation, and --context-cost-presets files that must abort startup
with one line instead of a traceback."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from ninfer.cli import build_parser
from ninfer.engine.context_cost import load
from ninfer.engine.errors import ContextCostPresetsError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_help_spells_out_each_closed_value_set(capsys):
    """The spec table gives --log-level, --kv-dtype and --spec as value lists; --help, "the exact
    option contract", shows the same lists rather than a placeholder."""
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    for shown in ("--log-level trace|debug|info|warning|error|critical|off", "--kv-dtype bf16|int8|fp8|nvfp4|k8v4",
                  "--spec mtp|dflash|dflash2"):
        assert shown in out


@pytest.mark.parametrize("flag", ["--host", "--api-key", "--model-id", "--request-log-jsonl", "--chat-template",
                                  "--context-cost-presets", "--random-weights"])
def test_an_empty_value_is_refused_naming_the_option(flag, capsys):
    # Before: --host "" listened on every interface, --api-key "" let an empty header in, and
    # --model-id "" / --request-log-jsonl "" were silently dropped.
    with pytest.raises(SystemExit) as e:
        parse(flag, "")
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"ninfer serve: error: argument {flag}: must not be empty"


def write(tmp_path, text: str) -> str:
    path = tmp_path / "presets.json"
    path.write_text(text)
    return str(path)


def test_a_coefficient_too_large_for_a_float_is_malformed(tmp_path):
    path = write(tmp_path, '{"transfer": [{"seconds_per_byte": 1' + "0" * 400 + "}]}")
    with pytest.raises(ContextCostPresetsError, match=r"transfer\[0\]: seconds_per_byte must be a positive finite"):
        load(path, "cuda", None)


def test_json_nested_past_the_parser_stack_is_malformed(tmp_path):
    path = write(tmp_path, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ContextCostPresetsError, match="--context-cost-presets"):
        load(path, "cuda", None)


def test_an_integer_coefficient_still_counts(tmp_path):
    path = write(tmp_path, json.dumps({"prefill": [{"hardware": "cuda", "seconds_per_token": 1}]}))
    assert load(path, "cuda", None).prefill_seconds_per_token == 1.0


def test_an_out_of_range_coefficient_ends_startup_with_one_line(tiny_artifact, tmp_path):
    path = write(tmp_path, '{"prefill": [{"seconds_per_token": 9' + "0" * 400 + "}]}")
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", tiny_artifact, "--port", "0",
                        "--log-level", "warning", "--context-cost-presets", path],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [f"ninfer serve: --context-cost-presets {path}: prefill[0]: seconds_per_token "
                                     "must be a positive finite number"]
