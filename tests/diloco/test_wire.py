"""Tests of diloco.wire: round trips of every kind, exact tensors, and hostile inputs.

Hostile messages are forged with a *valid* MAC where the check under test comes
after the MAC (so the test really reaches that check), using the same msgspec
encoder the codec uses.
"""

from __future__ import annotations

import hmac
import math

import msgspec
import numpy as np
import pytest
import torch
import zmq

from diloco import wire
from diloco.wire.schema import ENVELOPE_ENCODER, Envelope

pytestmark = pytest.mark.timeout(60)

KEY = b"test-key"

ALL_HEADERS: list[wire.Header] = [
    wire.Hello(protocol=wire.PROTOCOL_VERSION, island=1, generation=2**62 + 5, fingerprint="ab12",
               n_fragments=3, wire_dtype="bfloat16"),
    wire.Welcome(protocol=wire.PROTOCOL_VERSION, syncer_id=77, need_init=True, versions=(0, 4, 2),
                 sync_every=100, total_steps=1000),
    wire.Init(island=0, generation=9, fragment=2, n_fragments=3),
    wire.Pull(fragment=1, round=7, attempt=2),
    wire.Push(island=1, generation=9, fragment=1, round=7, attempt=2, base_version=3, local_steps=33, tokens=4096),
    wire.Bcast(fragment=1, version=4, round=7, cut=False),
    wire.Heartbeat(island=2, generation=5, step=123, done=True),
    wire.Heartbeat(syncer_id=99),
    wire.Final(fragment=0, version=8, n_fragments=3, versions=(8, 7, 7)),
    wire.FinalAck(island=2, generation=5, versions=(8, 7, 7)),
    wire.Shutdown(reason="training finished"),
    wire.Error(code="FINGERPRINT", reason="layout fingerprint differs"),
]


def _forge(body: bytes, chunks: list[bytes] = (), key: bytes = KEY) -> list[bytes]:
    """Frames for an arbitrary header body, with a correct MAC."""
    return [hmac.digest(key, body, "sha256"), body, *chunks]


def _forge_envelope(tensors: tuple[wire.TensorMeta, ...], chunks: list[bytes] = (), chunk_bytes: int = 16,
                    header: wire.Header = wire.Pull(0, 1, 0)) -> list[bytes]:
    env = Envelope(protocol=wire.PROTOCOL_VERSION, header=header, chunk_bytes=chunk_bytes, tensors=tensors)
    return _forge(ENVELOPE_ENCODER.encode(env), list(chunks))


def _refused(frames, match: str, **kw) -> wire.WireError:
    with pytest.raises(wire.WireError, match=match) as info:
        wire.decode(frames, **kw)
    assert info.value.reason == str(info.value) and "\n" not in info.value.reason
    return info.value


class _CountingPool(wire.HostBufferPool):
    """A real pool that records every allocation request (to prove none happened)."""

    def __init__(self) -> None:
        super().__init__(max_idle_bytes=0)
        self.requests: list[tuple[tuple[int, ...], torch.dtype]] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.requests.append((tuple(shape), dtype))
        return super().empty(shape, dtype)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("header", ALL_HEADERS, ids=lambda h: wire.kind_of(h))
def test_every_kind_round_trips(header: wire.Header) -> None:
    msg = wire.decode(wire.encode(header, key=KEY), key=KEY)
    assert msg.header == header and type(msg.header) is type(header)
    assert msg.tensors == []


def test_kind_tags_are_uppercase_names() -> None:
    assert [wire.kind_of(h) for h in ALL_HEADERS[:7]] == [
        "HELLO", "WELCOME", "INIT", "PULL", "PUSH", "BCAST", "HEARTBEAT"]
    assert wire.kind_of(wire.FinalAck(0, 0, ())) == "FINAL_ACK"


