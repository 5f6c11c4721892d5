"""Context-cost model: snapshot (copy KV to Host and back) or replay (recompute) a paused request.

Snapshot cost = 2 × bytes × transfer seconds-per-byte (out and back in); replay cost =
tokens × prefill seconds-per-token. Coefficients resolve once at startup: generic defaults, then
the compiled values measured for a matching backend (and model signature), then matching entries
of the ``--context-cost-presets`` JSON file::

    {"transfer": [{"hardware": "cuda", "seconds_per_byte": 4e-11}],
     "prefill":  [{"hardware": "cuda", "model": "<signature>", "seconds_per_token": 2e-5}]}

``hardware`` is the runner's backend name; ``model`` is the model signature
(:mod:`ninfer.engine.signature`, e.g. ``Qwen3ForCausalLM-h5120-l64-bfloat16-0123456789ab``).
Either may be "*" (or omitted) to match anything; the most specific match wins (hardware
outranks model). A runner without a signature matches only ``"*"`` models. A malformed file
raises ContextCostPresetsError, which aborts startup. ``source`` records the file, the entries
used and the signature they were matched against.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

from ninfer.engine.errors import ContextCostPresetsError

# Generic defaults: ~12 GB/s host link, ~20k tokens/s prefill. Conservative on both sides.
GENERIC_TRANSFER_SECONDS_PER_BYTE = 1.0 / 12e9
GENERIC_PREFILL_SECONDS_PER_TOKEN = 1.0 / 20e3

# Compiled defaults, measured on the project's GPU hosts (docs/benchmarks.md): seconds a byte of a
# pinned host <-> device round trip, by backend (tools/bench_host_link.py on an H100 host: 256 MiB
# copies, the size of a few thousand tokens' KV, 54.9 GB/s down and 54.6 up), and seconds a token of
# chunked prefill, by (backend, model signature) on the H200.
# The signature is the CUDA runner's Qwen3-8B shape with a bf16 pool (`--random-weights qwen3-8b` or
# a converted Qwen3-8B; a test keeps it equal to the preset's): 8192 tokens in chunks of 1024 took
# 225.6 ms (`tools/gpu_bench.py` TTFT, fifteenth session).
COMPILED_TRANSFER: dict[str, float] = {"cuda": 1.827e-11}
COMPILED_PREFILL: dict[tuple[str, str], float] = {
    ("cuda", "Qwen3ForCausalLM-h4096-l36-bfloat16-1d9341cf5be3"): 0.2256 / 8192,
}


@attrs.frozen
class ContextCost:
    transfer_seconds_per_byte: float
    prefill_seconds_per_token: float
    source: str  # "generic" or "<file>: <entries used>"

    def snapshot_seconds(self, nbytes: int) -> float:
        return 2.0 * nbytes * self.transfer_seconds_per_byte

    def replay_seconds(self, tokens: int) -> float:
        return tokens * self.prefill_seconds_per_token

    def prefer_snapshot(self, nbytes: int, tokens: int) -> bool:
        return self.snapshot_seconds(nbytes) <= self.replay_seconds(tokens)


def load(path: str | None, hardware: str, model: str | None) -> ContextCost:
    """Coefficients for a runner of backend ``hardware`` serving the model of signature
    ``model`` (None: unknown). ``source`` names where each came from: "generic", "compiled", or the
    file's entry (``transfer[i]``, ``prefill[j]``)."""
    identity = f"(hardware {hardware}, model {model or 'signature unknown'})"
    transfer = _default(COMPILED_TRANSFER.get(hardware), GENERIC_TRANSFER_SECONDS_PER_BYTE, "transfer")
    prefill = _default(COMPILED_PREFILL.get((hardware, model)), GENERIC_PREFILL_SECONDS_PER_TOKEN, "prefill")
    if path is not None:
        data = _read(path)
        transfer = _pick(data.get("transfer", []), "transfer", "seconds_per_byte", path, hardware, model) or transfer
        prefill = _pick(data.get("prefill", []), "prefill", "seconds_per_token", path, hardware, model) or prefill
    return ContextCost(transfer[0], prefill[0], _source(path, transfer[1], prefill[1], identity))


def _default(compiled: float | None, generic: float, kind: str) -> tuple[float, str]:
    return (generic, f"generic {kind}") if compiled is None else (compiled, f"compiled {kind}")


def _source(path: str | None, transfer: str, prefill: str, identity: str) -> str:
    """E.g. "generic (hardware …)", "compiled prefill, generic transfer (…)", "presets.json: transfer[0],
    compiled prefill (…)", "presets.json: no matching entry (generic) (…)": the file's entries first,
    then the defaults left in force."""
    defaults = [used for used in (transfer, prefill) if used.startswith(("compiled", "generic"))]
    entries = [used for used in (transfer, prefill) if used not in defaults]
    said = "generic" if defaults == ["generic transfer", "generic prefill"] else ", ".join(defaults)
    if path is None:
        return f"{said} {identity}"
    if not entries:
        return f"{path}: no matching entry ({said}) {identity}"
    return f"{path}: {', '.join(entries + defaults)} {identity}"


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    # RecursionError: JSON nested deeper than the parser's stack is malformed for this purpose too.
    except (OSError, ValueError, RecursionError) as exc:
        raise ContextCostPresetsError(f"--context-cost-presets {path}: {exc}") from exc
    if not isinstance(data, dict) or set(data) - {"transfer", "prefill"}:
        raise ContextCostPresetsError(
            f"--context-cost-presets {path}: expected an object with only 'transfer' and 'prefill' lists")
    return data


def _pick(entries: Any, kind: str, key: str, path: str, hardware: str, model: str):
    if not isinstance(entries, list):
        raise ContextCostPresetsError(f"--context-cost-presets {path}: '{kind}' must be a list")
    best = None
    for i, entry in enumerate(entries):
        where = f"--context-cost-presets {path}: {kind}[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"hardware", "model", key}:
            raise ContextCostPresetsError(f"{where}: expected an object with hardware, model, {key}")
        value = _coefficient(entry.get(key))
        if value is None:
            raise ContextCostPresetsError(f"{where}: {key} must be a positive finite number")
        hw, md = entry.get("hardware", "*"), entry.get("model", "*")
        if not isinstance(hw, str) or not isinstance(md, str) or not hw or not md:
            raise ContextCostPresetsError(f"{where}: hardware and model must be non-empty strings")
        if hw not in ("*", hardware) or md not in ("*", model):
            continue
        score = (hw != "*") * 2 + (md != "*")
        if best is None or score > best[2]:
            best = (value, f"{kind}[{i}]", score)
    return None if best is None else best[:2]


def _coefficient(value: Any) -> float | None:
    """``value`` as a positive finite float, else None. A JSON integer too large for a float is
    out of range like an infinity (float() would raise OverflowError, past the startup error path)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) and value > 0 else None
