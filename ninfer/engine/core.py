"""The engine step: schedule → run → postprocess, on whichever single thread owns the runner.

:class:`EngineCore` is synchronous and has no trio or threading: the worker thread drives it in
production, and tests drive it directly with a simulated runner. Events go to each sequence's
``outbox``; ``touched`` lists the sequences that received some since the last ``take_touched()``.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ninfer.backends.runner import DecodeBatch, ModelRunner, PrefillChunk, SamplingRow
from ninfer.engine.config import EngineConfig
from ninfer.engine.context_cost import ContextCost
from ninfer.engine.events import (EngineTiming, Finished, FirstOutputTiming, PromptProgress,
                                  SchedulingCounters, Timings, TokenDelta, Transition, Usage,
                                  WorkProgress)
from ninfer.engine.pools import HostBudget, KVPool, StateSlots
from ninfer.engine.prefix_cache import PrefixCache
from ninfer.engine.scheduler import Plan, Scheduler
from ninfer.engine.sequence import Phase, Sequence
from ninfer.engine.stats import PROGRAM_CLASSES, Counters, StatsSnapshot


class EngineCore:
    def __init__(self, runner: ModelRunner, config: EngineConfig, cost: ContextCost,
                 clock: Callable[[], float] = time.monotonic) -> None:
        info = runner.info
        if info.page_size != config.page_size:
            raise ValueError(f"runner page_size {info.page_size} differs from config page_size {config.page_size}")
        if info.max_batch < config.max_concurrency:
            raise ValueError(f"runner has {info.max_batch} lanes; max_concurrency is {config.max_concurrency}")
        if info.num_pages < config.kv_pages:
            raise ValueError(f"runner KV pool has {info.num_pages} pages; kv_capacity needs {config.kv_pages}")
        self.runner = runner
        self.config = config
        self.clock = clock
        self.cost = cost
        self.limit = min(config.sequence_limit, info.max_context)
        # A runner with StateImages (a hybrid model) keeps recurrent state per lane.
        self.recurrent = callable(getattr(runner, "copy_state", None))
        extra = config.state_slots - config.max_concurrency
        if self.recurrent and runner.num_state_slots < info.max_batch + extra:
            raise ValueError(f"runner has {runner.num_state_slots} StateImage slots; {info.max_batch} lanes "
                             f"and device_state_slots {extra} need {info.max_batch + extra}")
        self.state_bytes = int(runner.state_floats) * 4 if self.recurrent else 0  # float32 images
        self.pool = KVPool(config.kv_pages)
        self.slots = StateSlots(config.state_slots, lanes=config.max_concurrency, first_checkpoint=info.max_batch,
                                checkpoints=self.recurrent)
        # The spec default: 8192 MiB plus eight StateImages (none for a dense model).
        self.host = HostBudget(config.host_context_bytes + config.host_state_images * self.state_bytes)
        self.cache = (PrefixCache(self.pool, config.page_size, slots=self.slots if self.recurrent else None,
                                  host=self.host if self.recurrent else None, state_bytes=self.state_bytes)
                      if config.prefix_reuse else None)
        # Bytes of one KV page as the runner stores it (bf16 stays bf16): what page copies and
        # snapshots move, and what a snapshot holds of the Host budget. A test double that does not
        # say has one page read (the core is built on the thread that owns the runner).
        page_bytes = getattr(runner, "page_bytes", None)
        self.page_bytes = int(runner.read_pages([0]).nbytes if page_bytes is None else page_bytes)
        self.scheduler = Scheduler(config, self.pool, self.slots, self.host, self.cache, cost,
                                   self.page_bytes, clock, state_bytes=self.state_bytes)
        self.counters = Counters()
        self.scheduler.on_transition = self._transition
        self.touched: list[Sequence] = []
        self._max_pages = -(-self.limit // config.page_size)
        # Persistent page tables, one row per lane; rows are synced incrementally.
        self._tables = np.full((config.max_concurrency, self._max_pages), -1, dtype=np.int32)
        self._synced = [0] * config.max_concurrency
        self.last_step_seconds = 0.0
        self.last_runner_seconds = 0.0
        self._class_device = dict.fromkeys(PROGRAM_CLASSES, 0.0)  # the current step's programs (_count_classes)
        # A runner that pipelines decode gets the next step launched before this one is read
        # (``Scheduler.decode_ahead``), so the host's work between steps hides under the device's.
        self.pipelined = bool(info.pipelined_decode)
        self._ahead: list[Sequence] | None = None  # rows of the step launched ahead, in flight
        self._planned: Plan | None = None  # planned, its runner calls not yet made (stats gauges)

    # -- requests -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        boundaries = [seq.request.input_checkpoint or 0, *seq.request.cache_boundaries]
        seq.pending_captures = sorted({b for b in boundaries if 0 < b <= seq.prompt_len})
        self.scheduler.add(seq)

    def cancel(self, seq: Sequence) -> None:
        if seq.phase is not Phase.DONE:
            self._finish(seq, "cancelled", "cancelled")

    def stop(self, seq: Sequence, accepted: int | None = None) -> None:
        """A stop string matched in the text layer: finish "stop" now. ``accepted`` output
        tokens (what the consumer had received) are the request's output; tokens committed
        after them are dropped from usage, generated ids and the retained endpoint."""
        if seq.phase is not Phase.DONE:
            if accepted is not None:
                seq.accepted = min(accepted, seq.n_output)
            self._finish(seq, "stop", "stop_string")

    def fail(self, seq: Sequence, error: BaseException, outcome: str) -> None:
        """End ``seq`` with an error instead of a Finished event (queue timeout, engine failure)."""
        if seq.phase is not Phase.DONE:
            self.scheduler.release(seq)
            seq.error = error
            self._emit(seq, error)
            self.counters.outcome(outcome)

    def has_work(self) -> bool:
        return self._ahead is not None or self.scheduler.has_work()

    def take_touched(self) -> list[Sequence]:
        touched, self.touched = self.touched, []
        return touched

    # -- one step -------------------------------------------------------------------------

    def step(self, before_run: Callable[[], None] | None = None) -> bool:
        """One step; False when the plan was empty. ``before_run`` (the worker's event delivery)
        runs between scheduling and the runner calls, so consumers wake while the model
        computes; it times itself."""
        c = self.counters
        t0 = time.perf_counter()
        plan = self._ahead_plan() if self._ahead is not None else self.scheduler.schedule()
        t1 = time.perf_counter()
        self._planned = plan
        self._publish_admissions(plan)
        if before_run is not None:
            before_run()
        t1b = time.perf_counter()
        try:
            device = self._execute(plan)
        finally:
            self._planned = None
        t2 = time.perf_counter()
        # The step's Host time by phase (before_run is the worker's event delivery, which it counts
        # under engine_commit_output itself); every request of the step is exposed to all of it. What
        # ran before the commits is exposed first: a first output committed now freezes with it.
        participants = list(plan.decode) + ([plan.prompt.seq] if plan.prompt is not None else [])
        phases = {"engine_boundary": t1 - t0, "engine_commit_output": t1b - t1, "program_submit": (t2 - t1b) - device}
        for seq in participants:
            self._expose(seq, phases, device)
        self._postprocess(plan)
        t3 = time.perf_counter()
        post = {"program_post": t3 - t2}
        phases.update(post)
        for seq in participants:
            self._expose(seq, post, 0.0)
        for phase in ("engine_boundary", "program_submit", "program_post"):
            c.host_work[phase] += phases[phase]
        c.device_wait += device
        self._count_classes(phases["engine_boundary"] + phases["program_submit"] + phases["program_post"], device)
        self.last_step_seconds = t3 - t0
        self.last_runner_seconds = device
        for seq in plan.decode:
            seq.decode_host_seconds += (t3 - t0) - device
            seq.decode_device_seconds += device
        return not plan.empty

    def _publish_admissions(self, plan: Plan) -> None:
        """The initial PromptProgress (processed == cache: the reuse choice admission committed) of
        each request this step binds for the first time (its first binding is counted only in this
        step's post-processing, ``cached_reported``), out before the runner calls: ``before_run``
        delivers it while the first prefill unit computes, so a stream starts then."""
        now = self.clock()
        for seq in plan.admitted:
            if not seq.cached_reported:
                self._emit(seq, PromptProgress(seq.prompt_len, seq.cached, seq.cached, (now - seq.t_admit) * 1000.0))

    def _count_classes(self, host: float, device: float) -> None:
        """A step's work classes: its decode and prefill programs' Device wait as timed, and its Host
        time in proportion to them (a step's scheduling and commits serve the programs it ran)."""
        c = self.counters
        for cls, seconds in self._class_device.items():
            c.class_device[cls] += seconds
            if device > 0:
                c.class_host[cls] += host * seconds / device
        self._class_device = dict.fromkeys(PROGRAM_CLASSES, 0.0)

    @staticmethod
    def _expose(seq: Sequence, phases: dict[str, float], device: float) -> None:
        """A step ``seq`` took part in: its Host phases and Device wait delayed the request."""
        for phase, seconds in phases.items():
            seq.host_phases[phase] += seconds
        seq.host_seconds += sum(phases.values())
        seq.device_seconds += device

    def _execute(self, plan: Plan) -> float:
        """Run the plan's mechanism on the runner; return seconds spent inside runner calls. The
        pause and restore boundaries are stamped here, when their copies have landed."""
        runner, device = self.runner, 0.0
        pc = time.perf_counter
        for pause in plan.pauses:
            if pause.route == "snapshot":
                t = pc()
                pages = runner.read_pages(pause.pages)
                pause.seq.snapshot = pages if pause.lane is None else (pages, runner.read_state(pause.lane))
                device += pc() - t
            self._transition(pause.seq, "paused", pause.route)
        if plan.copies:
            t = pc()
            runner.copy_pages([s for s, _, _ in plan.copies], [d for _, d, _ in plan.copies])
            device += pc() - t
        for src, lane in plan.state_copies:
            t = pc()
            runner.copy_state(src, lane)
            device += pc() - t
        for lane, image, length in plan.state_writes:
            t = pc()
            runner.write_state(lane, image, length=length)
            device += pc() - t
        for restore in plan.restores:
            t = pc()
            runner.write_pages(restore.pages, restore.data)
            if restore.state is not None:
                runner.write_state(restore.seq.lane, restore.state, length=restore.seq.computed)
            device += pc() - t
        for lane, generated in plan.binds:
            self._synced[lane] = 0
            self._tables[lane, :] = -1
            t = pc()
            runner.bind_lane(lane, generated)
            device += pc() - t
        for seq in [r.seq for r in plan.restores] + plan.replays:
            self._transition(seq, "restored", seq.route)  # binding installed
            self._rebuilt(seq)
        unit = plan.prompt
        if unit is not None:
            seq = unit.seq
            chunk = PrefillChunk(
                lane=seq.lane, tokens=np.asarray(seq.tokens[unit.start : unit.end], dtype=np.int32),
                start=unit.start, page_table=np.asarray(seq.pages, dtype=np.int32),
                sample=self._row(seq) if unit.sample else None)
            t = pc()
            result = runner.prefill(chunk)
            spent = pc() - t
            device += spent
            if not unit.control:  # a prefill or replay chunk; forced control tokens are control work
                self._class_device["prefill"] += spent
                if result.device_interval is not None:
                    seq.gpu_intervals.append(result.device_interval)
            unit.result = result.tokens
        if plan.decode or plan.launched is not None:
            t = pc()
            plan.decode_result = self._run_decode(plan)
            spent = pc() - t
            device += spent
            self._class_device["decode"] += spent
        return device

    def _ahead_plan(self) -> Plan:
        """The plan that collects the step launched ahead: its rows still resident (a row that
        finished on the last step's token, or was stopped since, is dropped)."""
        launched, self._ahead = self._ahead, None
        return Plan(decode=[s for s in launched if s.phase is Phase.RESIDENT], launched=launched)

    def _run_decode(self, plan: Plan) -> np.ndarray:
        """The plan's decode step (launched now, or ahead by the last step); its tokens, a row each."""
        runner, launched = self.runner, plan.launched
        if not self.pipelined:
            return runner.decode(self._decode_batch(plan.decode)).tokens
        if launched is None:
            launched = plan.decode
            runner.launch_decode(self._decode_batch(launched))
        if len(launched) == len(plan.decode) and self.scheduler.decode_ahead(plan.decode):
            runner.launch_decode(self._decode_batch(plan.decode, ahead=True), follow=True)
            self._ahead = list(plan.decode)
        tokens = runner.finish_decode().tokens
        if len(launched) != len(plan.decode):
            tokens = tokens[[i for i, s in enumerate(launched) if s.phase is Phase.RESIDENT]]
        return tokens

    def _decode_batch(self, rows: list[Sequence], ahead: bool = False) -> DecodeBatch:
        """The runner's batch for ``rows``; ``ahead``: for the step after the one in flight, one
        position on, its input tokens still on the device (placeholders here)."""
        tables, synced = self._tables, self._synced
        lanes = []
        for seq in rows:
            lane = seq.lane
            n = len(seq.pages)
            if synced[lane] != n:
                tables[lane, synced[lane] : n] = seq.pages[synced[lane] :]
                synced[lane] = n
            lanes.append(lane)
        lane_arr = np.array(lanes, dtype=np.int32)
        shift = int(ahead)
        return DecodeBatch(
            lanes=lane_arr,
            tokens=np.zeros(len(rows), np.int32) if ahead else np.array([s.tokens[-1] for s in rows], dtype=np.int32),
            positions=np.array([s.computed + shift for s in rows], dtype=np.int32),
            page_tables=tables[lane_arr],
            sampling=[self._row(s, shift) for s in rows],
        )

    def _row(self, seq: Sequence, ahead: int = 0) -> SamplingRow:
        step = seq.n_output + ahead
        r = seq.row
        return SamplingRow(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                           presence_penalty=r.presence_penalty, frequency_penalty=r.frequency_penalty,
                           seed=r.seed, step=step)

    # -- postprocess ----------------------------------------------------------------------

    def _postprocess(self, plan: Plan) -> None:
        c = self.counters
        now = self.clock()
        for pause in plan.pauses:
            c.preemptions += 1
            if pause.route == "snapshot":
                self._transfer(pause.seq, "main_kv", "device_to_host", len(pause.pages) * self.page_bytes)
                if pause.lane is not None:
                    self._transfer(pause.seq, "state", "device_to_host", self.state_bytes)
                    c.state_ops["snapshot"] += 1
        for restore in plan.restores:
            c.snapshot_restores += 1
            self._transfer(restore.seq, "main_kv", "host_to_device", len(restore.pages) * self.page_bytes)
            if restore.state is not None:
                self._transfer(restore.seq, "state", "host_to_device", self.state_bytes)
                c.state_ops["restore"] += 1
        for _, _, seq in plan.copies:
            c.cow_copies += 1
            self._transfer(seq, "main_kv", "device_to_device", self.page_bytes)
        # Where a bound lane's StateImage came from: a checkpoint slot, or a spilled image on the Host.
        state_from = {}
        for _, lane in plan.state_copies:
            c.state_ops["reuse"] += 1
            self._transfer(self.scheduler.lanes[lane], "state", "device_to_device", self.state_bytes)
            state_from[lane] = "device"
        for lane, _, _ in plan.state_writes:
            c.state_ops["restore_from_host"] += 1
            self._transfer(self.scheduler.lanes[lane], "state", "host_to_device", self.state_bytes)
            state_from[lane] = "host"
        c.replay_restores += len(plan.replays)
        for seq in plan.admitted:
            if not seq.cached_reported:
                self._on_first_binding(seq, state_from.get(seq.lane))
        unit = plan.prompt
        if unit is not None and unit.seq.phase is Phase.RESIDENT:
            self._post_prompt(unit, now)
        if plan.decode:
            c.decode_rounds += 1
            c.decode_row_rounds += len(plan.decode)
            for seq, token in zip(plan.decode, plan.decode_result.tolist()):
                seq.decode_rounds += 1
                seq.computed += 1
                c.decode_tokens += 1
                self._commit(seq, token, now)

    def _transfer(self, seq: Sequence, resource: str, direction: str, nbytes: int) -> None:
        """A completed context copy ``seq`` owns: the global counter and the request's own."""
        self.counters.transfer_bytes[(resource, direction)] += nbytes
        seq.transfers[(resource, direction)] += nbytes

    def _on_first_binding(self, seq: Sequence, state: str | None) -> None:
        c = self.counters
        seq.cached_reported = True
        c.prompt_tokens += seq.prompt_len
        c.prompt_tokens_cached += seq.cached
        if seq.cached:
            c.prefix_hits += 1
        c.last_selection = {"path": "checkpoint" if seq.cached else "root", "prompt_tokens": seq.prompt_len,
                            "reused_tokens": seq.cached, "state": state}
        c.queue.observe(seq.t_admit - seq.t_submit)
        seq.pending_captures = [b for b in seq.pending_captures if b > seq.cached]

    def _post_prompt(self, unit, now: float) -> None:
        c, seq = self.counters, unit.seq
        seq.computed = unit.end
        fresh = False  # prompt positions computed for the first time
        if not unit.control:
            seq.prefill_units += 1
            c.prefill_units += 1
        if unit.control:
            seq.control_units += 1
            c.control_units += 1
            if not seq.needs_prompt_work:
                seq.in_control = False
        elif unit.replay:
            seq.replayed_tokens += unit.end - unit.start
            c.replayed_tokens += unit.end - unit.start
        else:
            # Prompt positions below the high-water mark were computed before a pause: recovery.
            fresh_from = max(unit.start, seq.prompt_high)
            if fresh_from > unit.start:
                seq.replayed_tokens += min(unit.end, seq.prompt_high) - unit.start
                c.replayed_tokens += min(unit.end, seq.prompt_high) - unit.start
            if unit.end > seq.prompt_high:
                c.prefill_tokens += unit.end - fresh_from
                seq.prompt_high = unit.end
                self._emit(seq, PromptProgress(seq.prompt_len, seq.cached, unit.end,
                                               (now - seq.t_admit) * 1000.0))
                fresh = True
        self._rebuilt(seq)
        if fresh:
            self._recovered(seq)  # fresh prompt tokens: the first new committed unit
        named = False  # a named boundary was retained exactly here
        while seq.pending_captures and seq.pending_captures[0] <= seq.computed:
            boundary = seq.pending_captures.pop(0)
            self._capture(seq, boundary)
            named = boundary == seq.computed
        if (self.recurrent and self.cache is not None and not unit.replay and not unit.control and not named
                and seq.needs_prompt_work and self.slots.has_free_checkpoint):
            # A long prefill keeps its chunk boundaries while spare slots last (never evicting a
            # checkpoint for them), so an interrupted or repeated long prompt resumes mid-way.
            self._capture(seq, seq.computed, spare=True)
        if unit.sample:
            self._commit(seq, int(unit.result[0]), now)
        elif seq.n_output == 0 and seq.computed == seq.prompt_len and seq.request.max_tokens == 0:
            seq.t_prompt_done = now
            self._finish(seq, "length", "max_tokens")

    def _commit(self, seq: Sequence, token: int, now: float) -> None:
        if seq.phase is not Phase.RESIDENT:
            return
        c = self.counters
        self._recovered(seq)
        seq.append(token)
        c.generation_tokens += 1
        if seq.t_first is None:
            seq.t_first = now
            c.ttft.observe(now - seq.t_reserve)  # includes preparation and queueing
            seq.first_output = self._first_output(seq, now)
        seq.t_last = now
        self._emit(seq, TokenDelta((token,)))
        thinking = seq.request.thinking
        if seq.in_thinking:
            seq.thinking_count += 1
            if token == thinking.end_think_id:
                seq.in_thinking = False
        if token in seq.stop_ids:
            self._finish(seq, "stop", "eos")
        elif not self._finish_at_limits(seq) and (
                seq.in_thinking and thinking.budget is not None and seq.thinking_count >= thinking.budget):
            self._force_close(seq, thinking.close_ids, now)

    @staticmethod
    def _first_output(seq: Sequence, now: float) -> FirstOutputTiming:
        elapsed = now - seq.t_submit
        queue = (seq.t_admit if seq.t_admit is not None else now) - seq.t_submit
        return FirstOutputTiming(
            elapsed_seconds=elapsed, queue_seconds=queue, paused_seconds=seq.paused_seconds,
            resident_seconds=max(0.0, elapsed - queue - seq.paused_seconds),
            host_exposed_seconds=seq.host_seconds, device_wait_exposed_seconds=seq.device_seconds,
            prefill_tokens=max(0, seq.prompt_high - seq.cached), replayed_tokens=seq.replayed_tokens)

    def _finish_at_limits(self, seq: Sequence) -> bool:
        if seq.n_output >= seq.request.max_tokens:
            self._finish(seq, "length", "max_tokens")
        elif len(seq.tokens) >= seq.limit:
            self._finish(seq, "length", "context")
        else:
            return False
        return True

    def _force_close(self, seq: Sequence, ids: tuple[int, ...], now: float) -> None:
        """The thinking budget is spent: commit the close suffix without sampling it. The
        sequence's frontier moves past its KV, so its next unit is one control chunk that writes
        the suffix's KV (the prompt-work path), after which it decodes normally."""
        c = self.counters
        for token in ids:
            seq.append(token)
        n = len(ids)
        c.generation_tokens += n
        c.decode_tokens += n  # the spec counts injected control outputs as decode/control output
        c.forced_tokens += n
        c.thinking_budget_applied += 1
        seq.forced_total += n
        seq.budget_applied += 1
        seq.in_thinking = False
        seq.in_control = True
        seq.t_last = now
        self._emit(seq, TokenDelta(tuple(ids)))
        self._finish_at_limits(seq)

    def _capture(self, seq: Sequence, length: int, session: bool = False, spare: bool = False) -> None:
        """Retain ``seq``'s first ``length`` tokens. A recurrent model's retained prefix is
        reusable only with a checkpoint: the lane's StateImage, copied into a checkpoint slot,
        which exists only right after a unit ended exactly at ``length``."""
        if self.recurrent and (length != seq.computed or seq.lane is None):
            return  # no state at this boundary: its KV alone could never be resumed
        path = self.scheduler.capture(seq, length, session)
        if not path:
            return
        self.counters.prefix_captures += 1
        node = path[-1]
        if self.recurrent and node.state is not None and not spare:
            self.cache.keep_checkpoint(node)
        elif self.recurrent and node.state is None:
            slot = self.cache.checkpoint_slot(self._spill_read)
            if slot is not None:
                t = time.perf_counter()
                self.runner.copy_state(seq.lane, slot)
                self.counters.device_wait += time.perf_counter() - t
                self.cache.set_checkpoint(node, slot, spare)
                c = self.counters
                c.state_ops["capture"] += 1
                c.transfer_bytes[("state", "device_to_device")] += self.state_bytes

    def _spill_read(self, slot: int) -> np.ndarray:
        """Read an evicted checkpoint's image to the Host (the prefix cache reserved its bytes)."""
        t = time.perf_counter()
        image = self.runner.read_state(slot)
        c = self.counters
        c.device_wait += time.perf_counter() - t
        c.state_ops["spill"] += 1
        c.transfer_bytes[("state", "device_to_host")] += self.state_bytes
        return image

    def _emit(self, seq: Sequence, event) -> None:
        # Always mark: the consumer may drain the outbox concurrently, so "was empty" is unsound.
        self.touched.append(seq)
        seq.outbox.append(event)

    def _finish(self, seq: Sequence, reason: str, detail: str) -> None:
        now = self.clock()
        if seq.preemptions:
            if reason != "cancelled":
                self._recovered(seq)  # normal terminal progress ends recovery too
            self._transition(seq, "terminal", seq.route)
        if reason != "cancelled" and seq.request.capture_endpoint and seq.phase is Phase.RESIDENT:
            end = seq.computed if seq.accepted is None else min(seq.computed, seq.prompt_len + seq.accepted)
            if end > seq.cached:
                self._capture(seq, end, session=True)
        self.scheduler.release(seq)
        seq.finish = (reason, detail)
        self.counters.outcome(reason)
        # Every settled request, cancelled ones included, lands in both histograms: one that never
        # left the queue (admission observes the others) queued until now. The duration starts where
        # the TTFT does, at preparation, so a request's TTFT never exceeds its duration.
        if seq.t_admit is None:
            self.counters.queue.observe(now - seq.t_submit)
        self.counters.duration.observe(now - seq.t_reserve)
        self._emit(seq, self._finished_event(seq, reason, detail, now))

    def _finished_event(self, seq: Sequence, reason: str, detail: str, now: float) -> Finished:
        admit = seq.t_admit if seq.t_admit is not None else now
        first = seq.t_first
        output = seq.output if seq.accepted is None else seq.output[: seq.accepted]
        prompt_end = first if first is not None else (seq.t_prompt_done or now)
        return Finished(
            reason=reason,
            detail=detail,
            usage=Usage(prompt_tokens=seq.prompt_len, cached_tokens=seq.cached,
                        completion_tokens=len(output)),
            timings=Timings(queue=admit - seq.t_submit, prompt=max(0.0, prompt_end - admit),
                            generation=(seq.t_last - first) if first is not None else 0.0,
                            total=now - seq.t_submit,
                            ttft=(first - seq.t_submit) if first is not None else None),
            scheduling=SchedulingCounters(
                preemptions=seq.preemptions, snapshot_restores=seq.snapshot_restores,
                replay_restores=seq.replay_restores, replayed_tokens=seq.replayed_tokens,
                paused_seconds=seq.paused_seconds, transfer_bytes=sum(seq.transfers.values()),
                context_transfers=_by_resource(seq.transfers),
                thinking_budget_applied=seq.budget_applied, forced_tokens=seq.forced_total,
                transitions=tuple(seq.transitions)),
            engine_timing=EngineTiming(
                queue_wait_seconds=admit - seq.t_submit, host_exposed_seconds=seq.host_seconds,
                device_wait_exposed_seconds=seq.device_seconds, decode_rounds=seq.decode_rounds,
                prefill_units=seq.prefill_units, control_units=seq.control_units,
                host_phases=dict(seq.host_phases), decode_host_seconds=seq.decode_host_seconds,
                decode_device_wait_seconds=seq.decode_device_seconds),
            prefix_reuse_path="checkpoint" if seq.cached else "root",
            generated_token_ids=tuple(output),
            seed=seq.row.seed,
            first_output=seq.first_output,
            gpu_seconds=self._gpu_seconds(seq),
        )

    def _gpu_seconds(self, seq: Sequence) -> float | None:
        """Device seconds of the request's prefill and replay stream intervals (waiting for the last
        to end); None on a backend without device timing, or where one cannot be read."""
        intervals, seq.gpu_intervals = seq.gpu_intervals, []
        if not self.runner.info.times_device:
            return None
        seconds = [interval.seconds() for interval in intervals]
        return None if None in seconds else sum(seconds)

    def _rebuilt(self, seq: Sequence) -> None:
        """replay_complete once a replay restore has rebuilt the frontier saved at its pause."""
        if seq.rebuild_to is not None and seq.computed >= seq.rebuild_to:
            seq.rebuild_to = None
            self._transition(seq, "replay_complete", "replay")

    def _recovered(self, seq: Sequence) -> None:
        """recovery_complete at the first fresh committed unit (or normal finish) after a pause."""
        if seq.recovering and seq.phase is Phase.RESIDENT:
            seq.recovering = False
            self._transition(seq, "recovery_complete", seq.route)

    def _transition(self, seq: Sequence, kind: str, route: str | None) -> None:
        c = self.counters
        steady = time.monotonic_ns()
        seq.transitions.append(Transition(
            kind=kind, preemption_index=seq.preemptions, route=route, steady_ns=steady,
            elapsed_ns=steady - int(seq.t_submit * 1e9),
            engine_progress=WorkProgress(prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
                                         replayed_tokens=c.replayed_tokens),
            request_progress=WorkProgress(prefill_tokens=max(0, seq.prompt_high - seq.cached),
                                          # decode/control, as the global counter: forced ids too
                                          decode_tokens=seq.decode_rounds + seq.forced_total,
                                          replayed_tokens=seq.replayed_tokens)))

    # -- stats ----------------------------------------------------------------------------

    def _work_classes(self) -> dict[str, dict[str, float]]:
        """Host and Device-wait seconds by work class; control is what decode and prefill leave."""
        c = self.counters
        classes = {cls: {"host": c.class_host[cls], "device_wait": c.class_device[cls]} for cls in PROGRAM_CLASSES}
        classes["control"] = {"host": max(0.0, sum(c.host_work.values()) - sum(c.class_host.values())),
                              "device_wait": max(0.0, c.device_wait - sum(c.class_device.values()))}
        return classes

    def snapshot(self, ready: bool) -> StatsSnapshot:
        c, s = self.counters, self.scheduler
        residents = [q for q in s.lanes if q is not None]
        replaying = sum(1 for q in residents if q.replaying)
        prefilling = sum(1 for q in residents if q.needs_prompt_work and not q.replaying)
        return StatsSnapshot(
            backend=self.runner.info.backend, max_concurrency=self.config.max_concurrency,
            max_context_tokens=self.limit, page_size=self.config.page_size,
            context_cost_source=self.cost.source, ready=ready,
            requests_running=len(residents), requests_waiting=len(s.waiting),
            requests_paused=len(s.paused), requests_prefilling=prefilling,
            requests_decode_ready=len(residents) - prefilling - replaying,
            requests_replaying=replaying,
            requests_materializing=self._planned.materializing if self._planned is not None else 0,
            device_kv_used_pages=self.pool.used_count, device_kv_capacity_pages=self.pool.capacity,
            # A dense model has no StateImages: its lanes' slot bookkeeping is no occupancy.
            device_state_used_slots=self.slots.occupied if self.recurrent else 0,
            device_state_capacity_slots=self.slots.capacity if self.recurrent else 0,
            host_context_used_bytes=self.host.used,
            host_context_reserved_bytes=self._planned.host_reserved if self._planned is not None else 0,
            host_context_capacity_bytes=self.host.capacity, host_context_peak_bytes=self.host.peak,
            prefix_cache_nodes=self.cache.nodes if self.cache else 0,
            prefix_cache_evictions=self.cache.evictions if self.cache else 0,
            last_selection=c.last_selection,
            prompt_tokens_total=c.prompt_tokens, prompt_tokens_cached_total=c.prompt_tokens_cached,
            prefill_tokens_total=c.prefill_tokens, replayed_tokens_total=c.replayed_tokens,
            generation_tokens_total=c.generation_tokens, decode_tokens_total=c.decode_tokens,
            forced_tokens_total=c.forced_tokens, preemptions_total=c.preemptions,
            snapshot_restores_total=c.snapshot_restores, replay_restores_total=c.replay_restores,
            decode_rounds_total=c.decode_rounds, decode_row_rounds_total=c.decode_row_rounds,
            prefill_units_total=c.prefill_units, control_units_total=c.control_units,
            prefix_hits_total=c.prefix_hits,
            prefix_captures_total=c.prefix_captures, cow_copies_total=c.cow_copies,
            thinking_budget_applied_total=c.thinking_budget_applied,
            context_transfer_bytes_total=dict(c.transfer_bytes),
            state_image_operations_total=dict(c.state_ops),
            host_work_seconds_total=dict(c.host_work), device_wait_seconds_total=c.device_wait,
            work_class_seconds_total=self._work_classes(),
            stats_publication_seconds_total=c.stats_publication_seconds, stats_publications_total=c.stats_publications,
            requests_total=dict(c.requests), time_to_first_token_seconds=c.ttft.freeze(),
            request_duration_seconds=c.duration.freeze(), request_queue_seconds=c.queue.freeze(),
            monotonic=time.monotonic(),
        )


def _by_resource(transfers: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """{(resource, direction): bytes} as the JSON-ready {resource: {direction: bytes}}."""
    out: dict[str, dict[str, int]] = {}
    for (resource, direction), nbytes in transfers.items():
        out.setdefault(resource, {})[direction] = nbytes
    return out