def test_tensors_bit_exact_multi_chunk_zero_size_and_scalar() -> None:
    gen = torch.Generator().manual_seed(1)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38])
    tensors = [
        ("w", torch.randn(37, 11, generator=gen)),                  # 1628 bytes -> many chunks
        ("bf", torch.randn(5, 3, 2, generator=gen).to(torch.bfloat16)),
        ("empty", torch.empty(0, 7)),                               # zero chunks
        ("scalar", torch.tensor(2.5)),
        ("special", special),
    ]
    frames = wire.encode(wire.Init(0, 1, 0, 1), tensors, key=KEY, chunk_bytes=100)
    assert len(frames) == 2 + math.ceil(1628 / 100) + 1 + 0 + 1 + 1
    msg = wire.decode(frames, key=KEY)
    assert [n for n, _ in msg.tensors] == [n for n, _ in tensors]
    for (_, sent), (_, got) in zip(tensors, msg.tensors):
        assert got.dtype == sent.dtype and got.shape == sent.shape and got.is_contiguous()
        assert sent.view(-1).view(torch.int16 if sent.dtype == torch.bfloat16 else torch.int32).equal(
            got.view(-1).view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32))
    assert wire.payload_bytes(msg) == 1628 + 60 + 0 + 4 + 24


def test_chunk_size_not_multiple_of_itemsize() -> None:
    t = torch.randn(1001)
    msg = wire.decode(wire.encode(wire.Pull(0, 1, 0), [("t", t)], chunk_bytes=7))
    assert torch.equal(msg.tensors[0][1], t)


def _bf16_rne_reference(x: torch.Tensor) -> np.ndarray:
    """Round-to-nearest-even fp32 -> bf16 bits, computed independently with integer arithmetic."""
    bits = x.numpy().view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def test_bf16_wire_conversion_is_torch_round_to_nearest_even() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.cat([
        torch.randn(4096, generator=gen) * 1e3,
        # exact ties: low 16 bits == 0x8000, with even and odd kept bit
        torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x40490FDB], dtype=torch.int64).to(torch.int32).view(
            torch.float32),
    ])
    msg = wire.decode(wire.encode(wire.Pull(0, 1, 0), [("x", x)], wire_dtype="bfloat16", chunk_bytes=1000))
    got = msg.tensors[0][1]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), _bf16_rne_reference(x))


def test_encode_does_not_copy_contiguous_fp32() -> None:
    t = torch.randn(64, 64)
    frames = wire.encode(wire.Pull(0, 1, 0), [("t", t)], chunk_bytes=4096)
    chunk = np.frombuffer(frames[2], dtype=np.uint8)
    assert chunk.ctypes.data == t.data_ptr()  # a view of the tensor, not a copy
    # Non-contiguous and other-dtype inputs are converted once and still round-trip.
    nc = torch.randn(8, 6).t()
    half = torch.randn(10, dtype=torch.float16)
    msg = wire.decode(wire.encode(wire.Pull(0, 1, 0), [("nc", nc), ("h", half)], wire_dtype="float32"))
    assert torch.equal(msg.tensors[0][1], nc) and torch.equal(msg.tensors[1][1], half.float())


