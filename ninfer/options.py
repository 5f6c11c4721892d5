"""The one definition of `ninfer serve` options: default, validation and help of each.

argparse ``--help``, the EngineConfig mapping (``ninfer.server.main.engine_config``) and the table in
docs/cli.md all read ``SERVE_OPTIONS``; a test keeps the doc table equal to ``markdown_table()``.
Options whose capability is not built yet are parsed and validated, then refused at startup by
``check_capabilities`` with a message naming the option — never silently ignored.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

import attrs

from ninfer.observability.logs import LEVELS


class OptionError(ValueError):
    """A startup option is malformed or asks for a capability this build lacks."""


def int_range(lo: int | None, hi: int | None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
        return v

    return parse


def _float_range(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be within [{lo}, {hi}], got {text}")
        return v

    return parse


def _text(text: str) -> str:
    # An empty value is a mistake (an unset shell variable), never a choice: as --host "" listens on
    # every interface, as --api-key "" an empty header authenticates, and --model-id "" or
    # --request-log-jsonl "" would be silently dropped.
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _api_key(text: str) -> str:
    # A header value arrives as latin-1 with its surrounding whitespace stripped: a key outside
    # visible ASCII, or with spaces at its ends, could never match what a client sends.
    text = _text(text)
    if not all(ch == " " or "!" <= ch <= "~" for ch in text) or text != text.strip():
        raise argparse.ArgumentTypeError("must be visible ASCII characters (spaces only inside)")
    return text


def device_choice(text: str) -> str | int:
    """``cpu`` (the reference backend) or a CUDA device number."""
    if text == "cpu":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected cpu or a CUDA device number (0, 1, ...), got {text!r}")
    return value


def _kv_capacity(text: str) -> int | str:
    return "auto" if text == "auto" else int_range(1, None)(text)


@attrs.frozen
class Option:
    flag: str
    help: str
    default: Any = None
    parse: Callable[[str], Any] | None = _text  # None: a boolean switch
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default_text: str | None = None  # how the docs state a default that is derived or unset

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def shown_metavar(self) -> str | None:
        # --help and the doc table spell out a closed set of values, not a placeholder.
        return "|".join(self.choices) if self.choices else self.metavar

    @property
    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.parse is None:
            return "off"
        return "unset" if self.default is None else str(self.default)


SERVE_OPTIONS: tuple[Option, ...] = (
    Option("--host", "listen address", "127.0.0.1", metavar="H"),
    Option("--port", "listen port (0 picks a free port)", 8080, int_range(0, 65535), "N"),
    Option("--api-key", "required bearer or x-api-key value", None, _api_key, "KEY"),
    Option("--model-id", "override the public OpenAI model alias", None, metavar="ID",
           default_text="artifact metadata.name, or architecture name"),
    Option("--chat-template", "local Jinja chat template instead of the artifact's", None, metavar="FILE",
           default_text="the artifact's template"),
    Option("--max-context", "logical context ceiling of each sequence", 8192, int_range(16, None), "N"),
    Option("--kv-capacity", "shared Main Text KV capacity in tokens, or auto", None, _kv_capacity, "N|auto",
           default_text="--max-context"),
    Option("--max-concurrency", "resident execution lanes (1..8)", 1, int_range(1, 8), "N"),
    Option("--max-pending-requests", "additional requests allowed to wait for admission", 16,
           int_range(0, None), "N"),
    Option("--pending-timeout-ms", "maximum preparation-plus-admission wait", 30000, int_range(1, None), "N"),
    Option("--prefill-chunk", "text-prefill chunk in tokens", 1024, int_range(1, None), "N"),
    Option("--log-stats-interval-ms", "aggregate throughput report interval; 0 disables it", 5000,
           int_range(0, None), "N"),
    Option("--log-level", "pretty stderr verbosity", "info", str, choices=tuple(LEVELS)),
    Option("--device", "CUDA device index (the CUDA backend), or cpu for the reference backend", 0, device_choice,
           "N|cpu"),
    Option("--random-weights", "serve random bf16 weights made on the GPU for a dense preset (e.g. qwen3-8b) or "
           "DenseConfig JSON, with the synthetic tokenizer, instead of an artifact (needs a CUDA --device)", None,
           metavar="CONFIG", default_text="off"),
    Option("--context-cost-presets", "optional runtime context-cost preset registry", None, metavar="FILE",
           default_text="generic + compiled defaults"),
    Option("--max-request-mib", "body-size limit before JSON parsing", 384, int_range(1, None), "N"),
    Option("--media-cache-mib", "LRU-retained prepared media payloads; 0 disables retention", 1024,
           int_range(0, None), "N"),
    Option("--media-live-mib", "all live prepared media payloads", 2048, int_range(1, None), "N"),
    Option("--media-preprocess-threads", "media preprocessing workers; 0 picks at most 16", 0,
           int_range(0, None), "N"),
    Option("--request-log-jsonl", "append full-precision server/request records to FILE", None, metavar="FILE",
           default_text="disabled"),
    Option("--response-store-max-records", "maximum locally retained Responses objects", 1024,
           int_range(0, None), "N"),
    Option("--response-store-max-mib", "total local Response store budget", 256, int_range(0, None), "N"),
    Option("--kv-dtype", "KV-cache storage", "bf16", str, choices=("bf16", "int8", "fp8", "nvfp4", "k8v4")),
    Option("--spec", "speculative backend", None, str, choices=("mtp", "dflash", "dflash2"), default_text="off"),
    Option("--draft-tokens", "draft tokens per round: MTP 1..5; DFlash/DFlash2 1..15", None,
           int_range(1, 15), "N"),
    Option("--lm-head-draft", "load the optimized proposal head", False, None),
    Option("--default-max-tokens", "output limit when a request omits one", 8192, int_range(1, None), "N"),
    Option("--default-thinking-budget", "positive thinking cap inherited by thinking-enabled requests", None,
           int_range(1, None), "N"),
    Option("--vision", "enable media input and load Vision allocations", False, None),
    Option("--no-cuda-graph", "disable CUDA Graph decode", False, None, default_text="graphs on"),
    Option("--no-prefix-reuse", "disable compatible-prefix caching", False, None, default_text="prefix reuse on"),
    Option("--device-state-slots", "extra Device StateImages beyond max-concurrency", None,
           int_range(0, None), "N", default_text="max-concurrency"),
    Option("--host-context-mib", "shared pinned Host budget for StateImages, KV and pause snapshots", None,
           int_range(0, None), "N", default_text="8192 MiB + 8 native StateImages"),
    Option("--no-thinking", "disable thinking by default", False, None, default_text="thinking on"),
    Option("--preserve-thinking", "preserve closed-turn assistant reasoning by default", False, None),
    Option("--cors", "permissive browser CORS headers", False, None),
    Option("--temperature", "process-level temperature override", None, _float_range(0.0, 2.0), "F"),
    Option("--top-p", "process-level top-p override", None, _float_range(0.0, 1.0), "F"),
    Option("--top-k", "process-level top-k override (0..20; zero selects the top-20 cap)", None,
           int_range(0, 20), "N"),
    Option("--min-p", "process-level min-p override", None, _float_range(0.0, 1.0), "F"),
    Option("--presence-penalty", "process-level presence-penalty override", None, _float_range(-2.0, 2.0), "F"),
    Option("--frequency-penalty", "process-level frequency-penalty override", None, _float_range(-2.0, 2.0), "F"),
    Option("--seed", "fixed seed when a request omits one", None, int_range(-(2**63), 2**63 - 1), "N",
           default_text="fresh random seed per request"),
    Option("--greedy", "force exact argmax for all requests", False, None),
)

BY_DEST = {o.dest: o for o in SERVE_OPTIONS}


def add_to_parser(parser: argparse.ArgumentParser) -> None:
    for o in SERVE_OPTIONS:
        if o.parse is None:
            parser.add_argument(o.flag, action="store_true", help=f"{o.help} (default: {o.shown_default})")
        else:
            parser.add_argument(o.flag, type=o.parse, default=o.default, metavar=o.shown_metavar,
                                choices=o.choices, help=f"{o.help} (default: {o.shown_default})")


# Capabilities not built in this tree: setting the option is a startup error, not a no-op.
_NOT_BUILT = {
    "spec": "speculative decoding (MTP/DFlash) is not built yet",
    "draft_tokens": "speculative decoding is not built yet, so draft tokens cannot be set",
    "lm_head_draft": "the optimized proposal head belongs to speculative decoding, which is not built yet",
    "vision": "Vision (image/video input) is not built yet",
}


def check_capabilities(args: argparse.Namespace, *, cuda_available: bool = False) -> None:
    """Refuse options whose capability is absent; raise OptionError naming the option."""
    for dest, why in _NOT_BUILT.items():
        if getattr(args, dest) not in (None, False):
            raise OptionError(f"{BY_DEST[dest].flag}: {why}.")
    if args.kv_dtype != "bf16":
        raise OptionError(f"--kv-dtype {args.kv_dtype}: only bf16 KV storage is built yet.")
    if args.device != "cpu" and not cuda_available:
        raise OptionError(f"--device {args.device}: no CUDA GPU is usable here (needs the cuda extra and a "
                          "driver); --device cpu serves on the reference (CPU) backend.")
    if args.device != "cpu":
        _check_cuda_sync()
    if args.kv_capacity == "auto" and args.device == "cpu":
        raise OptionError("--kv-capacity auto sizes the KV pool from free GPU memory, so it needs a CUDA "
                          "--device; the reference (CPU) backend takes a number.")
    if args.random_weights is not None:
        if args.device == "cpu":
            raise OptionError("--random-weights makes its weights on the GPU, so it needs a CUDA --device.")
        if getattr(args, "artifact", None) is not None:
            raise OptionError("--random-weights serves random weights instead of an artifact; give one or the other.")


def _check_cuda_sync() -> None:
    """The CUDA backend reads NINFER_CUDA_SYNC only when its device opens, after the model is loaded:
    a bad value is refused here, before any work. Only called once a GPU is usable, so the cuda
    extra (which the runtime imports) is installed."""
    from ninfer.backends.cuda import runtime

    try:
        runtime.sync_policy()
    except ValueError as e:
        raise OptionError(f"{e} (how the host waits for the GPU; see docs/cli.md, Environment).") from None


def markdown_table() -> str:
    rows = ["| Option | Meaning | Default |", "| --- | --- | --- |"]
    for o in SERVE_OPTIONS:
        name = o.flag if o.shown_metavar is None else f"{o.flag} {o.shown_metavar}"
        name = name.replace("|", "\\|")  # a bare pipe would split the table cell
        rows.append(f"| `{name}` | {o.help} | {o.shown_default} |")
    return "\n".join(rows)
