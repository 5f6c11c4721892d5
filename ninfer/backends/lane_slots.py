"""Where each lane's recurrent state lives, so that a hybrid runner can pipeline decode.

A pipelined Engine launches the next decode step before it has read this step's tokens. A lane
whose request finishes on this step's token is then dropped from the step launched ahead, and the
Engine keeps that lane's state as it was after this step: it retains it as the request's endpoint
checkpoint, whose boundary is the tokens the request has computed. A step that updates the state in
place would have moved it one token past that boundary before anyone could keep it.

So each lane owns two StateImages, and a decode step reads one and writes the other. Until the
Engine collects the step (``finish_decode``), the image it read still holds the lane's state as of
the last collected step, which is what every StateImage operation of the Engine means by "the
lane's state". A dropped row's written image is simply never used: the lane is free, and binding
it again starts from a state written into whichever image the lane points at.

Slot numbers: the Engine's (``visible``) are those of a runner without pipelining, lanes first
(slot ``i`` = lane ``i``), then the checkpoint slots. Physical slots add one spare image a lane after
them: lane ``i`` alternates between ``i`` and ``visible + i``.
"""

from __future__ import annotations

import collections

import numpy as np


class LaneSlots:
    def __init__(self, lanes: int, extra: int):
        """``lanes``: the runner's max batch; ``extra``: its checkpoint slots."""
        self.lanes = lanes
        self.visible = lanes + extra
        self.physical = self.visible + lanes
        self._collected = np.arange(lanes, dtype=np.int64)  # a lane's image after its last collected step
        self._launched = self._collected.copy()  # ... after its last launched step
        self._flight: collections.deque = collections.deque()  # (lanes, images written) per launched step

    def slot(self, slot: int, field: str = "state slot") -> int:
        """The physical slot behind the Engine's ``slot`` (checked; ``field`` names it in the error):
        for a lane, its image as of its last collected decode step."""
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.visible:
            raise ValueError(f"{field} must be a state slot in [0, {self.visible}), got {slot!r}")
        return int(self._collected[slot]) if slot < self.lanes else int(slot)

    def writable(self, slot: int, field: str) -> int:
        """``slot(slot)``, about to be written: never a lane that a launched decode step still reads
        or writes (the Engine collects its steps before it binds a lane anew)."""
        physical = self.slot(slot, field)
        if slot < self.lanes and self.in_flight(int(slot)):
            raise RuntimeError(f"{field} {slot}: a decode step of that lane is in flight; finish_decode it first")
        return physical

    def launched_slot(self, lane: int) -> int:
        """``lane``'s image after its last launched decode step: what the next step continues."""
        return int(self._launched[lane])

    def in_flight(self, lane: int) -> bool:
        """Whether a launched decode step that writes ``lane``'s state is not collected yet."""
        return any(lane in lanes for lanes, _ in self._flight)

    def launch(self, lanes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A decode step of ``lanes`` (one row each, in order) is being launched: the physical slots
        each row reads (the lane's state after the steps launched so far) and writes (its other
        image), as int32 arrays."""
        lanes = np.asarray(lanes, dtype=np.int64).reshape(-1)
        read = self._launched[lanes]
        write = np.where(read == lanes, lanes + self.visible, lanes)
        self._launched[lanes] = write
        self._flight.append((lanes, write))
        return read.astype(np.int32), write.astype(np.int32)

    def collect(self) -> None:
        """The oldest launched step was collected: its rows' lanes now hold what it wrote."""
        lanes, write = self._flight.popleft()
        self._collected[lanes] = write


def check_continues(slots: LaneSlots, length: np.ndarray, lane: int, position: int, field: str,
                    launched: bool = False) -> None:
    """A chunk or a decode row of ``lane`` at ``position`` continues the lane's state: the image after
    its last collected step (``launched``: its last launched one, what a decode step reads), whose
    ``length`` (tokens summarised, a physical slot each) is ``position`` or unknown (-1)."""
    slot = slots.launched_slot(lane) if launched else slots.slot(lane)
    have = int(length[slot])
    if have >= 0 and have != position:
        raise ValueError(f"{field} {position}: lane {lane}'s recurrent state summarises {have} tokens; "
                         f"restore the state at {position} first (copy_state / write_state)")