def test_encode_refuses_local_misuse() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        wire.encode(wire.Pull(0, 1, 0), [("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ValueError, match="dtype"):
        wire.encode(wire.Pull(0, 1, 0), [("a", torch.zeros(1, dtype=torch.float16))])
    with pytest.raises(ValueError, match="wire_dtype"):
        wire.encode(wire.Pull(0, 1, 0), [], wire_dtype="float16")
    with pytest.raises(TypeError):
        wire.encode({"kind": "PULL"}, [])  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_real_zmq_dealer_router_round_trip() -> None:
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        dealer = ctx.socket(zmq.DEALER)
        for s in (router, dealer):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 10_000)
            s.setsockopt(zmq.SNDTIMEO, 10_000)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        gen = torch.Generator().manual_seed(3)
        delta = [("a.weight", torch.randn(300, 70, generator=gen)), ("a.bias", torch.randn(70, generator=gen))]
        push = wire.Push(island=1, generation=5, fragment=0, round=1, attempt=0, base_version=0,
                         local_steps=3, tokens=96)
        dealer.send_multipart(wire.encode(push, delta, key=KEY, chunk_bytes=8192), copy=False)
        ident, *frames = router.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        got = wire.decode(frames, key=KEY)
        assert got.header == push
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(delta, got.tensors))
        bcast = wire.Bcast(fragment=0, version=1, round=1, cut=False)
        router.send_multipart([ident, *wire.encode(bcast, got.tensors, key=KEY, wire_dtype="bfloat16")], copy=False)
        back = wire.decode(dealer.recv_multipart(copy=False), key=KEY)
        assert back.header == bcast
        assert all(torch.equal(a.to(torch.bfloat16), b) for (_, a), (_, b) in zip(delta, back.tensors))
        # A hostile message over the same socket is refused and the next good one still decodes.
        dealer.send_multipart([b"\x00" * 32, b"garbage"])
        _, *bad = router.recv_multipart(copy=False)
        with pytest.raises(wire.WireError, match="MAC"):
            wire.decode(bad, key=KEY)
        dealer.send_multipart(wire.encode(wire.Heartbeat(island=1, generation=5, step=4), key=KEY))
        _, *ok = router.recv_multipart(copy=False)
        assert wire.decode(ok, key=KEY).header.step == 4
    finally:
        ctx.destroy(linger=0)


# --------------------------------------------------------------------------- hostile inputs


def test_garbage_and_too_few_frames() -> None:
    _refused([], "at least 2")
    _refused([b"x" * 32], "at least 2")
    _refused([b"short", b"hdr"], "MAC frame is 5 bytes")
    _refused(_forge(b"\xc1\xff garbage"), "malformed header", key=KEY)
    _refused(_forge(b""), "malformed header", key=KEY)
    _refused([b"x" * 32, b"y" * 100], "bad MAC", key=KEY)


def test_wrong_missing_key_and_tampered_header() -> None:
    frames = wire.encode(wire.Pull(0, 1, 0), key=KEY)
    _refused(frames, "bad MAC", key=b"other-key")
    _refused(frames, "bad MAC")  # receiver has no key
    _refused(wire.encode(wire.Pull(0, 1, 0)), "bad MAC", key=KEY)  # sender had none
    body = bytearray(frames[1])
    body[-1] ^= 0x01
    _refused([frames[0], bytes(body)], "bad MAC", key=KEY)


def test_oversized_header_refused_before_mac() -> None:
    limits = wire.Limits(max_header_bytes=64)
    frames = wire.encode(wire.Shutdown(reason="x" * 200), key=KEY)
    _refused(frames, "header is .* bytes, limit 64", key=KEY, limits=limits)


def test_tampered_truncated_and_extra_chunks() -> None:
    t = torch.arange(40, dtype=torch.float32)
    frames = [bytes(f) for f in wire.encode(wire.Pull(0, 1, 0), [("t", t)], key=KEY, chunk_bytes=64)]
    assert len(frames) == 2 + 3  # 160 bytes -> 64, 64, 32
    bad = list(frames)
    flipped = bytearray(bad[3])
    flipped[5] ^= 0x40
    bad[3] = bytes(flipped)
    _refused(bad, "chunk 1 of 't' fails its digest", key=KEY)
    _refused(frames[:2] + [frames[2], frames[3][:-1], frames[4]], "chunk 1 of 't' is 63 bytes, expected 64", key=KEY)
    _refused(frames[:-1], "2 chunk frames, header declares 3", key=KEY)
    _refused(frames + [b"\x00" * 8], "4 chunk frames, header declares 3", key=KEY)
    swapped = frames[:2] + [frames[3], frames[2], frames[4]]
    _refused(swapped, "fails its digest", key=KEY)


def test_oversized_declared_shape_fails_by_limit_without_allocating() -> None:
    pool = _CountingPool()
    meta = wire.TensorMeta(name="huge", dtype="float32", shape=(2**20, 2**20), chunks=())
    err = _refused(_forge_envelope((meta,)), r"4398046511104 bytes declared, limit 134217728", key=KEY, pool=pool)
    assert "huge" in err.reason
    assert pool.requests == []
    # A zero-element shape with an absurd dimension declares 0 bytes; it is refused by its dimension.
    zero = wire.TensorMeta(name="zero", dtype="float32", shape=(0, 2**63), chunks=())
    _refused(_forge_envelope((zero,)), "dimension above", key=KEY, pool=pool)
    assert pool.requests == []
    # Many tensors each within the per-tensor limit, together above the message limit.
    limits = wire.Limits(max_tensor_bytes=1 << 20, max_message_bytes=3 << 20)
    metas = tuple(wire.TensorMeta(f"t{i}", "float32", (1 << 18,), (0,) * 4) for i in range(4))
    _refused(_forge_envelope(metas, chunk_bytes=1 << 18), "more than 3145728 tensor bytes", key=KEY,
             limits=limits, pool=pool)
    assert pool.requests == []


def test_bad_shapes_dtypes_counts_and_names() -> None:
    pool = _CountingPool()

    def meta(**kw) -> wire.TensorMeta:
        base = dict(name="t", dtype="float32", shape=(4,), chunks=(0,))
        base.update(kw)
        return wire.TensorMeta(**base)

    _refused(_forge_envelope((meta(shape=(4, -1), chunks=()),)), "negative dimension", key=KEY, pool=pool)
    _refused(_forge_envelope((meta(shape=(1,) * 9, chunks=(0,)),)), "9 dims, limit 8", key=KEY, pool=pool)
    _refused(_forge_envelope((meta(dtype="float16"),)), "dtype 'float16' not in", key=KEY, pool=pool)
    _refused(_forge_envelope((meta(dtype="int64"),)), "dtype 'int64' not in", key=KEY, pool=pool)
    _refused(_forge_envelope((meta(), meta())), "duplicate tensor name 't'", key=KEY, pool=pool)
    _refused(_forge_envelope((meta(name=""),)), "empty name", key=KEY, pool=pool)
    _refused(_forge_envelope((meta(chunks=(0, 0)),)), "2 chunk digests for 16 bytes, expected 1", key=KEY, pool=pool)
    _refused(_forge_envelope((meta(),), chunk_bytes=0), r"chunk_bytes 0 outside", key=KEY, pool=pool)
    _refused(_forge_envelope((meta(),), chunk_bytes=(64 << 20) + 1), "chunk_bytes .* outside", key=KEY, pool=pool)
    many = tuple(meta(name=f"t{i}", shape=(0,), chunks=()) for i in range(5))
    _refused(_forge_envelope(many), "5 tensors, limit 4", key=KEY, limits=wire.Limits(max_tensors=4), pool=pool)
    assert pool.requests == []


def test_wrong_protocol_version() -> None:
    v = wire.PROTOCOL_VERSION
    hello = wire.Hello(protocol=v + 1, island=0, generation=1, fingerprint="f", n_fragments=1, wire_dtype="float32")
    _refused(wire.encode(hello, key=KEY), f"HELLO declares protocol {v + 1}, expected {v}", key=KEY)
    welcome = wire.Welcome(protocol=0, syncer_id=1, need_init=False, versions=(), sync_every=1, total_steps=0)
    _refused(wire.encode(welcome, key=KEY), "WELCOME declares protocol 0", key=KEY)
    env = Envelope(protocol=7, header=wire.Pull(0, 1, 0), chunk_bytes=16, tensors=())
    _refused(_forge(ENVELOPE_ENCODER.encode(env)), f"protocol version 7, expected {v}", key=KEY)
    # A future envelope of another shape still gets a version reason, not a field error.
    future = msgspec.msgpack.encode({"protocol": v + 1, "frames": [1, 2, 3]})
    _refused(_forge(future), f"protocol version {v + 1}, expected {v}", key=KEY)


def _raw_envelope(header: dict, tensors: list | None = None, **extra) -> bytes:
    env = {"protocol": wire.PROTOCOL_VERSION, "header": header, "chunk_bytes": 16, "tensors": tensors or []}
    env.update(extra)
    return msgspec.msgpack.encode(env)


def test_wrong_field_types_unknown_kind_and_unknown_fields() -> None:
    good = {"kind": "PULL", "fragment": 0, "round": 1, "attempt": 0}
    assert wire.decode(_forge(_raw_envelope(good)), key=KEY).header == wire.Pull(0, 1, 0)
    _refused(_forge(_raw_envelope({**good, "round": "1"})), r"malformed header: Expected `int`, got `str`",
             key=KEY)
    _refused(_forge(_raw_envelope({**good, "attempt": 1.0})), "malformed header", key=KEY)
    _refused(_forge(_raw_envelope({**good, "attempt": True})), "malformed header", key=KEY)
    bcast = {"kind": "BCAST", "fragment": 0, "version": 1, "round": 1, "cut": 1}
    _refused(_forge(_raw_envelope(bcast)), r"Expected `bool`, got `int`", key=KEY)
    _refused(_forge(_raw_envelope({**good, "kind": "REBOOT"})), "Invalid value 'REBOOT'", key=KEY)
    _refused(_forge(_raw_envelope({"fragment": 0, "round": 1, "attempt": 0})), "missing required field `kind`",
             key=KEY)
    _refused(_forge(_raw_envelope({**good, "extra": 1})), "unknown field `extra`", key=KEY)
    _refused(_forge(_raw_envelope(good, sneaky=1)), "unknown field `sneaky`", key=KEY)
    _refused(_forge(_raw_envelope(good, tensors=[["t", "float32", ["4"], [0]]])), "malformed header", key=KEY)
    hello = {"kind": "HELLO", "protocol": wire.PROTOCOL_VERSION, "island": 0, "generation": 1, "fingerprint": "f",
             "n_fragments": 1, "wire_dtype": "float16"}
    _refused(_forge(_raw_envelope(hello)), "HELLO wire_dtype 'float16'", key=KEY)


# --------------------------------------------------------------------------- receive pool


def test_receive_pool_reuses_freed_buffers_only() -> None:
    pool = wire.HostBufferPool(max_idle_bytes=3 << 20, min_bytes=1 << 10)
    t = torch.randn(1 << 18)  # 1 MiB
    frames = wire.encode(wire.Bcast(0, 1, 1, False), [("t", t)], chunk_bytes=1 << 16)
    first = wire.decode(frames, pool=pool).tensors[0][1]
    second = wire.decode(frames, pool=pool).tensors[0][1]
    assert pool.misses == 2 and pool.hits == 0  # both alive: distinct memory
    assert first.data_ptr() != second.data_ptr()
    ptr = first.data_ptr()
    view = first[10:]  # a view keeps the buffer in use
    del first
    assert pool.idle_bytes == 0
    del view
    assert pool.idle_bytes == 1 << 20
    third = wire.decode(frames, pool=pool).tensors[0][1]
    assert pool.hits == 1 and third.data_ptr() == ptr and torch.equal(third, t)
    del second, third
    assert pool.idle_bytes == 2 << 20
    big = wire.decode(wire.encode(wire.Pull(0, 1, 0), [("b", torch.zeros(1 << 19))]), pool=pool).tensors[0][1]
    del big  # 2 MiB more would exceed the 3 MiB cap: really freed
    assert pool.idle_bytes == 2 << 20
    pool.clear()
    assert pool.idle_bytes == 0


def test_send_tracked_is_done_only_once_every_frame_is_released() -> None:
    """A large frame followed by a small (copied) one: ``send_multipart``'s tracker is the small
    frame's and reports done at once; ``send_tracked`` waits for the large frame too."""
    import numpy as np
    import zmq

    from diloco.wire.pacing import send_tracked

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        for s in (pull, push):
            s.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.RCVBUF, 1 << 16)
        push.setsockopt(zmq.SNDBUF, 1 << 16)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        big = np.ones(16 << 20, dtype=np.uint8)  # far more than the socket buffers hold unread
        naive = push.send_multipart([memoryview(big), b"tail"], copy=False, track=True)
        assert naive.done  # the bug this guards against: only the copied tail is tracked
        tracker = send_tracked(push, [memoryview(big), b"tail"])
        assert tracker is not None and not tracker.done  # the big frame is still in zmq's hands
        for _ in range(2):
            frames = pull.recv_multipart(copy=False)
            assert [len(f.buffer) for f in frames] == [16 << 20, 4]
        tracker.wait(timeout=10)
        assert tracker.done
    finally:
        pull.close()
        push.close()
        ctx.term()


