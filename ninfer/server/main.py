"""Startup and shutdown of `ninfer serve`: artifact → tokenizer/template → Engine → app → hypercorn.

``run_server`` is a trio task (tests start it in a nursery and get a ``RunningServer`` back);
``main`` wraps it for the command line with signal handling and exit codes.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import sys
import time
from typing import Any, Awaitable, Callable

import attrs
import trio

from ninfer.engine import EngineConfig, SamplingOverrides
from ninfer.engine.sampling import preset_for
from ninfer.observability import logs
from ninfer.observability.metrics import Metrics
from ninfer.observability.request_log import RequestLog, redact_argv
from ninfer.observability.throughput import throughput_loop
from ninfer.server import listen, routes
from ninfer.server.app import App
from ninfer.server.backend import BackendStartError, cuda_runner
from ninfer.server.prompt import PromptBuilder, ServeDefaults
from ninfer.server.response_store import ResponseStore
from ninfer.server.sse import KEEPALIVE_SECONDS

log = logging.getLogger("ninfer.server")

# The process-level sampler flags: one per request sampler field, plus --greedy.
SAMPLING_FLAGS = tuple(a.name for a in attrs.fields(SamplingOverrides)) + ("greedy",)


class StartupError(Exception):
    """Startup cannot proceed; the message says which input is wrong."""


@attrs.define
class ServerState:
    engine: Any
    model_id: str
    created: int
    prompts: PromptBuilder
    metrics: Metrics
    request_log: RequestLog | None
    response_store: ResponseStore  # the local Responses store


@attrs.frozen
class RunningServer:
    url: str  # http://host:port
    state: ServerState
    app: App


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig fields of the serve options (ninfer/options.py)."""
    return EngineConfig(
        max_concurrency=args.max_concurrency, max_pending_requests=args.max_pending_requests,
        pending_timeout_ms=args.pending_timeout_ms, prefill_chunk=args.prefill_chunk, max_context=args.max_context,
        # "auto" is resolved by the CUDA runner at startup (run_server), then set here as a number.
        kv_capacity=None if args.kv_capacity == "auto" else args.kv_capacity,
        prefix_reuse=not args.no_prefix_reuse, host_context_mib=args.host_context_mib,
        device_state_slots=args.device_state_slots, context_cost_presets=args.context_cost_presets,
        **{flag: getattr(args, flag) for flag in SAMPLING_FLAGS},
    )


def serve_defaults(args: argparse.Namespace) -> ServeDefaults:
    return ServeDefaults(max_tokens=args.default_max_tokens, thinking=False if args.no_thinking else None,
                         preserve_thinking=True if args.preserve_thinking else None,
                         thinking_budget=args.default_thinking_budget)


def _artifact_path(args: argparse.Namespace) -> str:
    if args.artifact is not None:
        if not os.path.isfile(args.artifact):
            raise StartupError(f"artifact {args.artifact} does not exist")
        return args.artifact
    from ninfer import demo

    log.info("no artifact given: loading the demo model %s", demo.MODEL_NAME)
    # First use converts the GGUF: a redrawn bar on a terminal only; redirected stderr stays records.
    bar = _TerminalProgress() if sys.stderr.isatty() else None
    try:
        path = os.fspath(demo.default_artifact(bar))
    except demo.DemoModelMissing as e:
        raise StartupError(str(e)) from None
    if bar is not None:
        bar.close()
    return path


class _TerminalProgress:
    def __init__(self) -> None:
        from ninfer.convert.progress import Progress

        self._bar = Progress("converting the demo model")
        self._used = False

    def __call__(self, done: int, total: int, name: str) -> None:
        self._used = True
        self._bar(done, total, name)

    def close(self) -> None:
        if self._used:
            self._bar.finish()


def _open_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """(what the runner loads: an artifact path or a RandomWeightsModel, the opened text side)."""
    if args.random_weights is not None:
        from ninfer.server.random_weights import RandomWeightsModel

        try:
            model = RandomWeightsModel(args.random_weights)
        except ValueError as e:
            raise StartupError(str(e)) from None
        return model, model
    from ninfer.artifact import open_artifact

    path = _artifact_path(args)
    return path, open_artifact(path, components=("text",))


