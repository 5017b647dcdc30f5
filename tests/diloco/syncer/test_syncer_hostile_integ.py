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

from diloco.wire import PROTOCOL_VERSION, Bcast, Error, Limits, Final, FinalAck, Heartbeat, Hello, Init, Pull, Push, Shutdown, Welcome, encode
from diloco.syncer.listener import SYNCER_LIMITS
from syncer_harness import Island, SyncerProc, commit_event, reference_fragment

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
        "--part-mib", "0.015625", "--max-refusals", "100", "--event-log", str(tmp_path / "events.jsonl"),
    ])
    ctx = zmq.Context()
    a = Island(ctx, syncer.endpoint, 0, key=KEY, schema=[SHAPES] * P)
    b = Island(ctx, syncer.endpoint, 1, key=KEY, schema=[SHAPES] * P)
    evil = Island(ctx, syncer.endpoint, 1, key=KEY, schema=[SHAPES] * P)
    a2 = None
    try:
        def hello(isl: Island, **kw) -> Hello:
            f = dict(protocol=PROTOCOL_VERSION, island=isl.island, generation=isl.generation, fingerprint="fp", n_fragments=P,
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
        evil.send(hello(evil, protocol=PROTOCOL_VERSION + 1))
        too_big = SYNCER_LIMITS.max_header_bytes + 1  # under the frame limit: refused by the wire layer
        evil.send_raw([b"\x00" * 32, b"\x00" * too_big])  # header over the limit
        evil.send(hello(evil, island=5))
        evil.send(hello(evil, fingerprint="other-layout"))
        evil.send(hello(evil, fragment_numel=(2**40, 28)))
        for pattern in (r"1 frames", r"bad MAC", rf"protocol {PROTOCOL_VERSION + 1}", rf"header is {too_big} bytes",
                        r"fragment_too_large: .*YETO_DILOCO_FRAGMENTS >=",
                        r"unknown_island: island 5", r"fingerprint_mismatch"):
            wait_log(syncer, pattern)

        # ---- round 1 (fragment 0) opens at step 1 (a HELLO alone is not membership: step 0 first)
        for step in (0, 1):
            for isl in (a, b):
                isl.send(Heartbeat(island=isl.island, generation=isl.generation, step=step))
            time.sleep(0.2)
        for isl in (a, b):
            assert isl.expect(Pull).header == Pull(fragment=0, round=1, attempt=0)

        def push_header(isl: Island, **kw) -> Push:
            f = dict(island=isl.island, generation=isl.generation, fragment=0, round=1, attempt=0, base_version=0,
                     local_steps=2, tokens=100)
            f.update(kw)
            return Push(**f)

        good_b = [(rng.standard_normal(s) * 0.01).astype(np.float32) for _n, s in SHAPES]
        # Parts are checked against the fragment's schema before any payload byte is read;
        # each structural refusal leaves the state as it was.
        one = dict(part=0, n_parts=1)
        flat_b = [(n, t.reshape(-1)) for n, t in tensors(good_b)]
        structural = [
            (push_header(b, **one), [("w", torch.zeros(20)), ("b", torch.zeros(4))], "bad_part"),
            (push_header(b, **one), [(n, t.bfloat16()) for n, t in flat_b], "bad_part"),
            (push_header(b, part=1, n_parts=1), flat_b, None),  # after a refused part 0: dropped quietly
            (push_header(b, part=0, n_parts=3), flat_b, "bad_part"),  # wrong part count
            (push_header(b, attempt=1, **one), flat_b, "stale_attempt"),
            (push_header(b, base_version=5, **one), flat_b, "bad_base_version"),
            (push_header(b, local_steps=0, **one), flat_b, "bad_part"),  # zero weight carries no tensors
            (push_header(b, tokens=0, **one), flat_b, "bad_counts"),  # token weighting needs tokens
        ]
        for h, ts, _code in structural:
            b.sock.send_multipart(encode(h, ts, key=KEY, **b.stamp()), copy=False)
        frames = encode(push_header(b, **one), flat_b, key=KEY, **b.stamp())
        b.send_raw([bytes(x) for x in frames[:-1]] + [bytes(frames[-1])[:-3]])  # truncated last chunk
        wait_log(syncer, r"expected 16")
        # A declaration larger than one part is refused before anything is allocated.
        huge = encode(push_header(b, **one), [("w", torch.zeros(1 << 20))], key=KEY, **b.stamp())
        b.send_raw([bytes(huge[0]), bytes(huge[1])])
        wait_log(syncer, r"dimension above 16384 in shape \(1048576,\)")
        answered = [code for _h, _ts, code in structural if code is not None]
        assert [b.expect(Error).header.code for _ in answered] == answered
        wait_log(syncer, r"open=\[r1/f0/a0:0/2\]")  # nothing of it was taken

        # A NaN (or Inf) in a part is caught by the data plane: the part is folded into nothing,
        # but the attempt is dropped (earlier parts could not be taken out again) and re-pulled.
        nan = [("w", torch.full((24,), float("nan"))), ("b", torch.zeros(4))]
        b.sock.send_multipart(encode(push_header(b, **one), nan, key=KEY, **b.stamp()), copy=False)
        assert b.expect(Error).header.code == "bad_push"
        wait_log(syncer, r"holds NaN or Inf")
        for isl in (a, b):
            assert isl.expect(Pull).header == Pull(fragment=0, round=1, attempt=1)

        # ---- island 0 reconnects; its old generation is refused from then on
        a2 = Island(ctx, syncer.endpoint, 0, key=KEY, schema=[SHAPES] * P)
        a2.send(hello(a2))
        assert a2.expect(Welcome).header.versions == (0, 0)
        assert [a2.expect(Bcast).header.cut for _ in range(P)] == [True] * P
        assert a2.expect(Pull).header == Pull(fragment=0, round=1, attempt=1)  # same attempt again
        a.send(push_header(a, attempt=1), tensors(good_b))
        wait_log(syncer, r"old_generation")

        # ---- the legitimate pushes commit exactly the reference without any bad input
        good_a = [(rng.standard_normal(s) * 0.01).astype(np.float32) for _n, s in SHAPES]
        a2.send(push_header(a2, tokens=300, attempt=1), tensors(good_a))
        b.send(push_header(b, attempt=1), tensors(good_b))
        order = commit_event(tmp_path / "events.jsonl", 1)["fold_order"]
        value[0], mom[0] = reference_fragment(value[0], mom[0], {0: good_a, 1: good_b}, {0: 300, 1: 100}, order, 4096)
        for isl in (a2, b):
            m = isl.expect(Bcast)
            assert (m.header.fragment, m.header.version, m.header.cut) == (0, 1, False)
            for (_n, t), ref in zip(m.tensors, value[0]):
                assert np.array_equal(t.numpy(), ref)
        # A push after the commit is refused too (the round is gone).
        b.send(push_header(b, attempt=1), tensors(good_b))
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
        order = commit_event(tmp_path / "events.jsonl", 2)["fold_order"]
        value[1], mom[1] = reference_fragment(value[1], mom[1], d, {0: 50, 1: 50}, order, 4096)
        for isl in (a2, b):
            assert isl.expect(Bcast, strict=False).header.version == 1
        # Both islands reached --total-steps: one flush round per fragment, nothing left to merge; each
        # opens once the previous one has every push (--max-gathering-rounds 1).
        for _ in range(P):
            for isl in (a2, b):
                pull = isl.expect(Pull, strict=False).header
                isl.send(push_header(isl, fragment=pull.fragment, round=pull.round, local_steps=0, tokens=0,
                                     base_version=1))
        for isl in (a2, b):
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
