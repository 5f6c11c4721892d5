"""HostArena's allocator on the CPU: a fake device whose pinned memory is an ordinary NumPy buffer
(the GPU side, arrays of a real pinned arena through the runners: tests/cuda/test_cuda_runner.py)."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from ninfer.backends.cuda.host_arena import ALIGN, HostArena


class PinnedAsNumpy:
    """``Device.pinned`` without a GPU; odd-offset buffers check that the arena aligns its blocks."""

    def __init__(self, misalign: int = 0):
        self.misalign = misalign

    def pinned(self, nbytes):
        buffer = np.zeros(nbytes + ALIGN + self.misalign, np.uint8)
        start = -buffer.ctypes.data % ALIGN + self.misalign  # page-aligned, as cuMemHostAlloc's, then offset
        return buffer[start:start + nbytes]


def _arena(nbytes=16 * ALIGN, misalign=0) -> HostArena:
    return HostArena(PinnedAsNumpy(misalign), nbytes)


def _span(a: np.ndarray) -> tuple[int, int]:
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes


@pytest.mark.parametrize("misalign", [0, 3, 100])
def test_arrays_are_aligned_in_the_slab_and_disjoint(misalign):
    arena = _arena(misalign=misalign)
    arrays = [arena.array((n,), np.float32) for n in (1, 64, 65, 7)] + [arena.array((2, 3, 5), np.uint16)]
    assert arena.fallbacks == 0
    for i, a in enumerate(arrays):
        assert a.flags.c_contiguous and a.flags.writeable and arena.contains(a)
        assert a.__array_interface__["data"][0] % ALIGN == 0
        a[...] = i + 1
    assert arrays[-1].shape == (2, 3, 5) and arrays[-1].dtype == np.uint16
    spans = sorted(_span(a) for a in arrays)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for i, a in enumerate(arrays):  # no write reached another array
        assert (a == i + 1).all()
    # Sizes round up to ALIGN: 256 + 256 + 512 + 256 + 256 bytes.
    assert arena.used == 6 * ALIGN and arena.blocks == 5
    assert arena.capacity == (16 * ALIGN if misalign == 0 else 15 * ALIGN)


def test_a_block_returns_when_its_last_view_is_collected():
    arena = _arena()
    a = arena.array((ALIGN // 4,), np.float32)
    start = _span(a)[0]
    view = a.reshape(2, -1)[1:].T  # NumPy collapses this view's .base past `a`: the block owner holds
    del a
    gc.collect()
    assert arena.used == ALIGN and arena.blocks == 1
    b = arena.array((ALIGN,), np.uint8)
    assert _span(b)[0] != start  # the view still owns its block
    del view
    gc.collect()
    assert arena.used == ALIGN
    c = arena.array((ALIGN,), np.uint8)
    assert _span(c)[0] == start  # first fit: the freed block at the front is reused
    del b, c
    gc.collect()
    assert arena.used == 0 and arena.blocks == 0 and arena.free_blocks == [(0, 16 * ALIGN)]


def test_copies_hold_no_block():
    arena = _arena()
    a = arena.array((10,), np.int64)
    a[:] = 7
    copy = a.copy()
    del a
    gc.collect()
    assert arena.used == 0 and not arena.contains(copy) and (copy == 7).all()


def test_freed_neighbours_coalesce():
    arena = _arena(nbytes=4 * ALIGN)
    first, middle, last = (arena.array((ALIGN,), np.uint8) for _ in range(3))
    tail = arena.array((ALIGN,), np.uint8)
    assert arena.free_blocks == []
    del first, last
    gc.collect()
    assert arena.free_blocks == [(0, ALIGN), (2 * ALIGN, ALIGN)]
    del middle
    gc.collect()
    assert arena.free_blocks == [(0, 3 * ALIGN)]  # merged with both neighbours
    whole = arena.array((3 * ALIGN,), np.uint8)  # fits only if the three merged
    assert arena.contains(whole) and arena.fallbacks == 0
    del whole, tail
    gc.collect()
    assert arena.free_blocks == [(0, 4 * ALIGN)]


def test_first_fit_takes_the_lowest_hole_that_fits():
    arena = _arena(nbytes=8 * ALIGN)
    blocks = [arena.array((ALIGN,), np.uint8) for _ in range(2)] + [arena.array((3 * ALIGN,), np.uint8)]
    blocks.append(arena.array((ALIGN,), np.uint8))
    del blocks[2]  # a 3-unit hole at offset 2, then the 2 free units at the end
    gc.collect()
    assert arena.free_blocks == [(2 * ALIGN, 3 * ALIGN), (6 * ALIGN, 2 * ALIGN)]
    small = arena.array((2 * ALIGN,), np.uint8)
    assert _span(small)[0] - arena.addr == 2 * ALIGN
    assert arena.free_blocks == [(4 * ALIGN, ALIGN), (6 * ALIGN, 2 * ALIGN)]


def test_a_full_arena_falls_back_to_pageable_memory_and_counts_it():
    arena = _arena(nbytes=4 * ALIGN)
    held = arena.array((3 * ALIGN,), np.uint8)
    extra = arena.array((2 * ALIGN,), np.uint8)  # only one unit left
    assert not arena.contains(extra) and extra.shape == (2 * ALIGN,)
    assert arena.fallbacks == 1 and arena.fallback_bytes == 2 * ALIGN
    extra[:] = 1  # ordinary memory, usable as any array
    fits = arena.array((ALIGN,), np.uint8)
    assert arena.contains(fits) and arena.fallbacks == 1
    del extra
    gc.collect()
    assert arena.used == 4 * ALIGN  # the fallback never held arena memory
    assert not arena.contains(held[::2]) and arena.contains(held[ALIGN:])  # contiguous views only


def test_empty_and_oversized_requests_never_fail():
    arena = _arena(nbytes=2 * ALIGN)
    assert arena.array((0, 5), np.float32).shape == (0, 5) and arena.fallbacks == 0
    big = arena.array((10 * ALIGN,), np.uint8)
    assert big.nbytes == 10 * ALIGN and not arena.contains(big) and arena.fallbacks == 1
    assert HostArena(PinnedAsNumpy(), 0).array(4, np.int32).shape == (4,)  # no capacity at all: pageable


def test_a_finalizer_never_waits_for_the_lock():
    """A collection may start inside ``array`` (lock held, same thread) or on another thread: the block
    is queued, and taken back at the next call."""
    arena = _arena(nbytes=2 * ALIGN)
    a = arena.array((2 * ALIGN,), np.uint8)
    with arena._lock:
        del a  # its finalizer runs here, on the thread holding the lock
        gc.collect()
        assert len(arena._returned) == 1  # queued, not merged
    assert arena.contains(arena.array((2 * ALIGN,), np.uint8))  # the queued block was merged first
    gc.collect()

    arrays = [arena.array((ALIGN,), np.uint8) for _ in range(2)]
    done = threading.Event()

    def drop():
        arrays.clear()
        gc.collect()
        done.set()

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join(5)
    assert done.is_set() and arena.used == 0 and arena.free_blocks == [(0, 2 * ALIGN)]


# -- the runners' Host paths, over a device pool in host memory ---------------------------------

POOL_BASE = 1 << 40


class FakePool:
    """The runner's device copies over a NumPy "device memory", recording where each host end lay.
    The driver reads ``nbytes`` from the host address: a copy from a non-contiguous array is a bug."""

    def __init__(self, nbytes: int):
        self.mem = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
        self.hosts: list[np.ndarray] = []

    def d2h(self, dst, src, stream):
        assert dst.flags.c_contiguous and dst.nbytes <= src.nbytes
        self.hosts.append(dst)
        dst.reshape(-1).view(np.uint8)[:] = self.mem[src.addr - POOL_BASE:][:dst.nbytes]

    def h2d(self, dst, src, stream):
        assert src.flags.c_contiguous and src.nbytes <= dst.nbytes
        self.hosts.append(src)
        self.mem[dst.addr - POOL_BASE:][:src.nbytes] = src.reshape(-1).view(np.uint8)


class FakeDevice(PinnedAsNumpy):
    def make_current(self):
        pass


LAYERS, KV_HEADS, PAGE, HEAD_DIM, PAGES, FLOATS, SLOTS = 3, 2, 4, 8, 10, 40, 3
IMAGES = SLOTS + 1  # one lane: its spare image (ninfer/backends/lane_slots.py) follows the slots


@pytest.fixture
def cuda_runner(monkeypatch):
    """``make(hybrid, arena_bytes)``: a CudaRunner (or CudaHybridRunner) with only what its page and
    state copies touch, and the FakePool its copies go to."""
    runner_mod = pytest.importorskip("ninfer.backends.cuda.runner")
    from types import SimpleNamespace

    from ninfer.backends.cuda import runtime as rt
    from ninfer.backends.cuda.hybrid_runner import CudaHybridRunner
    from ninfer.backends.cuda.hybrid_state import DeviceStates
    from ninfer.backends.lane_slots import LaneSlots

    page_elems = LAYERS * 2 * KV_HEADS * PAGE * HEAD_DIM
    pool = FakePool(PAGES * page_elems * 2 + IMAGES * FLOATS * 4)
    monkeypatch.setattr(rt, "copy_d2h", pool.d2h)
    monkeypatch.setattr(rt, "copy_h2d", pool.h2d)
    monkeypatch.setattr(rt, "synchronize", lambda stream: None)

    def make(hybrid: bool, arena_bytes: int):
        runner = (CudaHybridRunner if hybrid else runner_mod.CudaRunner).__new__(
            CudaHybridRunner if hybrid else runner_mod.CudaRunner)
        device = FakeDevice()
        config = SimpleNamespace(num_layers=LAYERS + 2 if hybrid else LAYERS, num_kv_heads=KV_HEADS,
                                 head_dim=HEAD_DIM, state_floats=FLOATS, state_floats_per_layer=FLOATS)
        kv = rt.DevicePtr(POOL_BASE, PAGES * page_elems * 2, "kv")
        states = rt.DevicePtr(POOL_BASE + kv.nbytes, IMAGES * FLOATS * 4, "states")
        runner.config, runner.device, runner.stream, runner.fault = config, device, None, None
        runner.kv_dtype, runner.startup, runner.host_arena = "bf16", {}, None
        runner.info = SimpleNamespace(num_pages=PAGES, page_size=PAGE)
        runner.buffers = SimpleNamespace(page_elems=page_elems, kv_itemsize=2, kv=kv, kv_layers=LAYERS)
        if hybrid:
            runner.lane_slots = LaneSlots(1, SLOTS - 1)
            runner.buffers.state_slots = DeviceStates(device, states, config, runner.lane_slots.physical)
        runner._page_staging = device.pinned(page_elems * 2)
        runner.attach_host_arena(arena_bytes)
        return runner

    make.pool = pool
    return make


def _pool_pages(pool: FakePool, pages) -> np.ndarray:
    """The reference layout of ``pages``, straight from the fake pool's bytes."""
    kv = pool.mem[:PAGES * LAYERS * 2 * KV_HEADS * PAGE * HEAD_DIM * 2].view(np.uint16)
    return kv.reshape(PAGES, LAYERS, 2, KV_HEADS, PAGE, HEAD_DIM)[pages].transpose(2, 1, 0, 4, 3, 5)