def _text_side(art: Any, args: argparse.Namespace):
    from ninfer.text import ChatFormatter, Tokenizer, TokenizerError
    from ninfer.text.chat_template import TemplateError

    try:
        tokenizer = Tokenizer.from_artifact(art)
    except TokenizerError as e:  # a hand-edited artifact: the converters check what they write
        raise StartupError(f"the artifact's tokenizer: {e}") from None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as fh:
                template = fh.read()
        except OSError as e:
            raise StartupError(f"--chat-template: cannot read {args.chat_template}: {e.strerror}") from None
    else:
        template = art.chat_template
        if template is None:
            raise StartupError("the artifact has no chat template; pass --chat-template FILE")
    try:
        formatter = ChatFormatter(tokenizer, template, art.special_tokens)
    except TemplateError as e:
        raise StartupError(f"chat template: {e}") from None
    model_id = args.model_id or art.metadata.get("name") or art.metadata["architecture"]
    return art, tokenizer, formatter, model_id


async def run_server(args: argparse.Namespace, argv: list[str] | None = None, *,
                     shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                     keepalive_s: float = KEEPALIVE_SECONDS,
                     runner_factory: Callable[[Any, EngineConfig], Any] | None = None,
                     task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED) -> None:
    from ninfer.engine.api import Engine

    t0 = time.monotonic()
    model, art = await trio.to_thread.run_sync(_open_model, args)
    path = model if isinstance(model, str) else model.source
    art, tokenizer, formatter, model_id = await trio.to_thread.run_sync(_text_side, art, args)
    request_log = None
    if args.request_log_jsonl:
        try:
            request_log = RequestLog(args.request_log_jsonl, artifact_path=model if isinstance(model, str) else None)
        except OSError as e:
            raise StartupError(str(e)) from None
    config = engine_config(args)
    log.info("loading %s (%s)", model_id, art.metadata["architecture"])
    # A CUDA runner the server builds itself is closed with the engine (its memory goes back at once,
    # not at process exit: the GPU tests start servers one after another in one process).
    owns_runner = runner_factory is None and args.device != "cpu"
    if runner_factory is None and args.device != "cpu":
        def runner_factory(art: Any, config: EngineConfig) -> Any:
            return cuda_runner(model, args, config)

        log.info("backend: CUDA on device %d", args.device)
    if runner_factory is None:
        log.info("backend: reference (CPU)")
        source, extra = path, {}  # the Engine loads the artifact on the reference backend
    else:  # CUDA, or a test's runner over the same artifact
        source = runner_factory(art, config)
        extra = {"eos_token_ids": art.special_tokens.get("eos_token_ids") or [], "generation": art.generation,
                 "close_runner": owns_runner}
        if args.kv_capacity == "auto":
            config = await _resolve_auto_capacity(source, config)
    try:
        async with Engine.open(source, config, **extra) as engine:
            facts = _startup_facts(source)
            _log_runner_startup(facts)
            state = ServerState(engine, model_id, int(time.time()),
                                PromptBuilder(tokenizer, formatter, serve_defaults(args)),
                                Metrics(engine, model_id), request_log,
                                ResponseStore(args.response_store_max_records, args.response_store_max_mib))
            app = App(state, api_key=args.api_key, cors=args.cors, max_request_mib=args.max_request_mib,
                      keepalive_s=keepalive_s)
            routes.install(app)
            try:
                bound = listen.bind(args.host, args.port)
            except listen.ListenError as e:
                raise StartupError(str(e)) from None
            if request_log is not None:
                _log_server_start(request_log, path, art, model_id, engine, args, argv or [], facts)
            async with trio.open_nursery() as nursery:
                if args.log_stats_interval_ms:
                    nursery.start_soon(throughput_loop, engine, request_log, args.log_stats_interval_ms / 1000.0)

                async def serve_then_stop(task_status: trio.TaskStatus[list[str]]) -> None:
                    await listen.serve(app, bound, shutdown_trigger=shutdown_trigger, task_status=task_status)
                    nursery.cancel_scope.cancel()  # the server is down: stop the stats loop too

                binds = await nursery.start(serve_then_stop)
                if engine.max_context < config.max_context:  # a sequence cannot outgrow the KV pool
                    log.warning("the context ceiling is %d tokens, below --max-context %d: the KV capacity "
                                "(or the runner) holds no more", engine.max_context, config.max_context)
                log.info("ready: serving %s on %s (max context %d, concurrency %d) after %.1f s", model_id,
                         binds[0], engine.max_context, config.max_concurrency, time.monotonic() - t0)
                task_status.started(RunningServer(binds[0], state, app))
            log.info("shutting down")
    finally:
        if request_log is not None:
            request_log.close()


