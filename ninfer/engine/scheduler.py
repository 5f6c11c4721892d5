"""The scheduling policy: given sequences and pool occupancy, the plan of the next step.

Synchronous and deterministic, no device, trio or HTTP imports. Each step is one compact decode
batch of every decode-ready resident plus at most one prompt unit (a prefill or replay chunk of
the single prompt-work owner). Before the step, the pages its units need are reserved: first from
free pages, then by reclaiming unlocked retained prefixes, then by pausing the youngest residents —
never the oldest, so it always progresses. Freed lanes go to paused and waiting requests in
arrival order; a later request may pass one that does not fit at most ``MAX_BYPASS`` times.

The plan lists runner mechanism in execution order: snapshot reads of paused pages (and
StateImages), page copies (copy-on-write of a reused partial page), checkpoint StateImage copies
into lanes, spilled checkpoint images written into lanes, snapshot writes, lane binds, the prompt unit, decode.
Pages freed by a pause may be reused in the same plan because their reads come first.
"""

from __future__ import annotations

import collections
from typing import Callable

import attrs
import numpy as np

from ninfer.engine.config import EngineConfig
from ninfer.engine.context_cost import ContextCost
from ninfer.engine.pools import HostBudget, KVPool, StateSlots
from ninfer.engine.prefix_cache import EMPTY_MATCH, PrefixCache
from ninfer.engine.sequence import Phase, Sequence

MAX_BYPASS = 4


@attrs.define(slots=True)
class Pause:
    seq: Sequence
    route: str  # "snapshot" or "replay"
    pages: list[int]  # pages to read into the snapshot (snapshot route)
    lane: int | None = None  # lane whose StateImage the snapshot reads (recurrent models)


@attrs.define(slots=True)
class Restore:
    seq: Sequence
    pages: list[int]
    data: np.ndarray
    state: np.ndarray | None = None  # the lane's StateImage (recurrent models)


@attrs.define(slots=True)
class PromptUnit:
    seq: Sequence
    start: int
    end: int
    sample: bool
    replay: bool  # rebuilding committed tokens after a pause
    control: bool = False  # writing the KV of forced (not sampled) tokens
    result: np.ndarray | None = None  # sampled token (when ``sample``), set by execution


