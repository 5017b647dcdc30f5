"""Shard <-> canonical conversions of diloco.layout.base against megatron's conventions, written out by hand."""

from __future__ import annotations

import pytest
import torch

from diloco.layout.base import ShardInfo, global_shape_of, place_shard, shard_of_global


@pytest.mark.timeout(10)
def test_swiglu_stride2_shard_is_gate_r_then_up_r() -> None:
    g = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # rows 0-3 gate, 4-7 up
    s1 = ShardInfo(local_shape=(4, 3), partition_dim=0, partition_stride=2, shard_rank=1, shard_count=2)
    local = shard_of_global(g, s1).view(4, 3)
    assert torch.equal(local, torch.cat([g[2:4], g[6:8]]))
    out = torch.zeros_like(g)
    for r in range(2):
        s = ShardInfo(local_shape=(4, 3), partition_dim=0, partition_stride=2, shard_rank=r, shard_count=2)
        place_shard(out, s, shard_of_global(g, s))
    assert torch.equal(out, g)


@pytest.mark.timeout(10)
def test_row_parallel_dim1_round_trip() -> None:
    g = torch.randn(5, 6)
    out = torch.zeros_like(g)
    for r in range(3):
        s = ShardInfo(local_shape=(5, 2), partition_dim=1, shard_rank=r, shard_count=3)
        assert torch.equal(shard_of_global(g, s).view(5, 2), g[:, 2 * r : 2 * r + 2])
        place_shard(out, s, shard_of_global(g, s))
    assert torch.equal(out, g)


@pytest.mark.timeout(10)
def test_padded_vocab_rows_are_dropped() -> None:
    vocab, rows = 150, 128  # padded to 256 over TP2: rank 1 holds 22 real rows
    g = torch.randn(vocab, 4)
    s1 = ShardInfo(local_shape=(rows, 4), partition_dim=0, shard_rank=1, shard_count=2)
    assert s1.valid_numel((vocab, 4)) == 22 * 4 and s1.padded((vocab, 4))
    assert torch.equal(shard_of_global(g, s1).view(22, 4), g[128:])
    assert global_shape_of(s1, dim0_override=vocab) == (150, 4)
    unpart = ShardInfo(local_shape=(256, 4))
    assert unpart.valid_numel((vocab, 4)) == vocab * 4