async def _resolve_auto_capacity(runner: Any, config: EngineConfig) -> EngineConfig:
    """--kv-capacity auto: build the runner now (it sizes its KV pool from free device memory, once)
    and give the Engine that capacity. The runner makes its context current at every call, so being
    built on this helper thread rather than the Engine's worker is harmless."""
    built = await trio.to_thread.run_sync(lambda: getattr(runner, "runner", runner))  # WorkerBuiltRunner builds
    info = built.info
    tokens = info.num_pages * info.page_size
    sizing = getattr(built, "startup", {}).get("kv_auto", {})
    log.info("--kv-capacity auto: %d tokens (%d pages, %.2f GiB; %.2f GiB were free after the weights)", tokens,
             info.num_pages, info.num_pages * sizing.get("page_bytes", 0) / 2**30, sizing.get("free_bytes", 0) / 2**30)
    return attrs.evolve(config, kv_capacity=tokens)


def _startup_facts(source: Any) -> dict[str, Any] | None:
    """The CUDA runner's ``startup`` record (runner.py: weights, workspace, KV sizing, graphs), or None
    on the reference backend, whose runner the Engine builds from the artifact path."""
    if isinstance(source, str):
        return None
    return getattr(getattr(source, "runner", source), "startup", None) or None


def _log_runner_startup(facts: dict[str, Any] | None) -> None:
    """The CUDA runner's startup facts: weights, workspace, graph capture time and memory."""
    if not facts:
        return
    parts = [f"{facts['device']}"]
    if "weights_bytes" in facts:
        rate = facts.get("weights_upload_gb_per_s")
        parts.append(f"weights {facts['weights_bytes'] / 2**30:.2f} GiB"
                     + (f" at {rate} GB/s" if rate else " made on the device"))
    if facts.get("fragment_bytes"):
        parts.append(f"batched decode's copies in fragment order {facts['fragment_bytes'] / 2**30:.2f} GiB")
    parts.append(f"workspace {facts['workspace_bytes'] / 2**30:.2f} GiB incl. {facts['kv_pages']} KV pages")
    if "graph_capture_s" in facts:
        parts.append(f"{facts.get('graph_count', '')} decode graphs captured in {facts['graph_capture_s']} s "
                     f"({facts['graph_bytes'] / 2**20:.0f} MiB, {facts['graph_nodes']} nodes each)".lstrip())
    prefill_graph = facts.get("prefill_graph")
    if prefill_graph:
        parts.append(f"prefill graphs of {prefill_graph['rows']} rows ({prefill_graph['nodes']} nodes; "
                     f"{prefill_graph['kv_only_nodes']} without outputs) in {prefill_graph['seconds']} s")
    tuning = facts.get("prefill_gemm_tuning")
    if tuning and tuning["gemms"]:
        parts.append(f"prefill GEMMs of {tuning['rows']} rows tuned in {tuning['seconds']} s")
    parts.append(f"{facts['free_bytes_after_startup'] / 2**30:.2f} GiB free")
    log.info("CUDA startup: %s", "; ".join(parts))
    log.debug("CUDA startup record: %s", facts)


def _log_server_start(rl: RequestLog, path: str, art: Any, model_id: str, engine: Any,
                      args: argparse.Namespace, argv: list[str], facts: dict[str, Any] | None = None) -> None:
    cfg, stats = engine.config, engine.stats()
    rl.write(
        "server_start", artifact=os.path.abspath(path) if os.path.isfile(path) else path,
        architecture=art.metadata["architecture"], model_id=model_id, backend=engine.info.backend,
        formats=_formats(art, engine.info.backend, facts),
        # The context-cost model signature (prefill cost presets key by it), as the Engine computed it.
        model_signature=engine.signature,
        engine={"max_concurrency": cfg.max_concurrency, "max_pending_requests": cfg.max_pending_requests,
                "pending_timeout_ms": cfg.pending_timeout_ms, "prefill_chunk": cfg.prefill_chunk,
                "max_context": engine.max_context, "kv_capacity_tokens": cfg.kv_capacity_tokens,
                "kv_pages": cfg.kv_pages, "page_size": cfg.page_size, "prefix_reuse": cfg.prefix_reuse},
        # Capacities as the Engine built them (the Host default adds eight StateImages on hybrids).
        context_cache={"device_state_capacity_slots": stats.device_state_capacity_slots,
                       "device_state_used_slots": stats.device_state_used_slots,
                       "host_context_capacity_bytes": stats.host_context_capacity_bytes,
                       "host_context_used_bytes": stats.host_context_used_bytes,
                       "host_context_peak_bytes": stats.host_context_peak_bytes},
        context_cost_source=stats.context_cost_source,
        kv_sizing=_kv_sizing(args, cfg, facts),
        # Device-only records: null on the reference backend.
        memory=_device_memory(facts), cuda_graph=_graph_allowance(args, facts), cuda=_cuda_environment(args, facts),
        # The architecture presets a request starts from, by its initial thinking mode (the same
        # artifact generation block the Engine resolves), before process flags and request fields.
        sampling_defaults={"thinking": preset_for(art.generation, True),
                           "non_thinking": preset_for(art.generation, False)},
        sampling_overrides={flag: getattr(args, flag) for flag in SAMPLING_FLAGS},
        thinking={"default_enabled": not args.no_thinking, "preserve_thinking": args.preserve_thinking,
                  "default_thinking_budget": args.default_thinking_budget,
                  "default_max_tokens": args.default_max_tokens},
        argv=redact_argv(argv),
    )