@attrs.define(slots=True)
class Plan:
    pauses: list[Pause] = attrs.Factory(list)
    copies: list[tuple[int, int, Sequence]] = attrs.Factory(list)  # (source page, copy, owner)
    state_copies: list[tuple[int, int]] = attrs.Factory(list)  # (checkpoint slot, lane): reuse
    # (lane, spilled checkpoint image, tokens it summarises): restore from the Host into the lane
    state_writes: list[tuple[int, np.ndarray, int]] = attrs.Factory(list)
    restores: list[Restore] = attrs.Factory(list)
    binds: list[tuple[int, list[int]]] = attrs.Factory(list)  # (lane, generated so far)
    admitted: list[Sequence] = attrs.Factory(list)  # bound this step (fresh or restored)
    prompt: PromptUnit | None = None
    decode: list[Sequence] = attrs.Factory(list)
    replays: list[Sequence] = attrs.Factory(list)  # restored by replay this step
    decode_result: np.ndarray | None = None  # one token per decode row, set by execution
    # A plan that collects the step the last one launched ahead: its rows, of which ``decode``
    # are those still resident (the others finished on the last step's token).
    launched: list[Sequence] | None = None

    @property
    def empty(self) -> bool:
        return (self.prompt is None and not self.decode and not self.restores and not self.pauses
                and self.launched is None)

    @property
    def host_reserved(self) -> int:
        """Host bytes reserved for this plan's snapshot reads (already in the Host budget's use)."""
        return sum(p.seq.snapshot_bytes for p in self.pauses if p.route == "snapshot")

    @property
    def materializing(self) -> int:
        """Sequences whose context this plan copies into the device: a snapshot restore, a
        checkpoint StateImage (from a slot or the Host) or the tail-page copy of a reused prefix."""
        lanes = {lane for _, lane in self.state_copies} | {lane for lane, _, _ in self.state_writes}
        return len({r.seq.rid for r in self.restores} | {seq.rid for _, _, seq in self.copies}
                   | {s.rid for s in self.admitted if s.lane in lanes})


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, slots: StateSlots, host: HostBudget,
                 cache: PrefixCache | None, cost: ContextCost, page_bytes: int,
                 clock: Callable[[], float], state_bytes: int = 0) -> None:
        self.config = config
        # A recurrent (hybrid) model: each lane holds a StateImage of ``state_bytes``, reuse
        # lands only on checkpoints, and prompt chunks end exactly on capture boundaries.
        self.recurrent = state_bytes > 0
        self.state_bytes = state_bytes
        self.ps = config.page_size
        self.pool, self.slots, self.host, self.cache = pool, slots, host, cache
        self.cost = cost
        self.page_bytes = page_bytes
        self.clock = clock
        self.lanes: list[Sequence | None] = [None] * config.max_concurrency
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.paused: list[Sequence] = []  # ordered by rid
        self.owner: Sequence | None = None  # the one sequence doing prompt work
        # Observation hook for pause/restore boundaries (the core records them with counters).
        self.on_transition: Callable[[Sequence, str, str | None], None] = lambda seq, kind, route: None

    # -- queues ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def residents(self) -> list[Sequence]:
        return sorted((s for s in self.lanes if s is not None), key=_rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.paused or any(s is not None for s in self.lanes))

    def release(self, seq: Sequence) -> None:
        """Return everything ``seq`` holds (it finished, failed or was cancelled)."""
        if seq.phase is Phase.WAITING:
            if seq in self.waiting:  # a submission the worker never took is not queued
                self.waiting.remove(seq)
        elif seq.phase is Phase.PAUSED:
            self.paused.remove(seq)
            self._drop_snapshot(seq)
        elif seq.phase is Phase.RESIDENT:
            self._unbind(seq)
            self.pool.decref(seq.pages)
            seq.pages = []
        seq.phase = Phase.DONE

    def capture(self, seq: Sequence, length: int, session: bool = False) -> list:
        """Retain ``seq``'s first ``length`` tokens (their KV is computed) in the prefix cache;
        return the retained path (empty when nothing was retained)."""
        if self.cache is None or length <= 0:
            return []
        assert length <= seq.computed
        path = self.cache.insert(seq.tokens, seq.pages, length)
        self.cache.lock(path)
        seq.locked.extend(path)
        if session and seq.request.session_key is not None:
            self.cache.set_session(seq.request.session_key, path[-1])
        return path

    # -- the step -------------------------------------------------------------------------

    def schedule(self) -> Plan:
        plan = Plan()
        if self.owner is not None and not self.owner.needs_prompt_work:
            self.owner = None  # its prompt (or replay) finished last step: it decodes now
        self._reserve_residents(plan)
        if self.waiting or self.paused:
            self._admit(plan)
        residents = self.residents()
        unit = self._control_unit(plan, residents) or self.owner
        if unit is not None:
            end = self._chunk_end(unit, unit.computed)
            self._ensure_pages(unit, end)
            sample = unit.n_output == 0 and end == unit.prompt_len and unit.request.max_tokens > 0
            control = unit.n_output > 0 and unit.in_control
            plan.prompt = PromptUnit(unit, unit.computed, end, sample,
                                     replay=unit.n_output > 0 and not control, control=control)
        for seq in residents:
            if seq.computed == seq.frontier:
                self._ensure_pages(seq, seq.computed + 1)
                plan.decode.append(seq)
        return plan

    def decode_ahead(self, rows: list[Sequence]) -> bool:
        """Whether the decode step after this one (``rows`` one position on) may be launched before
        this step's tokens are known, on a runner that pipelines decode; if so, its pages are
        reserved now.

        Only where that step is certainly the next plan, up to rows that finish on this step's
        token (dropped when it is collected): nobody waits or is paused, nobody has prompt work,
        every resident decodes here, and no row can reach a length limit or its thinking budget
        with this token (each of those changes what the next step does)."""
        if self.waiting or self.paused or self.owner is not None:
            return False
        if sum(s is not None for s in self.lanes) != len(rows):
            return False
        need = 0
        for seq in rows:
            budget = seq.request.thinking.budget
            if (seq.n_output + 1 >= seq.request.max_tokens or len(seq.tokens) + 1 >= seq.limit
                    or (seq.in_thinking and budget is not None and seq.thinking_count + 1 >= budget)):
                return False
            need += self._deficit(seq, seq.computed + 2)
        if need and not self._make_room(need):
            return False
        for seq in rows:
            self._ensure_pages(seq, seq.computed + 2)
        return True

    def _control_unit(self, plan: Plan, residents: list[Sequence]) -> Sequence | None:
        """A resident whose committed tokens outran its KV (a forced thinking-close suffix) needs
        one control chunk. When it is older than the prompt-work owner it runs first — the owner
        skips one step — so the oldest resident keeps progressing. Its penalty counts are
        rebound to include the suffix (prefill does not count tokens)."""
        owner = self.owner
        for seq in residents:
            if owner is not None and seq.rid > owner.rid:
                return None
            if seq.in_control and seq.needs_prompt_work:
                plan.binds.append((seq.lane, seq.output[:-1]))
                return seq
        return None

    def _unit_end(self, seq: Sequence) -> int:
        """Positions covered once ``seq``'s next unit ran."""
        if seq.needs_prompt_work:
            return self._chunk_end(seq, seq.computed)
        return seq.computed + 1

    def _chunk_end(self, seq: Sequence, start: int) -> int:
        """End of the prompt chunk that starts at ``start``. A recurrent model's state can be
        kept only where a chunk ends, so its chunks also end on every capture boundary."""
        end = min(start + self.config.prefill_chunk, seq.frontier)
        if self.recurrent:
            for b in seq.pending_captures:
                if start < b:
                    return min(b, end)
        return end

    def _deficit(self, seq: Sequence, end: int, have: int | None = None) -> int:
        have = len(seq.pages) if have is None else have
        return max(0, -(-end // self.ps) - have)

    def _ensure_pages(self, seq: Sequence, end: int) -> None:
        n = self._deficit(seq, end)
        if n:
            seq.pages.extend(self.pool.alloc(n))

    def _make_room(self, need: int) -> bool:
        short = need - self.pool.free_count
        # Evict only when that makes room: a refused admission must not empty the prefix cache.
        if short > 0 and self.cache is not None:
            self.cache.reclaim(short, all_or_none=True)
        return need <= self.pool.free_count

    def _reserve_residents(self, plan: Plan) -> None:
        """Reserve the pages every resident's next unit needs, before any admission."""
        residents = self.residents()
        if not residents:
            return
        ps = self.ps
        need, total = [], 0
        for s in residents:
            n = max(0, -(-self._unit_end(s) // ps) - len(s.pages))
            need.append(n)
            total += n
        if total and not self._make_room(total):
            # Residents cannot advance together: pause the youngest until the rest fit.
            while len(residents) > 1:
                total -= need.pop()
                self._pause(residents.pop(), plan)
                if self._make_room(total):
                    break
            if not self._make_room(total) and self.cache is not None:
                # Alone, the oldest resident may still be short because it locks retained nodes
                # whose pages it does not use (another request computed them): drop those too.
                self.cache.reclaim(total - self.pool.free_count, force=True)
            # The pool holds one sequence at the ceiling, and every page no resident uses is
            # free now, so this holds by construction.
            assert total <= self.pool.free_count, "the oldest resident cannot advance: KV pool smaller than one sequence"
        if total:
            for seq, n in zip(residents, need):
                if n:
                    seq.pages.extend(self.pool.alloc(n))

    # -- pause and restore ----------------------------------------------------------------

    def _pause(self, seq: Sequence, plan: Plan) -> None:
        seq.preemptions += 1
        seq.recovering = True
        self.on_transition(seq, "pause_started", None)
        # A snapshot keeps the pages and, for a recurrent model, the lane's StateImage (which
        # summarises exactly ``computed`` tokens).
        nbytes = len(seq.pages) * self.page_bytes + self.state_bytes
        route = "replay"
        if (seq.computed > 0 and self.cost.prefer_snapshot(nbytes, seq.computed)
                and self._host_room(nbytes)):
            route = "snapshot"
            seq.snapshot_bytes = nbytes
            seq.snapshot_pages = len(seq.pages)
            plan.pauses.append(Pause(seq, route, list(seq.pages), seq.lane if self.recurrent else None))
        else:
            plan.pauses.append(Pause(seq, route, []))
            # The frontier a replay must rebuild before fresh work: committed tokens, or the prompt
            # positions computed so far.
            seq.rebuild_to = seq.frontier if seq.n_output else seq.prompt_high
            seq.computed = 0
            seq.in_control = False  # everything past the prompt is now replay work
        seq.route = route
        self._unbind(seq)
        self.pool.decref(seq.pages)
        seq.pages = []
        seq.phase = Phase.PAUSED
        seq.paused_at = self.clock()
        self._insert_paused(seq)

    def _host_room(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` of Host budget, dropping spilled checkpoints if they are in the way."""
        if self.host.try_reserve(nbytes):
            return True
        if self.cache is None or self.host.used - self.cache.spilled * self.state_bytes + nbytes > self.host.capacity:
            return False  # even without spilled checkpoints it would not fit: keep them
        self.cache.free_host(nbytes)
        return self.host.try_reserve(nbytes)

    def _insert_paused(self, seq: Sequence) -> None:
        i = len(self.paused)
        while i > 0 and self.paused[i - 1].rid > seq.rid:
            i -= 1
        self.paused.insert(i, seq)

    def _drop_snapshot(self, seq: Sequence) -> None:
        if seq.snapshot_bytes:
            self.host.release(seq.snapshot_bytes)
        seq.snapshot, seq.snapshot_bytes = None, 0

    def _unbind(self, seq: Sequence) -> None:
        if seq.lane is not None:
            self.lanes[seq.lane] = None
            seq.lane = None
            self.slots.release()
        if self.owner is seq:
            self.owner = None
        if seq.locked and self.cache is not None:
            self.cache.unlock(seq.locked)
        seq.locked = []

    # -- admission ------------------------------------------------------------------------

    def _admit(self, plan: Plan) -> None:
        # A request paused by this very plan waits at least one step: its snapshot is read by
        # this plan's execution, and re-admitting it now would undo the room just made.
        just_paused = {p.seq.rid for p in plan.pauses}
        candidates = sorted([*self.paused, *self.waiting], key=_rid)
        passed: list[Sequence] = []  # waiting requests a later one went past
        restores_held = False  # an older paused request could not restore: restoration keeps request order
        for seq in candidates:
            paused = seq.phase is Phase.PAUSED
            if seq.rid in just_paused:
                restores_held = True
                continue
            if paused and restores_held:
                continue
            if None not in self.lanes:
                return
            if self._try_bind(seq, plan):
                for earlier in passed:
                    earlier.bypassed += 1
                if any(earlier.bypassed >= MAX_BYPASS for earlier in passed):
                    return  # its allowance is spent: nobody else passes it, in this step either
                continue
            if paused:  # it does not hold back fresh requests that fit (spec: Execution behavior)
                restores_held = True
            elif seq.bypassed >= MAX_BYPASS:
                return  # nobody may pass it any more
            else:
                passed.append(seq)

    def _try_bind(self, seq: Sequence, plan: Plan) -> bool:
        if seq.phase is Phase.PAUSED and seq.route == "snapshot" and seq.snapshot is not None:
            return self._restore_snapshot(seq, plan)
        if self.owner is not None:
            return False  # one prompt-work owner at a time
        fresh = seq.phase is Phase.WAITING
        if fresh and not seq.claim():
            return False  # its deadline passed: the worker drops it at the next boundary
        match = EMPTY_MATCH
        if self.cache is not None:
            # Without output yet, at least one prompt token must run: its unit samples the first
            # token (or finishes a max_tokens=0 request). With output, the frontier excludes the
            # last committed token, which the next decode feeds.
            limit = seq.prompt_len - 1 if seq.n_output == 0 else seq.frontier
            if self.recurrent:
                match = self.cache.match_checkpoint(seq.tokens, limit)
            else:
                match = self.cache.match(seq.tokens, limit)
        shared = match.length // self.ps
        # Lock the fully shared nodes while room is made: reclaiming one would free a page the
        # sequence is about to share. A partial node's page is only the source of a copy, which
        # runs before any page is written and reads its sources before writing, so reclaiming
        # it (even into this sequence's own pages) is harmless; keeping it locked could leave a
        # lone request short of pages in a pool that holds exactly one sequence.
        held = match.nodes[:shared]
        if self.cache is not None:
            self.cache.lock(held)
        # A replay rebuilds its saved frontier, then one new unit: with output, the decode of the
        # next position; without, the prompt's last chunk (its sample's KV is the next decode's,
        # reserved then), so a max_tokens=0 prompt that fills the ceiling still fits the pool.
        end = self._chunk_end(seq, match.length) if fresh else seq.frontier + (1 if seq.n_output else 0)
        need = -(-end // self.ps) - shared
        if not self._make_room(need):
            if self.cache is not None:
                self.cache.unlock(held)
            if fresh:
                seq.unclaim()
            return False
        seq.pages = list(match.pages[:shared])
        self.pool.incref(seq.pages)
        seq.locked = list(held)
        if match.length % self.ps:
            # The match ends inside a retained page: write past it in a private copy.
            cow = self.pool.alloc(1)[0]
            plan.copies.append((match.pages[shared], cow, seq))
            seq.pages.append(cow)
        seq.computed = match.length
        self._ensure_pages(seq, end)
        if fresh:
            self.waiting.remove(seq)
            seq.cached = match.length
            seq.t_admit = self.clock()
            seq.admitted_once = True
        else:
            self.paused.remove(seq)
            seq.replay_restores += 1
            plan.replays.append(seq)
            seq.paused_seconds += self.clock() - seq.paused_at
        self._bind(seq, plan)
        if match.state is not None:
            plan.state_copies.append((match.state, seq.lane))
        elif match.image is not None:
            plan.state_writes.append((seq.lane, match.image, match.length))
        if seq.needs_prompt_work:
            self.owner = seq
        return True

    def _restore_snapshot(self, seq: Sequence, plan: Plan) -> bool:
        n_snap = seq.snapshot_pages
        if seq.needs_prompt_work and self.owner is not None:
            return False
        end = self._unit_end(seq)
        if not self._make_room(max(n_snap, -(-end // self.ps))):
            return False
        seq.pages = self.pool.alloc(n_snap)
        pages, state = seq.snapshot if self.recurrent else (seq.snapshot, None)
        plan.restores.append(Restore(seq, list(seq.pages), pages, state))
        self._ensure_pages(seq, end)
        self._drop_snapshot(seq)
        self.paused.remove(seq)
        seq.snapshot_restores += 1
        seq.paused_seconds += self.clock() - seq.paused_at
        self._bind(seq, plan)
        if seq.needs_prompt_work:
            self.owner = seq
        return True

    def _bind(self, seq: Sequence, plan: Plan) -> None:
        lane = self.lanes.index(None)
        self.lanes[lane] = seq
        seq.lane = lane
        self.slots.acquire()
        if seq.preemptions:
            self.on_transition(seq, "restore_started", seq.route)  # the runner ends it: "restored"
        seq.phase = Phase.RESIDENT
        # The last committed token is the next decode input, which the runner counts itself.
        plan.binds.append((lane, seq.output[:-1]))
        plan.admitted.append(seq)


def _rid(seq: Sequence) -> int:
    return seq.rid
