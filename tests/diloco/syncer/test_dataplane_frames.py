"""The data plane lets go of a received part's frames as soon as its work is done: the loop may read
more parts before it takes the result, and the backlog it throttles on no longer counts them."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch

from diloco.syncer.core.work import FoldPart, RoundSum
from diloco.syncer.dataplane import DataPlane

from state_driver import opened, push_parts

pytestmark = pytest.mark.timeout(30)


def test_a_fold_drops_its_frames_before_the_loop_takes_the_result() -> None:
    delta = torch.randn(300_000, generator=torch.Generator().manual_seed(5))
    (header, tensors), = push_parts(0, 1, 0, 1, [("w", delta)], 300_000 + 4096 - 300_000 % 4096)
    msg = opened(header, tensors)
    assert len(msg.chunk_views()) == 2 and msg.nbytes == 1_200_000 and not msg.released  # two chunk frames
    rs = RoundSum(round=1, attempt=0, fragment=0, flat=torch.zeros(300_000), n_parts=1)
    results: queue.SimpleQueue = queue.SimpleQueue()
    plane = DataPlane(1, results.put)
    try:
        plane.submit(FoldPart(rs, 0, 0, msg, 3, 0))
        res = results.get(timeout=10)
    finally:
        plane.close()
    assert res.error is None and res.work.opened is msg
    assert msg.released and msg.nbytes == 1_200_000  # frames gone, sizes kept
    with pytest.raises(RuntimeError, match="released"):
        msg.chunk_views()
    assert plane.backlog_bytes == 0
    want = (np.float32(3) * delta.numpy()).astype(np.float32)
    assert np.array_equal(rs.flat.numpy().view(np.uint32), want.view(np.uint32))  # the fold read them first
