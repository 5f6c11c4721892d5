"""``LaneSlots``: which image holds each lane's recurrent state while decode steps are in flight."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.backends.lane_slots import LaneSlots, check_continues


def test_a_step_reads_one_image_and_writes_the_other():
    slots = LaneSlots(lanes=3, extra=2)  # Engine slots 0-4; spare images 5-7
    assert (slots.visible, slots.physical) == (5, 8)
    read, write = slots.launch(np.array([2, 0]))
    assert read.tolist() == [2, 0] and write.tolist() == [7, 5] and read.dtype == np.int32
    assert [slots.slot(lane) for lane in range(3)] == [0, 1, 2]  # nothing collected yet
    read, write = slots.launch(np.array([2, 0]))  # launched ahead: continues the step in flight
    assert read.tolist() == [7, 5] and write.tolist() == [2, 0]
    slots.collect()
    assert [slots.slot(lane) for lane in range(3)] == [5, 1, 7]
    assert slots.in_flight(0) and not slots.in_flight(1)
    slots.collect()
    assert [slots.slot(lane) for lane in range(3)] == [0, 1, 2] and not slots.in_flight(0)
    assert slots.slot(4) == 4  # a checkpoint slot is itself


def test_writing_a_lane_in_flight_is_refused_and_slots_are_checked():
    slots = LaneSlots(lanes=2, extra=1)
    slots.launch(np.array([1]))
    assert slots.writable(0, "copy_state dst") == 0 and slots.writable(2, "copy_state dst") == 2
    with pytest.raises(RuntimeError, match="write_state slot 1: a decode step of that lane is in flight"):
        slots.writable(1, "write_state slot")
    slots.collect()
    assert slots.writable(1, "write_state slot") == 4
    for bad in (3, -1, 1.0):
        with pytest.raises(ValueError, match=r"read_state slot must be a state slot in \[0, 3\)"):
            slots.slot(bad, "read_state slot")


def test_a_lane_continues_the_state_its_last_step_leaves():
    slots = LaneSlots(lanes=1, extra=0)
    length = np.array([5, -1])  # physical images: lane 0's, its spare
    check_continues(slots, length, 0, 5, "decode position")
    read, write = slots.launch(np.array([0]))
    length[write] = 6
    check_continues(slots, length, 0, 6, "decode position", launched=True)  # the step ahead
    with pytest.raises(ValueError, match="decode position 6: lane 0's recurrent state summarises 5 tokens"):
        check_continues(slots, length, 0, 6, "decode position")  # not collected yet
    length[:] = -1
    check_continues(slots, length, 0, 99, "prefill start")  # unknown lengths are trusted
