"""The engine worker thread: the only thread that calls the runner.

Trio tasks post commands (submit, cancel, stop, close) to a locked inbox and never wait for the
worker. The worker wakes consumers with ``TrioToken.run_sync_soon``, which only enqueues a
callback on the trio loop, so a slow consumer never stalls the next step.
"""

from __future__ import annotations

import collections
import gc
import threading
import time
from typing import Callable

import trio

from ninfer.engine.core import EngineCore
from ninfer.engine.errors import EngineUnavailable, QueueTimeout
from ninfer.engine.sequence import Phase, Sequence
from ninfer.engine.stats import StatsSnapshot

PUBLISH_INTERVAL = 0.02  # seconds between stats snapshots while busy
DELIVERY_INTERVAL = 0.001  # seconds between consumer wake-ups for ordinary token deltas


class Worker:
    def __init__(self, build: Callable[[], EngineCore], wake: Callable[[list[Sequence]], None],
                 close_runner: bool) -> None:
        self._build = build
        self.core: EngineCore | None = None
        self._wake = wake
        self._close_runner = close_runner
        self._cond = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._live: dict[int, Sequence] = {}
        self.ready = False
        self.failure: BaseException | None = None
        self.snapshot: StatsSnapshot | None = None
        self._published_at = time.monotonic()
        self._started = threading.Event()
        self._undelivered: dict[int, Sequence] = {}
        self._delivered_at = 0.0
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)

    async def start(self) -> None:
        """Start the thread, which builds the core; re-raise a startup failure here."""
        self._thread.start()
        await trio.to_thread.run_sync(self._started.wait)
        if self._startup_error is not None:
            await trio.to_thread.run_sync(self._thread.join)
            raise self._startup_error

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        try:
            self.core = self._build()
            # What start-up made (the model's host-side tables, modules, the tokenizer) lives as long
            # as the process: frozen, the collector's full passes skip it instead of stopping this
            # thread for many milliseconds in the middle of serving (torch-sized heaps: 100+ ms).
            gc.collect()
            gc.freeze()
            self.snapshot = self.core.snapshot(ready=True)
            self.ready = True
        except BaseException as exc:
            self._startup_error = exc
            return
        finally:
            self._started.set()
        self._main()

    def post(self, command: str, arg=None) -> None:
        with self._cond:
            self._inbox.append((command, arg))
            self._cond.notify()

    # -- the loop -------------------------------------------------------------------------

    def _main(self) -> None:
        core = self.core
        work = core.counters.host_work
        try:
            stalled = False
            while True:
                # A step that planned nothing cannot happen by design (the oldest resident always
                # advances; with none resident the head request fits); if it ever does, wait for
                # a command or a millisecond instead of spinning a core.
                commands = self._take(block=not core.has_work() or stalled, stall=stalled)
                t0 = time.perf_counter()  # idle waiting is not host work
                for command, arg in commands:
                    if command == "close":
                        self._shutdown(EngineUnavailable("the engine is closed"))
                        return
                    self._apply(command, arg)
                self._expire(core.clock())
                work["engine_maintenance"] += time.perf_counter() - t0
                if core.has_work():
                    # Events of the previous step are delivered once this step is planned,
                    # right before the runner calls: the consumers' wake-up overlaps model math.
                    stalled = not core.step(before_run=self._deliver)
                if not core.has_work():
                    self._deliver(force=True)  # nothing follows: deliver before the worker idles
        except BaseException as exc:  # an engine-wide failure: every live request learns of it
            self.failure = exc
            self._shutdown(EngineUnavailable(f"engine failed: {type(exc).__name__}: {exc}"))

    def _take(self, block: bool, stall: bool = False) -> list:
        with self._cond:
            if block and not self._inbox:
                t0 = time.perf_counter()
                self._publish(force=True)  # before idling: Host work of the maintenance phase
                self.core.counters.host_work["engine_maintenance"] += time.perf_counter() - t0
                self._cond.wait(timeout=0.001 if stall else self._idle_timeout())
            commands = list(self._inbox)
            self._inbox.clear()
        return commands

    def _idle_timeout(self) -> float | None:
        waiting = self.core.scheduler.waiting
        if not waiting:
            return None
        return max(0.0, min(s.deadline for s in waiting) - self.core.clock())

    def _apply(self, command: str, arg) -> None:
        core = self.core
        if command == "submit":
            self._live[arg.rid] = arg
            core.add(arg)
        elif command == "cancel":
            core.cancel(arg)
        elif command == "stop":
            core.stop(*arg)
        elif command == "expire":
            if arg.phase is Phase.WAITING:
                self.core.fail(arg, QueueTimeout(self.core.config.pending_timeout_ms), "queue_timeout")

    def _expire(self, now: float) -> None:
        for seq in [s for s in self.core.scheduler.waiting if s.expired or s.deadline <= now]:
            if seq.expire():
                self.core.fail(seq, QueueTimeout(self.core.config.pending_timeout_ms), "queue_timeout")

    def _deliver(self, force: bool = False) -> None:
        """Wake the consumers of requests with new events. Every wake-up hands the GIL to the
        trio thread, so ordinary token deltas are coalesced to one wake per DELIVERY_INTERVAL;
        a first token, a terminal event, or an idle worker wakes at once."""
        t0 = time.perf_counter()
        touched = self.core.take_touched()
        urgent = force
        for seq in touched:
            if seq.rid not in self._undelivered:
                self._undelivered[seq.rid] = seq
            if seq.phase is Phase.DONE:
                self._live.pop(seq.rid, None)
                urgent = True
            elif seq.t_first is not None and seq.t_first == seq.t_last and seq.n_output <= 1:
                urgent = True  # the first token: time to first token is not coalesced
        now = time.monotonic()
        if self._undelivered and (urgent or now - self._delivered_at >= DELIVERY_INTERVAL):
            self._publish(force=urgent)
            self._wake(list(self._undelivered.values()))
            self._undelivered.clear()
            self._delivered_at = now
        else:
            self._publish(force=False)
        self.core.counters.host_work["engine_commit_output"] += time.perf_counter() - t0

    def _publish(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._published_at >= PUBLISH_INTERVAL:
            t0 = time.perf_counter()
            self.snapshot = self.core.snapshot(ready=self.ready)
            self._published_at = now
            c = self.core.counters  # this publication shows in the next snapshot
            c.stats_publication_seconds += time.perf_counter() - t0
            c.stats_publications += 1

    def _shutdown(self, error: EngineUnavailable) -> None:
        self.ready = False
        for seq in list(self._live.values()):
            try:
                self.core.fail(seq, error, "error")
            except Exception:  # the failure may have left pools mid-update: still tell the request
                seq.outbox.append(error)
                self.core.touched.append(seq)
        with self._cond:
            for command, arg in self._inbox:
                if command == "submit":
                    self.core.fail(arg, error, "error")
            self._inbox.clear()
        try:
            if self._close_runner:
                self.core.runner.close()
        finally:
            self._live.clear()
            self._publish(force=True)
            self._deliver(force=True)
            gc.unfreeze()  # what start-up froze may be collected again (a process may start another engine)
