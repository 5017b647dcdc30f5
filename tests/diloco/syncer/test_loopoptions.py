"""The loop's bounds on received bytes: the backlog cap and the frames budget it logs at start."""

from __future__ import annotations

import pytest

from diloco.syncer.loopoptions import BACKLOG_PARTS, LoopOptions

pytestmark = pytest.mark.timeout(10)

MIB = 1 << 20


def test_backlog_cap_is_parts_per_worker_within_the_byte_cap_and_never_below_one_message() -> None:
    opts = LoopOptions(data_threads=4, max_backlog_bytes=128 * MIB)
    assert opts.backlog_cap(8 * MIB) == BACKLOG_PARTS * 4 * 8 * MIB
    assert opts.backlog_cap(32 * MIB) == 128 * MIB  # the byte cap
    assert LoopOptions(data_threads=4, max_backlog_bytes=MIB).backlog_cap(32 * MIB) == 32 * MIB  # one message


def test_frames_budget_counts_zmq_per_island_and_the_backlog() -> None:
    opts = LoopOptions(data_threads=4, max_backlog_bytes=128 * MIB, rcvhwm=2)
    line = opts.frames_budget(2, 32 * MIB)
    assert line.startswith("at most 320.0 MiB held")  # 2 islands x 3 x 32 MiB + 128 MiB
    assert "3 messages of up to 32.0 MiB per connection, 2 islands" in line and "backlog 128.0 MiB" in line
    assert LoopOptions(data_threads=1, rcvhwm=2).frames_budget(2, 8 * MIB).startswith("at most 64.0 MiB held")
    assert "unbounded" in LoopOptions(rcvhwm=0).frames_budget(2, 8 * MIB)
