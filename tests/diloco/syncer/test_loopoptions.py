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


def test_the_loops_backlog_room_follows_the_part_size_the_layout_fixed(caplog) -> None:
    """Under ``--part-mib auto`` the loop starts sized for the 32 MiB cap; once the first HELLO fixes
    a smaller part the room (and the logged budget) shrink with it, so a 1 MiB part size does not
    let 64 parts queue where 2 per worker were meant."""
    import logging

    import zmq

    from diloco.syncer.core.config import SyncerConfig
    from diloco.syncer.core.coordinator import Coordinator
    from diloco.syncer.loop import SyncerLoop

    opts = LoopOptions(bind="tcp://127.0.0.1:*", data_threads=1, max_backlog_bytes=128 * MIB)
    ctx = zmq.Context()
    loop = SyncerLoop(Coordinator(SyncerConfig(islands=2, sync_every=2)), opts, context=ctx)
    try:
        with caplog.at_level(logging.INFO, logger="diloco.syncer.loop"):
            assert loop._backlog_room() == BACKLOG_PARTS * 32 * MIB - 32 * MIB
            assert loop._wire_limits.max_message_bytes == 32 * MIB
            loop.state.book.fix_layout("f" * 16, 4, (32 << 20,) * 4)  # 128 MiB fragments: 1 MiB parts
            assert loop._backlog_room() == BACKLOG_PARTS * MIB - MIB
            assert loop._wire_limits.max_message_bytes == MIB  # a bigger message is refused at the wire
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("received parts")]
        assert len(logged) == 2 and "of up to 1.0 MiB per connection" in logged[1]
    finally:
        loop.close()
        ctx.term()
