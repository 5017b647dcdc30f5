"""The control loop answers heartbeats while a large round is folded and committed.

A real syncer whose data plane is made artificially slow (``YETO_TEST_DATAPLANE_DELAY_S``:
every work item sleeps first, one worker), a 64 MiB fragment in 16 parts, two islands
pushing it and a third island pinging throughout.  While the data plane works through
~50 slow items (seconds), heartbeat replies must keep coming, the round must commit with
both pushes, and nobody is declared dead.  The check is causal (replies arrive between the
last push part and the broadcast), not a timing target.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import zmq

from diloco.wire import PROTOCOL_VERSION, Bcast, Heartbeat, Hello, Init, Pull, Push, Welcome, open_message
from syncer_harness import Island, SyncerProc

KEY = b"liveness-key-0123"
SHAPES = [[("w", (4096, 2048)), ("b", (8 << 20,))]]  # 16 Mi elements = 64 MiB of fp32


@pytest.mark.integ
@pytest.mark.timeout(240)
def test_heartbeats_answered_while_a_large_round_commits(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("YETO_TEST_DATAPLANE_DELAY_S", "0.15")
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    syncer = SyncerProc(tmp_path, [
        "--islands", "3", "--quorum", "2", "--grace-ms", "0", "--sync-every", "1", "--total-steps", "1",
        "--part-mib", "4", "--data-threads", "1", "--key-file", str(key_file), "--quorum-timeout-s", "120",
        "--dead-after-s", "30", "--event-log", str(tmp_path / "events.jsonl"),
    ])
    ctx = zmq.Context()
    islands = [Island(ctx, syncer.endpoint, i, key=KEY, schema=SHAPES) for i in range(3)]
    stop = threading.Event()
    replies: list[float] = []
    try:
        for isl in islands:
            isl.send(Hello(protocol=PROTOCOL_VERSION, island=isl.island, generation=isl.generation,
                           fingerprint="fp-live", n_fragments=1, wire_dtype="float32", fragment_numel=(16 << 20,)))
            isl.expect(Welcome)
        g = torch.Generator().manual_seed(0)
        value = [(n, torch.randn(s, generator=g)) for n, s in SHAPES[0]]
        islands[0].send(Init(island=0, generation=islands[0].generation, fragment=0, n_fragments=1), value)
        for isl in islands[:2]:
            assert isl.expect(Bcast, timeout_s=120).header.cut

        pinger = islands[2]

        def ping() -> None:
            # Island 2 never pushes; it sends a heartbeat every 50 ms and notes each reply,
            # draining everything else the syncer sends it (its cut, PULLs, the broadcast).
            last = 0.0
            while not stop.is_set():
                now = time.monotonic()
                if now - last > 0.05:
                    pinger.send(Heartbeat(island=2, generation=pinger.generation, step=0))
                    last = now
                if pinger.sock.poll(10):
                    opened = open_message(pinger.sock.recv_multipart(copy=False), key=KEY)
                    if isinstance(opened.header, Heartbeat):
                        replies.append(time.monotonic())

        t = threading.Thread(target=ping, daemon=True)
        t.start()
        for step in (0, 1):  # a HELLO alone is not membership: step 0 first
            for isl in islands[:2]:
                isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=step))
            time.sleep(0.2)
        deltas = []
        for isl in islands[:2]:
            pull = isl.expect(Pull, strict=False).header
            d = [(n, torch.randn(s, generator=g) * 0.01) for n, s in SHAPES[0]]
            deltas.append(d)
            isl.send(Push(island=isl.island, generation=isl.generation, fragment=0, round=pull.round, attempt=0,
                          base_version=0, local_steps=1, tokens=100), d)
        pushed_at = time.monotonic()
        b = islands[0].expect(Bcast, timeout_s=180, strict=False)
        bcast_at = time.monotonic()
        assert (b.header.version, b.header.cut) == (1, False)
        stop.set()
        t.join(10)
        busy = [r for r in replies if pushed_at <= r <= bcast_at]
        # The data plane needed >= 34 slow items (32 folds of 4 MiB parts, 2 commit spans of 32 MiB)
        # after the pushes.
        assert bcast_at - pushed_at > 34 * 0.15 * 0.9
        assert len(busy) >= int(bcast_at - pushed_at), f"{len(busy)} heartbeat replies in {bcast_at - pushed_at:.1f}s"
        # The value broadcast is the real commit of both pushes (mean, lr 0.7, momentum 0.9 from 0).
        flat = np.concatenate([t.reshape(-1).numpy() for _n, t in value])
        mean = (np.concatenate([d.reshape(-1).numpy() for _n, d in deltas[0]]) * np.float32(100)
                + np.concatenate([d.reshape(-1).numpy() for _n, d in deltas[1]]) * np.float32(100)) / np.float32(200)
        got = np.concatenate([t.reshape(-1).numpy() for _n, t in b.tensors])
        assert np.allclose(got, flat + np.float32(0.7) * (mean + np.float32(0.9) * mean), atol=1e-6)
        assert "declared dead" not in syncer.log()
    finally:
        stop.set()
        for isl in islands:
            isl.close()
        syncer.stop()
        ctx.term()
