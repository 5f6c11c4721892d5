"""Device time of stream intervals, read from CUDA timing events (request_done.work.gpu_seconds).

A prefill call records one event before its first stream work and one after its last, and returns
an ``Interval``; the Engine adds a request's intervals up when it finishes. The work may still be
running when the call returns (a chunk that does not sample is not waited for), so the events are
read back later: each ``begin`` first collects the intervals whose end has passed, and keeps at most
``limit`` outstanding by waiting for the oldest, which bounds the events a caller that never asks
for ``seconds()`` (a test, a tool) leaves behind.
"""

from __future__ import annotations

import collections

from ninfer.backends.cuda import runtime as rt

cu = rt.cu


class Interval:
    """The device time between two events recorded on one stream."""

    __slots__ = ("_owner", "events", "value")

    def __init__(self, owner: StreamIntervals, events: tuple):
        self._owner = owner
        self.events: tuple | None = events  # None once read (the pair is reused)
        self.value: float | None = None

    def seconds(self) -> float | None:
        """Seconds on the device, waiting for the interval's end; None where the context failed."""
        if self.events is not None:
            self._owner.settle(self)
        return self.value


class StreamIntervals:
    def __init__(self, device: rt.Device, limit: int = 32):
        self.device = device
        self.limit = limit
        self._spare: list[tuple] = []  # event pairs free to record again
        self._open: collections.deque[Interval] = collections.deque()  # recorded, not read, oldest first

    def begin(self, stream) -> tuple:
        """Record an interval's start on ``stream``; ``end`` takes the pair this returns."""
        while self._open and (len(self._open) >= self.limit or self._ended(self._open[0])):
            self.settle(self._open[0])
        pair = self._spare.pop() if self._spare else (self.device.event(timing=True), self.device.event(timing=True))
        rt.check(cu.cuEventRecord(pair[0], stream), "cuEventRecord")
        return pair

    def end(self, pair: tuple, stream) -> Interval:
        rt.check(cu.cuEventRecord(pair[1], stream), "cuEventRecord")
        interval = Interval(self, pair)
        self._open.append(interval)
        return interval

    def settle(self, interval: Interval) -> None:
        """Read ``interval`` (waiting for its end) and free its events."""
        start, stop = interval.events
        self.device.make_current()
        try:
            rt.wait_event(stop)
            interval.value = rt.check(cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / 1e3
        except rt.CudaError:
            interval.value = None  # a failed context: the interval cannot be read (the runner reports why)
        interval.events = None
        self._open.remove(interval)
        self._spare.append((start, stop))

    def _ended(self, interval: Interval) -> bool:
        result = cu.cuEventQuery(interval.events[1])
        err = result[0] if isinstance(result, tuple) else result
        return err == cu.CUresult.CUDA_SUCCESS

    def close(self) -> None:
        """Destroy every event; an interval not read by now reads as None."""
        pairs = self._spare + [interval.events for interval in self._open]
        for interval in self._open:
            interval.events, interval.value = None, None
        for pair in pairs:
            for event in pair:
                rt.check(cu.cuEventDestroy(event), "cuEventDestroy")
        self._open.clear()
        self._spare = []