@pytest.mark.parametrize("hybrid", [False, True])
def test_runner_pages_go_straight_to_and_from_the_arena(cuda_runner, hybrid, caplog):
    runner = cuda_runner(hybrid, arena_bytes=3 * 2 * LAYERS * 2 * KV_HEADS * PAGE * HEAD_DIM)  # 3 pages
    arena, pool = runner.host_arena, cuda_runner.pool
    assert runner.startup["host_arena_bytes"] == arena.nbytes and runner.host_arena_fallbacks == 0
    snapshot = runner.read_pages([5, 2])
    assert snapshot.shape == (2, LAYERS, 2, PAGE, KV_HEADS, HEAD_DIM) and snapshot.dtype == np.uint16
    assert np.array_equal(snapshot, _pool_pages(pool, [5, 2]))
    assert all(arena.contains(h) for h in pool.hosts)  # one DMA a page, into the arena
    assert arena.contains(snapshot.transpose(2, 1, 0, 4, 3, 5))  # pool order in memory: a view of it

    pool.hosts.clear()
    runner.write_pages([0, 9], snapshot)
    assert all(arena.contains(h) for h in pool.hosts) and len(pool.hosts) == 2  # straight from the arena
    assert np.array_equal(_pool_pages(pool, [0, 9]), snapshot)

    # A pageable array (the reference's layout, contiguous) goes through staging, bit-exact too.
    pool.hosts.clear()
    runner.write_pages([1, 3], np.ascontiguousarray(snapshot[:, :, ::-1]))
    assert not any(arena.contains(h) for h in pool.hosts)
    assert np.array_equal(_pool_pages(pool, [3, 1]), snapshot)

    # No room for two more pages: pageable through staging, the same values, counted and logged.
    with caplog.at_level("WARNING", logger="ninfer.cuda"):
        more = runner.read_pages([5, 2])
    assert runner.host_arena_fallbacks == 1 and more.flags.c_contiguous and np.array_equal(more, snapshot)
    assert any("Host arena full" in r.getMessage() for r in caplog.records)
    del snapshot, more
    gc.collect()
    assert arena.used == 0

    runner.attach_host_arena(0)  # no arena: today's contiguous pageable arrays
    assert runner.host_arena is None and runner.read_pages([5]).flags.c_contiguous