def test_copy_into_upcasts_bf16_into_fp32_exactly() -> None:
    """A bf16 tensor copied into an fp32 destination (a bf16 value landing in the anchors) holds
    bit for bit what torch's upcast gives, specials included, across chunk boundaries."""
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(3)) * 1e3
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40])
    frames = wire.encode(wire.Pull(0, 1, 0), [("x", x)], wire_dtype="bfloat16", chunk_bytes=1000)
    opened = wire.open_message(frames)
    dest = torch.full((10_001,), 7.0)
    opened.copy_into([dest])
    assert torch.equal(dest.view(torch.int32), x.to(torch.bfloat16).to(torch.float32).view(torch.int32))
    with pytest.raises(ValueError):
        opened.copy_into([torch.empty(10_001, dtype=torch.float64)])
    # Odd chunks split an element: refused before anything is written (the pooled bf16 path takes them).
    odd = wire.open_message(wire.encode(wire.Pull(0, 1, 0), [("x", x)], wire_dtype="bfloat16", chunk_bytes=999))
    untouched = torch.full((10_001,), 7.0)
    with pytest.raises(ValueError, match="odd"):
        odd.copy_into([untouched])
    assert bool((untouched == 7.0).all())
    assert torch.equal(odd.tensors()[0][1].view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_copy_into_inspects_every_copied_chunk_and_refuses_a_bad_one() -> None:
    """``inspect`` sees each chunk's destination right after its copy (upcast chunks as fp32 bits),
    and copy_into returns the largest figure; a chunk failing its digest raises instead."""
    x = torch.arange(3000, dtype=torch.float32) - 1500.0
    y = torch.arange(10, dtype=torch.float32)
    frames = wire.encode(wire.Pull(0, 1, 0), [("x", x), ("y", y)], chunk_bytes=1000)
    seen: list[int] = []

    def amax(dest: np.ndarray) -> float:
        seen.append(dest.nbytes)
        return float(np.abs(dest.view(np.float32)).max())

    dx, dy = torch.empty(3000), torch.empty(10)
    assert wire.open_message(frames).copy_into([dx, dy], inspect=amax) == 1500.0
    assert torch.equal(dx, x) and torch.equal(dy, y) and sum(seen) == 3010 * 4 and len(seen) == 12 + 1
    bf = wire.open_message(wire.encode(wire.Pull(0, 1, 0), [("x", x)], wire_dtype="bfloat16", chunk_bytes=1000))
    assert bf.copy_into([torch.empty(3000)], inspect=amax) == float(x.bfloat16().abs().max())
    assert wire.open_message(frames).copy_into([dx, dy]) == 0.0
    tampered = list(frames)
    body = bytearray(tampered[-2])
    body[0] ^= 1
    tampered[-2] = bytes(body)
    with pytest.raises(wire.WireError, match="fails its digest"):
        wire.open_message(tampered).copy_into([dx, dy], inspect=amax)
