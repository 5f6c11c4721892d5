"""The decode attention's split-length policies (``forward.decode_split``, ``split_length``): pure
arithmetic, checked on the CPU. The kernels' grid is MAX_DECODE_SPLITS deep, so a split length that
needs more splits would drop keys."""

from __future__ import annotations

from pathlib import Path

import pytest

fw = pytest.importorskip("ninfer.backends.cuda.forward")


@pytest.mark.parametrize("row_blocks", [1, 2, 8, 24, 64, 256, 4096])
def test_every_split_length_fits_the_grid(row_blocks):
    for length in list(range(1, 3000)) + list(range(3000, 300_000, 997)):
        for split in (fw.decode_split(length, row_blocks), fw.split_length(length, fw.MAX_DECODE_SPLITS)):
            assert split % fw.MIN_SPLIT == 0 and split >= fw.MIN_SPLIT
            assert -(-length // split) <= fw.MAX_DECODE_SPLITS, (length, row_blocks, split)


def test_decode_attention_merges_as_many_splits_as_the_grid_holds():
    """The last block of a split row merges every split's max and sum in shared memory sized by the
    kernel's ``max_splits`` (the manifest): the policy must never ask for more."""
    import json

    manifest = json.loads((Path(__file__).resolve().parent.parent / "ptx" / "manifest.json").read_text())
    merged = [entry["meta"]["max_splits"] for name, entry in manifest["kernels"].items()
              if name.startswith("decode_attention_")]
    assert merged and min(merged) >= fw.MAX_DECODE_SPLITS


def test_the_measured_choices():
    """The Qwen3-8B cases of the H200 measurements the policy was fitted to (8 KV heads a row)."""
    assert fw.decode_split(513, 8) == 32  # batch 1, short: many short splits
    assert fw.decode_split(513, 64) == 128  # batch 8, short: about 320 blocks
    assert fw.decode_split(8193, 64) == 1664  # batch 8, long: still about 320 blocks
    assert fw.decode_split(8193, 8) == 224  # batch 1, long
    assert fw.split_length(513, fw.MAX_DECODE_SPLITS) == 32
    assert fw.split_length(8193, fw.MAX_DECODE_SPLITS) == 160  # the grid's depth bounds the count


def test_dense_decode_overlaps_launches_where_its_gemms_preload():
    """The dense step overlaps its launches where every decode GEMM is the fp32 GEMV (it issues its
    first weight loads before waiting: one and two rows), not where a normed tensor-core GEMM runs
    (from three rows) unless the step chains its norms, and never with the master switch off."""
    from types import SimpleNamespace

    def forward(overlap, chain_norm):
        fwd = SimpleNamespace(overlap=overlap, chain_norm=chain_norm)
        fwd.chains = lambda rows: fw.Forward.chains(fwd, rows)
        return fwd

    for rows in range(1, fw.GEMV_MAX_ROWS + 1):
        fp32_only = all(fw.DECODE_GEMMS[matrix][rows] == "fp32" for matrix in fw.DECODE_GEMMS)
        assert fw.Forward.overlaps(forward(True, False), rows) == fp32_only
        assert fw.Forward.overlaps(forward(True, True), rows)  # fp32 GEMVs, or chained norms
        assert fp32_only == (rows <= 2) == (not fw.chains_norms(rows))
    assert not fw.Forward.overlaps(forward(False, True), 1) and not fw.Forward.overlaps(forward(False, True), 8)