def test_hybrid_state_images_go_straight_to_and_from_the_arena(cuda_runner):
    runner = cuda_runner(True, arena_bytes=1 << 16)
    arena, pool = runner.host_arena, cuda_runner.pool
    image = runner.read_state(1)
    assert image.shape == (FLOATS,) and image.dtype == np.float32 and arena.contains(image)
    assert np.array_equal(image.view(np.uint8), pool.mem[-(IMAGES - 1) * FLOATS * 4:][:FLOATS * 4])
    pool.hosts.clear()
    runner.write_state(2, image, length=12)
    assert len(pool.hosts) == 1 and pool.hosts[0] is image  # no staging copy
    assert np.array_equal(runner.read_state(2), image) and runner.state_length(2) == 12
    runner.write_state(0, image.copy())  # pageable: through staging
    assert not arena.contains(pool.hosts[-1]) and np.array_equal(runner.read_state(0), image)
    assert runner.state_length(0) == -1
    with pytest.raises(ValueError, match="write_state data must be float32"):
        runner.write_state(0, image[:-1])
    with pytest.raises(ValueError, match="read_state slot"):
        runner.read_state(SLOTS)


def test_the_server_pins_the_engine_host_budget():
    from ninfer.engine import EngineConfig
    from ninfer.server.backend import host_arena

    assert host_arena(EngineConfig()) == {"host_arena_bytes": 8 << 30, "host_arena_state_images": 8}
    assert host_arena(EngineConfig(host_context_mib=16)) == {"host_arena_bytes": 16 << 20,
                                                             "host_arena_state_images": 0}
    assert host_arena(EngineConfig(host_context_mib=0))["host_arena_bytes"] == 0  # no Host backing, no arena


def test_a_host_backing_that_cannot_be_pinned_stays_pageable(cuda_runner, monkeypatch, caplog):
    from ninfer.backends.cuda import runtime as rt

    runner = cuda_runner(False, arena_bytes=0)

    def refuse(nbytes):
        raise rt.CudaError("cuMemHostAlloc", 2)  # CUDA_ERROR_OUT_OF_MEMORY: not sticky

    monkeypatch.setattr(runner.device, "pinned", refuse)
    with caplog.at_level("WARNING", logger="ninfer.cuda"):
        runner.attach_host_arena(1 << 20)
    assert runner.host_arena is None and runner.startup["host_arena_bytes"] == 0
    assert "CUDA_ERROR_OUT_OF_MEMORY" in runner.startup["host_arena_error"]
    assert any("pageable memory" in r.getMessage() for r in caplog.records)
    assert runner.read_pages([1]).flags.c_contiguous  # snapshots still work, through staging
