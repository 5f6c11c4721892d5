"""One request's state inside the Engine: tokens, pages, lane, budgets and its outbox.

Only the engine worker mutates a Sequence (the trio side reads ``outbox`` through the handle).
A sequence's known tokens are ``prompt + output``; ``computed`` positions have KV in ``pages``.
It needs prompt work while ``computed < frontier`` and decodes once that catches up.
"""

from __future__ import annotations

import collections
import enum
import threading
from typing import Any

from ninfer.backends.runner import SamplingRow
from ninfer.engine.request import GenerationRequest
from ninfer.engine.stats import HOST_PHASES, TRANSFERS


class Phase(enum.Enum):
    WAITING = "waiting"  # submitted, not admitted yet
    RESIDENT = "resident"  # holds a lane (prefilling, replaying or decoding)
    PAUSED = "paused"  # pushed out by KV pressure; keeps its committed output
    DONE = "done"


class Sequence:
    def __init__(self, rid: int, request: GenerationRequest, row: SamplingRow, stop_ids: frozenset[int],
                 limit: int, deadline: float, submitted: float, reserved: float | None = None) -> None:
        self.rid = rid  # arrival order: older requests have smaller ids
        self.request = request
        self.row = row
        self.stop_ids = stop_ids
        self.limit = limit  # longest sequence (prompt + output) this request may reach
        self.deadline = deadline  # admission deadline (monotonic seconds)
        # Admission and the pending deadline race between the worker and the request's task:
        # whoever flips its flag first under this lock wins.
        self._admission = threading.Lock()
        self.claimed = False
        self.expired = False
        self.phase = Phase.WAITING
        self.tokens: list[int] = list(request.prompt)
        self.prompt_len = len(request.prompt)
        self.computed = 0
        self.n_output = 0
        # Positions that must hold KV before the next decode (or before the first sample): the
        # prompt, then everything but the last committed token (the next decode input).
        self.frontier = self.prompt_len
        self.pages: list[int] = []
        self.lane: int | None = None
        self.locked: list[Any] = []  # prefix-cache nodes this sequence pins
        self.cached = 0  # reused prefix tokens at initial binding
        self.admitted_once = False
        self.cached_reported = False
        self.prompt_high = 0  # furthest prompt position ever computed (beyond it: fresh prefill)
        self.t_prompt_done: float | None = None
        self.transitions: list[Any] = []  # events.Transition records
        self.bypassed = 0  # later requests admitted ahead of this one
        # Thinking budget.
        self.in_thinking = request.thinking.starts_in_thinking
        self.thinking_count = 0
        self.in_control = False  # forced ids committed whose KV a control chunk still writes
        self.budget_applied = 0
        self.forced_total = 0
        # Pause state.
        self.snapshot: Any = None  # host copy of pages (and StateImage) when paused by snapshot
        self.snapshot_bytes = 0  # Host bytes it holds
        self.snapshot_pages = 0
        self.route: str | None = None  # "snapshot" or "replay": the latest pause cycle's
        self.paused_at = 0.0
        self.recovering = False  # paused since the last fresh committed unit (recovery_complete due)
        self.rebuild_to: int | None = None  # a replay restore rebuilds up to here (replay_complete due)
        # Captures still due: prompt boundaries (sorted) retained once computed reaches them.
        self.pending_captures: list[int] = []
        # Control from the request's task.
        self.accepted: int | None = None  # output tokens the consumer accepted before stop()
        # Outcome and events.
        self.finish: tuple[str, str] | None = None
        self.outbox: collections.deque = collections.deque()
        self.handle: Any = None  # the trio-side Handle (woken by the worker)
        self.error: BaseException | None = None
        # Observations (monotonic seconds) and counters.
        self.t_submit = submitted
        self.t_reserve = submitted if reserved is None else reserved  # preparation started
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.first_output: Any = None  # events.FirstOutputTiming
        self.t_last: float | None = None
        self.preemptions = 0
        self.snapshot_restores = 0
        self.replay_restores = 0
        self.replayed_tokens = 0
        self.paused_seconds = 0.0
        self.transfers = dict.fromkeys(TRANSFERS, 0)  # request-owned context copies, bytes
        self.host_seconds = 0.0
        self.host_phases = dict.fromkeys(HOST_PHASES, 0.0)  # host_seconds by worker phase
        self.decode_host_seconds = 0.0  # of host_seconds / device_seconds: the decode rounds'
        self.decode_device_seconds = 0.0
        self.device_seconds = 0.0
        self.gpu_intervals: list = []  # its prefill and replay units' stream intervals (StepResult)
        self.decode_rounds = 0
        self.prefill_units = 0
        self.control_units = 0

    def claim(self) -> bool:
        """Worker: reserve this request for admission unless its deadline already expired it."""
        with self._admission:
            if not self.expired:
                self.claimed = True
            return self.claimed

    def unclaim(self) -> None:
        with self._admission:
            self.claimed = False

    def expire(self) -> bool:
        """Either side: mark the request timed out unless admission already claimed it."""
        with self._admission:
            if not self.claimed:
                self.expired = True
            return self.expired

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def append(self, token: int) -> None:
        """Commit one output token (the only way ``tokens`` grows)."""
        self.tokens.append(token)
        self.n_output += 1
        self.frontier = len(self.tokens) - 1

    @property
    def needs_prompt_work(self) -> bool:
        return self.computed < self.frontier

    @property
    def replaying(self) -> bool:
        return self.needs_prompt_work and self.n_output > 0

    def decode_position(self) -> int:
        return len(self.tokens) - 1

    def __repr__(self) -> str:
        return f"<Sequence {self.rid} {self.phase.value} lane={self.lane} computed={self.computed}/{len(self.tokens)}>"
