"""The paged KV pool of the reference backend.

K and V are float32 ``[num_layers, num_pages, page_size, kv_heads, head_dim]``. Token ``t`` of a
sequence lives in page ``page_table[t // page_size]`` at slot ``t % page_size``. The engine decides
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

    def slots(self, page_table: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page, slot) of each position of one sequence."""
        return page_table[positions // self.page_size], positions % self.page_size

    def write(self, layer: int, pages: np.ndarray, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k``/``v`` [rows, kv_heads, head_dim] at ``(pages[i], slots[i])``."""
        self.k[layer, pages, slots] = k
        self.v[layer, pages, slots] = v

    def gather(self, layer: int, page_tables: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions ``[0, length)`` for each row of ``page_tables`` [rows, pages].

        Returns ``[rows, length, kv_heads, head_dim]``. Rows shorter than ``length`` must mask the
        tail themselves: unused page-table entries (-1) read page 0, whatever it holds.
        """
        n_pages = -(-length // self.page_size)
        table = page_tables[:, :n_pages]
        rows = table.shape[0]
        if rows == 1 and _is_consecutive(table[0]):
            # One sequence on ascending pages (the usual single-request case): a view, no copy.
            first = int(table[0, 0])
            k = self.k[layer, first : first + n_pages].reshape(1, -1, *self.k.shape[3:])
            v = self.v[layer, first : first + n_pages].reshape(1, -1, *self.v.shape[3:])
            return k[:, :length], v[:, :length]
        table = np.maximum(table, 0)
        k = self.k[layer][table].reshape(rows, -1, *self.k.shape[3:])
        v = self.v[layer][table].reshape(rows, -1, *self.v.shape[3:])
        return k[:, :length], v[:, :length]

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        src_i, dst_i = self._pages(src), self._pages(dst)
        if len(src_i) != len(dst_i):
            raise ValueError(f"copy_pages: {len(src_i)} source pages but {len(dst_i)} destination pages")
        # Fancy indexing on the right makes a copy first, so overlapping lists are safe.
        self.k[:, dst_i] = self.k[:, src_i]
        self.v[:, dst_i] = self.v[:, src_i]

    def read_pages(self, pages: Sequence[int]) -> np.ndarray:
        """``[2, num_layers, len(pages), page_size, kv_heads, head_dim]`` float32: K then V."""
        idx = self._pages(pages)
        return np.stack([self.k[:, idx], self.v[:, idx]])

    def write_pages(self, pages: Sequence[int], data: np.ndarray) -> None:
        idx = self._pages(pages)
        expected = (2, self.k.shape[0], len(idx), *self.k.shape[2:])
        if data.shape != expected:
            raise ValueError(f"write_pages: data shape {data.shape}, expected {expected}")
        self.k[:, idx] = data[0]
        self.v[:, idx] = data[1]

    def _pages(self, pages: Sequence[int]) -> np.ndarray:
        idx = np.asarray(pages, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_pages):
            raise ValueError(f"page ids must lie in [0, {self.num_pages}), got {idx.tolist()}")
        return idx


def _is_consecutive(pages: np.ndarray) -> bool:
    return pages.size > 0 and pages[0] >= 0 and bool(np.all(np.diff(pages) == 1))
