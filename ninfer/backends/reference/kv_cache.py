"""The paged KV pool of the reference backend.

K and V are float32 ``[num_layers, num_pages, page_size, kv_heads, head_dim]``. Token ``t`` of a
sequence lives in page ``page_table[t // page_size]`` at offset ``t % page_size``. The engine decides
which pages a sequence owns; this pool only writes and gathers the slots it is told to.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class PagedKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int):
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k = np.zeros(shape, dtype=np.float32)
        self.v = np.zeros(shape, dtype=np.float32)
        self.page_size = page_size
        self.num_pages = num_pages
        # The same memory seen as [layers, num_pages * page_size, kv_heads, head_dim]: one flat
        # slot index per token makes writes and gathers a single indexing operation.
        self._k_flat = self.k.reshape(num_layers, num_pages * page_size, kv_heads, head_dim)
        self._v_flat = self.v.reshape(num_layers, num_pages * page_size, kv_heads, head_dim)

    def token_slots(self, page_tables: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Flat slot (``page * page_size + offset``) of ``positions[i]`` in sequence ``rows[i]``."""
        return page_tables[rows, positions // self.page_size] * self.page_size + positions % self.page_size

    def context_index(self, page_tables: np.ndarray, length: int) -> np.ndarray | slice:
        """Where positions ``[0, length)`` of each sequence live: flat slots [S, length], or a
        slice when there is one sequence on ascending pages (the usual single-request case), which
        reads the pool as a view instead of a copy.

        Sequences shorter than ``length`` must mask their tail: unused page-table entries (-1)
        read page 0, whatever it holds.
        """
        n_pages = -(-length // self.page_size)
        table = page_tables[:, :n_pages]
        if table.shape[0] == 1 and table[0, 0] >= 0 and (n_pages == 1 or bool(np.all(np.diff(table[0]) == 1))):
            first = int(table[0, 0]) * self.page_size
            return slice(first, first + length)
        offsets = np.arange(length)
        return np.maximum(table, 0)[:, offsets // self.page_size] * self.page_size + offsets % self.page_size

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k``/``v`` [rows, kv_heads, head_dim] at flat ``slots`` [rows]."""
        self._k_flat[layer, slots] = k
        self._v_flat[layer, slots] = v

    def gather(self, layer: int, index: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray]:
        """K and V [S, length, kv_heads, head_dim] at a ``context_index``."""
        if isinstance(index, slice):
            return self._k_flat[layer, None, index], self._v_flat[layer, None, index]
        return self._k_flat[layer][index], self._v_flat[layer][index]

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        src_i, dst_i = self._pages(src, "copy_pages src"), self._pages(dst, "copy_pages dst")
        if len(src_i) != len(dst_i):
            raise ValueError(f"copy_pages: {len(src_i)} source pages but {len(dst_i)} destination pages")
        # Fancy indexing on the right makes a copy first, so overlapping lists are safe.
        self.k[:, dst_i] = self.k[:, src_i]
        self.v[:, dst_i] = self.v[:, src_i]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V of every layer."""
        return 2 * self.k[:, 0].nbytes

    def read_pages(self, pages: Sequence[int]) -> np.ndarray:
        """``[2, num_layers, len(pages), page_size, kv_heads, head_dim]`` float32: K then V."""
        idx = self._pages(pages, "read_pages")
        return np.stack([self.k[:, idx], self.v[:, idx]])

    def write_pages(self, pages: Sequence[int], data: np.ndarray) -> None:
        idx = self._pages(pages, "write_pages")
        expected = (2, self.k.shape[0], len(idx), *self.k.shape[2:])
        if data.shape != expected:
            raise ValueError(f"write_pages: data shape {data.shape}, expected {expected}")
        self.k[:, idx] = data[0]
        self.v[:, idx] = data[1]

    def _pages(self, pages: Sequence[int], field: str) -> np.ndarray:
        idx = np.asarray(pages, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_pages):
            raise ValueError(f"{field}: page ids must lie in [0, {self.num_pages}), got {idx.tolist()}")
        return idx
