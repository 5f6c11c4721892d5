"""What startup reports: the CUDA runner's stderr record and the JSONL ``server_start`` event, on the CPU.

A reference runner carrying the ``startup`` dict the CUDA runner fills (runner.py) stands in for the
GPU; the reference backend itself reports no device records.
"""

from __future__ import annotations

import json
import logging

import attrs

from ninfer.backends.reference import ReferenceRunner
from ninfer.server import main
from ninfer.server.main import run_server
from server.conftest import serve_args

GIB = 2**30
# The keys CudaRunner._setup and the weight upload write, with the --kv-capacity auto ledger.
TUNING = {"rows": 1024, "seconds": 0.42, "gemms": {"1024x4096x6144": {"ms": [0.091, 0.083], "chose": 1}}}
FACTS = {"device": "NVIDIA H200", "sync": "blocking", "kv_dtype": "bf16", "prefill_gemm": "cublaslt-tuned",
         "prefill_gemm_tuning": TUNING,
         "kv_pages": 40, "workspace_bytes": 3 * GIB,
         "kv_auto": {"free_bytes": 100 * GIB, "workspace_without_kv": GIB, "graph_reserve": 64 << 20,
                     "headroom": GIB, "page_bytes": 1 << 20, "pages": 40},
         "graph_capture_s": 1.234, "graph_bytes": 12 << 20, "graph_nodes": 321, "graph_count": 16,
         "prefill_graph": {"rows": 1024, "nodes": 362, "kv_only_nodes": 352, "seconds": 0.071},
         "free_bytes_after_startup": 5 * GIB, "weights_bytes": 16 * GIB, "weights_upload_gb_per_s": 21.5,
         "fragment_bytes": 9 * GIB,
         "host_arena_bytes": 8 * GIB}


def _cuda_like(facts):
    def factory(art, config):
        runner = ReferenceRunner(art, page_size=config.page_size, num_pages=facts["kv_pages"],
                                 max_batch=config.max_concurrency, max_context=config.max_context)
        runner.info = attrs.evolve(runner.info, backend="cuda")
        runner.startup = dict(facts)
        return runner

    return factory


def _server_start(path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["server_start"]
    return records[0]


async def test_cuda_startup_is_logged_and_recorded(nursery, tiny_artifact, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ninfer")
    log_path = tmp_path / "log.jsonl"
    args = serve_args(tiny_artifact, "--device", "0", "--kv-capacity", "auto", "--max-concurrency", "2",
                      "--request-log-jsonl", str(log_path))
    await nursery.start(lambda task_status: run_server(args, [], runner_factory=_cuda_like(FACTS),
                                                       task_status=task_status))
    nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records]
    assert ("CUDA startup: NVIDIA H200; weights 16.00 GiB at 21.5 GB/s; batched decode's copies in fragment order "
            "9.00 GiB; workspace 3.00 GiB incl. 40 KV pages; "
            "16 decode graphs captured in 1.234 s (12 MiB, 321 nodes each); prefill graphs of 1024 rows (362 nodes; "
            "352 without outputs) in 0.071 s; prefill GEMMs of 1024 rows tuned in 0.42 s; 5.00 GiB free") in lines
    assert ("--kv-capacity auto: 640 tokens (40 pages, 0.04 GiB; 100.00 GiB were free after the weights)"
            in lines)

    rec = _server_start(log_path)
    assert rec["backend"] == "cuda"
    assert rec["kv_sizing"] == {"mode": "auto", "capacity_tokens": 640, "pages": 40, "ledger": FACTS["kv_auto"]}
    assert rec["memory"] == {"weights_bytes": 16 * GIB, "weights_fragment_order_bytes": 9 * GIB,
                             "free_bytes_after_startup": 5 * GIB, "vision_workspace": None,
                             "host_arena_bytes": 8 * GIB,
                             "workspace": {"capacity_bytes": 3 * GIB, "kv_pages": 40, "kv_dtype": "bf16",
                                           "state_slots": None, "state_bytes": None}}
    assert rec["cuda_graph"] == {"enabled": True, "reserve_bytes": 64 << 20, "count": 16, "bytes": 12 << 20,
                                 "nodes_per_graph": 321, "capture_seconds": 1.234,
                                 "prefill": FACTS["prefill_graph"]}
    assert rec["cuda"] == {"device": 0, "name": "NVIDIA H200", "sync": "blocking", "prefill_gemm": "cublaslt-tuned",
                           "prefill_gemm_tuning": TUNING, "weights_upload_gb_per_s": 21.5,
                           "weights_random_fill_s": None}
    assert rec["context_cost_source"].startswith("compiled transfer, generic prefill (hardware cuda, model Qwen3ForCausalLM-h64")
    assert rec["context_cache"]["device_state_capacity_slots"] == 0  # a dense model has no StateImages


async def test_cuda_startup_without_graphs(nursery, tiny_artifact, tmp_path):
    facts = {k: v for k, v in FACTS.items() if not k.startswith("graph_") and k not in ("prefill_graph", "kv_auto")}
    log_path = tmp_path / "log.jsonl"
    args = serve_args(tiny_artifact, "--device", "0", "--kv-capacity", "640", "--no-cuda-graph",
                      "--request-log-jsonl", str(log_path))
    await nursery.start(lambda task_status: run_server(args, [], runner_factory=_cuda_like(facts),
                                                       task_status=task_status))
    nursery.cancel_scope.cancel()
    rec = _server_start(log_path)
    assert rec["kv_sizing"] == {"mode": "tokens", "capacity_tokens": 640, "pages": 40, "ledger": None}
    assert rec["cuda_graph"] == {"enabled": False, "reserve_bytes": None, "count": None, "bytes": None,
                                 "nodes_per_graph": None, "capture_seconds": None, "prefill": None}


async def test_reference_backend_reports_no_device(start_server, tmp_path):
    log_path = tmp_path / "log.jsonl"
    await start_server("--request-log-jsonl", str(log_path), "--max-concurrency", "2", "--device-state-slots", "3",
                       "--host-context-mib", "1")
    rec = _server_start(log_path)
    assert rec["backend"] == "reference"
    assert rec["memory"] is None and rec["cuda_graph"] is None and rec["cuda"] is None
    assert rec["kv_sizing"] == {"mode": "max_context", "capacity_tokens": 256, "pages": 16, "ledger": None}
    assert rec["context_cache"] == {"device_state_capacity_slots": 0, "device_state_used_slots": 0,
                                    "host_context_capacity_bytes": 1 << 20, "host_context_used_bytes": 0,
                                    "host_context_peak_bytes": 0}
    assert rec["context_cost_source"].startswith("generic (hardware reference")


def test_runner_startup_line_for_random_weights(caplog):
    caplog.set_level(logging.INFO, logger="ninfer")
    facts = {k: v for k, v in FACTS.items()
             if not k.startswith("graph_") and k not in ("prefill_graph", "weights_upload_gb_per_s", "fragment_bytes")}
    untuned = {"rows": 1024, "seconds": 0.0, "gemms": {}}  # below TUNE_MIN_ROWS: nothing to say
    main._log_runner_startup(facts | {"weights_random_fill_s": 0.8, "prefill_gemm_tuning": untuned})
    main._log_runner_startup(None)  # the reference backend: nothing
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA startup: NVIDIA H200; weights 16.00 GiB made on the device; workspace 3.00 GiB incl. 40 KV pages; "
        "5.00 GiB free"]
