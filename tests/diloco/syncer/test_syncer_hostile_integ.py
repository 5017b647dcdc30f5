"""A live, keyed syncer process under hostile input: every bad message is refused with a
logged reason, changes nothing (the commit equals the reference without it), and the
syncer still completes its rounds and finalizes.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
import zmq

from diloco.wire import Bcast, Error, Limits, Final, FinalAck, Heartbeat, Hello, Init, Pull, Push, Shutdown, Welcome, encode
from syncer_harness import Island, SyncerProc, reference_step

KEY = b"test-key-0123456789"
SHAPES = [("w", (6, 4)), ("b", (4,))]  # both fragments share the tensor layout
P = 2


def tensors(arrays: list[np.ndarray]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.from_numpy(a)) for (n, _s), a in zip(SHAPES, arrays)]


def wait_log(syncer: SyncerProc, pattern: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, syncer.log()):
        assert time.monotonic() < deadline, f"no log line matching {pattern!r}:\n{syncer.log()}"
        time.sleep(0.05)


@pytest.mark.integ
@pytest.mark.timeout(120)
def test_hostile_inputs_refused_and_syncer_keeps_serving(tmp_path) -> None:
    rng = np.random.default_rng(2)
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    syncer = SyncerProc(tmp_path, [
        "--islands", "2", "--sync-every", "2", "--total-steps", "2", "--grace-ms", "0",
        "--quorum-timeout-s", "60", "--key-file", str(key_file), "--checkpoint-dir", str(tmp_path / "ck"),
    ])
    ctx = zmq.Context()
    a = Island(ctx, syncer.endpoint, 0, key=KEY)
    b = Island(ctx, syncer.endpoint, 1, key=KEY)
    evil = Island(ctx, syncer.endpoint, 1, key=KEY)
    a2 = None
    try:
        def hello(isl: Island, **kw) -> Hello:
            f = dict(protocol=1, island=isl.island, generation=isl.generation, fingerprint="fp", n_fragments=P,
                     wire_dtype="float32")
            f.update(kw)
            return Hello(**f)

        for isl in (a, b):
            isl.send(hello(isl))
            assert isl.expect(Welcome).header.need_init == (isl is a)
        value = [[rng.standard_normal(s).astype(np.float32) for _n, s in SHAPES] for _ in range(P)]
        mom = [[np.zeros_like(x) for x in fr] for fr in value]
        for f in range(P):
            a.send(Init(island=0, generation=a.generation, fragment=f, n_fragments=P), tensors(value[f]))
        for isl in (a, b):
            assert [isl.expect(Bcast).header.cut for _ in range(P)] == [True] * P

        # ---- junk from a stranger: none of it reaches the state machine
        evil.send_raw([b"garbage"])
        evil.send_raw([b"\x00" * 32, b"\xc1\xc1not msgpack"])
        evil.send(hello(evil), key=b"wrong key")
        evil.send(hello(evil, protocol=2))
        too_big = Limits().max_header_bytes + 1
        evil.send_raw([b"\x00" * 32, b"\x00" * too_big])  # header over the limit
        evil.send(hello(evil, island=5))
        evil.send(hello(evil, fingerprint="other-layout"))
        for pattern in (r"1 frames", r"bad MAC", r"protocol 2", rf"header is {too_big} bytes",
                        r"unknown_island: island 5", r"fingerprint_mismatch"):
            wait_log(syncer, pattern)

        # ---- round 1 (fragment 0) opens at step 1
        for isl in (a, b):
            isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=1))
        for isl in (a, b):
            assert isl.expect(Pull).header == Pull(fragment=0, round=1, attempt=0)

        def push_header(isl: Island, **kw) -> Push:
            f = dict(island=isl.island, generation=isl.generation, fragment=0, round=1, attempt=0, base_version=0,
                     local_steps=2, tokens=100)
            f.update(kw)
            return Push(**f)

        good_b = [(rng.standard_normal(s) * 0.01).astype(np.float32) for _n, s in SHAPES]
        bad = [
            ([("w", torch.zeros(4, 6)), ("b", torch.zeros(4))], {}, "bad_schema"),
            ([(n, t.bfloat16()) for n, t in tensors(good_b)], {}, "bad_dtype"),
            ([("w", torch.full((6, 4), float("nan"))), ("b", torch.zeros(4))], {}, "not_finite"),
            ([("w", torch.zeros(6, 4)), ("b", torch.tensor([0.0, float("inf"), 0, 0]))], {}, "not_finite"),
            (tensors(good_b), {"attempt": 1}, "stale_attempt"),
            (tensors(good_b), {"base_version": 5}, "bad_base_version"),
        ]
        for ts, kw, _code in bad:
            b.send(push_header(b, **kw), ts)
        frames = encode(push_header(b), tensors(good_b), key=KEY)
        b.send_raw([bytes(x) for x in frames[:-1]] + [bytes(frames[-1])[:-3]])  # truncated last chunk
        wait_log(syncer, r"expected 16")
        # Once the model is known, a declaration larger than any fragment is refused before allocation.
        b.send(push_header(b), [("w", torch.zeros(600, 400)), ("b", torch.zeros(4))])
        wait_log(syncer, r"960000 bytes declared, limit 96")
        for _ts, _kw, code in bad:
            wait_log(syncer, code)
        # Refused pushes are answered with ERROR (the truncated one never decoded: no answer).
        assert [b.expect(Error).header.code for _ in bad] == [code for _ts, _kw, code in bad]

        # ---- island 0 reconnects; its old generation is refused from then on
        a2 = Island(ctx, syncer.endpoint, 0, key=KEY)
        a2.send(hello(a2))
        assert a2.expect(Welcome).header.versions == (0, 0)
        assert [a2.expect(Bcast).header.cut for _ in range(P)] == [True] * P
        assert a2.expect(Pull).header == Pull(fragment=0, round=1, attempt=0)  # same attempt again
        a.send(push_header(a), tensors(good_b))
        wait_log(syncer, r"old_generation")

        # ---- the legitimate pushes commit exactly the reference without any bad input
        good_a = [(rng.standard_normal(s) * 0.01).astype(np.float32) for _n, s in SHAPES]
        a2.send(push_header(a2, tokens=300), tensors(good_a))
        b.send(push_header(b), tensors(good_b))
        for j in range(len(SHAPES)):
            value[0][j], mom[0][j] = reference_step(value[0][j], mom[0][j], [good_a[j], good_b[j]], [300, 100])
        for isl in (a2, b):
            m = isl.expect(Bcast)
            assert (m.header.fragment, m.header.version, m.header.cut) == (0, 1, False)
            for (_n, t), ref in zip(m.tensors, value[0]):
                assert np.array_equal(t.numpy(), ref)
        # A push after the commit is refused too (the round is gone).
        b.send(push_header(b), tensors(good_b))
        wait_log(syncer, r"round 1 is already committed")
        assert b.expect(Error).header.code == "unknown_round"

        # ---- round 2 (fragment 1), then finalization
        for isl in (a2, b):
            isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=2))
        for isl in (a2, b):
            assert isl.expect(Pull).header == Pull(fragment=1, round=2, attempt=0)
        d = {isl.island: [(rng.standard_normal(s) * 0.01).astype(np.float32) for _n, s in SHAPES] for isl in (a2, b)}
        for isl in (a2, b):
            isl.send(push_header(isl, fragment=1, round=2, tokens=50), tensors(d[isl.island]))
        for j in range(len(SHAPES)):
            value[1][j], mom[1][j] = reference_step(value[1][j], mom[1][j], [d[0][j], d[1][j]], [50, 50])
        for isl in (a2, b):
            assert isl.expect(Bcast).header.version == 1
            finals = [isl.expect(Final) for _ in range(P)]
            for m in finals:
                for (_n, t), ref in zip(m.tensors, value[m.header.fragment]):
                    assert np.array_equal(t.numpy(), ref)
            isl.send(FinalAck(island=isl.island, generation=isl.generation, versions=(1, 1)))
        for isl in (a2, b):
            isl.expect(Shutdown)
        assert syncer.wait(30) == 0, syncer.log()
        log = syncer.log()
        assert "UNAUTHENTICATED" not in log
        # Each refusal is one log line with its reason.
        assert len(re.findall(r"refused", log)) >= 15
    finally:
        for isl in (a, b, evil) + ((a2,) if a2 else ()):
            isl.close()
        syncer.stop()
        ctx.term()