def _formats(art: Any, backend: str, facts: dict[str, Any] | None) -> dict[str, Any]:
    """The artifact's tensor dtypes and the formats the runner holds: the reference upcasts every
    weight to f32 and keeps an f32 KV pool; CUDA keeps matrices bf16 (norms and vectors f32) and its
    KV pool in the dtype its startup record names."""
    artifact = None  # --random-weights: the weights are made on the device, there is no file to count
    if hasattr(art, "tensor_names"):
        artifact = dict(sorted(collections.Counter(art.tensor_info(name).dtype for name in art.tensor_names()).items()))
    if backend == "reference":
        weights, kv = "f32", "f32"
    else:
        weights, kv = "bf16", (facts or {}).get("kv_dtype")
    return {"artifact": artifact, "weights": weights, "kv": kv}


def _kv_sizing(args: argparse.Namespace, cfg: EngineConfig, facts: dict[str, Any] | None) -> dict[str, Any]:
    """How the Main KV pool got its size; with auto, the runner's ledger (runner.auto_kv_pages)."""
    mode = "auto" if args.kv_capacity == "auto" else "max_context" if args.kv_capacity is None else "tokens"
    ledger = (facts or {}).get("kv_auto") if mode == "auto" else None
    return {"mode": mode, "capacity_tokens": cfg.kv_capacity_tokens, "pages": cfg.kv_pages, "ledger": ledger}


def _device_memory(facts: dict[str, Any] | None) -> dict[str, Any] | None:
    """The device arenas: the weights allocation and the one workspace (KV pool, StateImages inside)."""
    if facts is None:
        return None
    return {"weights_bytes": facts.get("weights_bytes"),
            # the second, reordered copies of some matrices that batched decode reads (CudaRunner._fragment_copies)
            "weights_fragment_order_bytes": facts.get("fragment_bytes"),
            "workspace": {"capacity_bytes": facts["workspace_bytes"], "kv_pages": facts["kv_pages"],
                          "kv_dtype": facts.get("kv_dtype"), "state_slots": facts.get("state_slots"),
                          "state_bytes": facts.get("state_bytes")},
            "vision_workspace": None,  # Vision is not built
            "host_arena_bytes": facts.get("host_arena_bytes"),  # the pinned Host backing (--host-context-mib)
            "free_bytes_after_startup": facts.get("free_bytes_after_startup")}


def _graph_allowance(args: argparse.Namespace, facts: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the graphs were allowed (the estimate auto sizing reserved) and what they took: the decode
    graphs' count, bytes, nodes and seconds, and the prefill graph (``prefill``: rows, nodes, seconds)."""
    if facts is None:
        return None
    return {"enabled": not args.no_cuda_graph, "reserve_bytes": (facts.get("kv_auto") or {}).get("graph_reserve"),
            "count": facts.get("graph_count"), "bytes": facts.get("graph_bytes"),
            "nodes_per_graph": facts.get("graph_nodes"), "capture_seconds": facts.get("graph_capture_s"),
            "prefill": facts.get("prefill_graph") or None}


def _cuda_environment(args: argparse.Namespace, facts: dict[str, Any] | None) -> dict[str, Any] | None:
    if facts is None:
        return None
    return {"device": args.device, "name": facts["device"], "sync": facts.get("sync"),
            "prefill_gemm": facts.get("prefill_gemm"), "prefill_gemm_tuning": facts.get("prefill_gemm_tuning"),
            "weights_upload_gb_per_s": facts.get("weights_upload_gb_per_s"),
            "weights_random_fill_s": facts.get("weights_random_fill_s")}


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    logs.setup(args.log_level)

    async def run() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async def on_signal() -> None:
                async for _ in signals:
                    return

            await run_server(args, argv, shutdown_trigger=on_signal)

    from ninfer.artifact.errors import ArtifactError
    from ninfer.engine.errors import EngineError

    try:
        trio.run(run)
    # e.g. a malformed --context-cost-presets file, or an artifact that is truncated or not one
    except (StartupError, BackendStartError, EngineError, ArtifactError) as e:
        log.debug("startup failed", exc_info=e)  # the traceback, for --log-level debug only
        print(f"ninfer serve: {e}", file=sys.stderr)
        return 1
    return 0
