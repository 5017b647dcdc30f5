"""Low-bit (int8 / q4) pushes at the syncer: HELLO checks, part checks, and a bitwise fold.

Islands on ``q4`` and ``int8`` push block-quantized codes + bf16 scales part by part; an
fp32 island pushes plain segments; the syncer dequantizes each part straight into its
running sum.  The commit must equal a numpy reference that dequantizes the same bytes and
folds them in the recorded order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco import quant
from diloco.syncer.core.config import SyncerConfig
from diloco.wire import PROTOCOL_VERSION, FragmentLayout, Heartbeat, Hello, Push
from state_driver import Driver, errors, init_parts, streams

pytestmark = pytest.mark.timeout(60)

E = 4096
BLOCK = 64
SCHEMA = [("a", (5001,)), ("b", (3, 1000))]  # 8001 elements: 2 parts, an odd last part for q4
DTYPES = ["q4", "float32", "int8"]
GEN = [11, 22, 33]
CFG = SyncerConfig(islands=3, quorum=3, sync_every=2, grace_ms=0.0, quorum_timeout_s=30.0, part_elems=E,
                   quant_block=BLOCK, checkpoint_every=0, outer_lr=0.7, outer_momentum=0.9)


def peer(i: int) -> bytes:
    return bytes([i + 1]) * 4


def hello(i: int, dtype: str, block: int = BLOCK) -> Hello:
    return Hello(protocol=PROTOCOL_VERSION, island=i, generation=GEN[i], fingerprint="fp-lowbit", n_fragments=1,
                 wire_dtype=dtype, fragment_numel=(8001,), quant_block=block if dtype in quant.KINDS else 0)


def values(seed: int, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s, generator=g) * scale) for n, s in SCHEMA]


def quant_parts(i: int, dtype: str, delta: torch.Tensor, tokens: int) -> list[tuple[Push, list]]:
    layout = FragmentLayout.of(SCHEMA)
    n = layout.n_parts(E)
    out = []
    for k in range(n):
        lo, hi = layout.part_range(k, E)
        h = Push(island=i, generation=GEN[i], fragment=0, round=1, attempt=0, base_version=0, local_steps=2,
                 tokens=tokens, part=k, n_parts=n)
        if dtype in quant.KINDS:
            codes, scales = quant.quantize(delta[lo:hi].contiguous(), dtype, BLOCK)
            out.append((h, [("codes", codes), ("scales", scales)]))
        else:
            named = layout.flat_views(delta)
            out.append((h, layout.slice_part(named, k, E)))
    return out


def test_hello_checks_the_push_dtype_and_block() -> None:
    d = Driver(CFG)
    assert errors(d.send(peer(0), hello(0, "q4", block=128))) == ["bad_quant"]
    assert errors(d.send(peer(0), hello(0, "int8", block=32))) == ["bad_quant"]
    assert errors(d.send(peer(0), hello(0, "q4"))) == []


def test_mixed_low_bit_and_fp32_pushes_fold_bitwise() -> None:
    d = Driver(CFG)
    for i, dt in enumerate(DTYPES):
        assert errors(d.send(peer(i), hello(i, dt))) == []
    d.send_all(peer(0), init_parts(0, 1, values(0), E, generation=GEN[0]))
    assert d.st.initialised
    for step in (0, 2):  # a HELLO alone is not membership: every island heartbeats before the round opens
        for i in range(3):
            d.send(peer(i), Heartbeat(island=i, generation=GEN[i], step=step))
    assert 1 in d.st.rounds
    v0 = d.st.fragments[0].value.numpy().copy()
    deltas = {i: torch.cat([t.reshape(-1) for _n, t in values(100 + i, 0.01)]) for i in range(3)}
    tokens = {0: 300, 1: 500, 2: 700}
    msgs = {i: quant_parts(i, DTYPES[i], deltas[i], tokens[i]) for i in range(3)}
    # Interleave: island 2 part 0, island 0 part 0, island 1 part 1 ... (islands' parts cross).
    order = [(2, 0), (0, 0), (1, 0), (0, 1), (2, 1), (1, 1)]
    out = []
    for i, k in order:
        h, ts = msgs[i][k]
        out += d.send(peer(i), h, ts, now=1.0)
    assert errors(out) == []
    ev = d.st.events[-1]
    assert ev["changed"] and ev["round"] == 1
    fold = ev["fold_order"]
    per_part = fold if fold and isinstance(fold[0], list) else [fold, fold]
    assert per_part == [[2, 0, 1], [0, 2, 1]]
    # numpy reference: dequantize the very bytes sent, fold per part in the recorded order.
    layout = FragmentLayout.of(SCHEMA)
    s = np.zeros(layout.numel, dtype=np.float32)
    for k, islands in enumerate(per_part):
        lo, hi = layout.part_range(k, E)
        first = True
        for i in islands:
            h, ts = msgs[i][k]
            if DTYPES[i] in quant.KINDS:
                x = quant.dequantize(ts[0][1], ts[1][1], DTYPES[i], BLOCK, hi - lo).numpy()
                prod = x * np.float32(tokens[i])
                s[lo:hi] = (np.float32(0) + prod) if first else s[lo:hi] + prod
            else:
                prod = deltas[i][lo:hi].numpy() * np.float32(tokens[i])
                s[lo:hi] = prod if first else s[lo:hi] + prod
            first = False
    g = -(s / np.float32(sum(tokens.values())))
    m = np.float32(0.9) * np.zeros_like(s) + g
    want = v0 - np.float32(0.7) * (g + np.float32(0.9) * m)
    got = d.st.fragments[0].value.numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # Broadcasts stay fp32 / bf16: the q4 and int8 islands get bf16 values.
    bcast = {o.peer: o.wire_dtype for o in streams(out)}
    assert bcast == {peer(0): "bfloat16", peer(1): "float32", peer(2): "bfloat16"}


def test_malformed_low_bit_parts_are_refused_and_change_nothing() -> None:
    d = Driver(CFG)
    for i, dt in enumerate(DTYPES):
        d.send(peer(i), hello(i, dt))
    d.send_all(peer(0), init_parts(0, 1, values(0), E, generation=GEN[0]))
    for i in range(3):
        d.send(peer(i), Heartbeat(island=i, generation=GEN[i], step=2))
    delta = torch.cat([t.reshape(-1) for _n, t in values(7, 0.01)])
    h, ts = quant_parts(0, "q4", delta, 10)[0]
    codes, scales = ts[0][1], ts[1][1]
    # Structure: wrong names, sizes or dtypes are refused before any byte is read.
    assert errors(d.send(peer(0), h, [("codes", codes[:-1]), ("scales", scales)])) == ["bad_part"]
    assert errors(d.send(peer(0), h, [("scales", scales), ("codes", codes)])) == ["bad_part"]
    assert errors(d.send(peer(0), h, [("codes", codes), ("scales", scales.float())])) == ["bad_part"]
    assert d.st.rounds[1].pushes == {}
    # Values: a scale above the format's bound passes the structure check and is refused by
    # the data plane, which drops the attempt (nothing of it was folded) and re-pulls.
    bad = scales.clone()
    bad[3] = float("inf")
    out = d.send(peer(0), h, [("codes", codes), ("scales", bad)])
    assert errors(out) == ["bad_push"] and d.st.rounds[1].attempt == 1


@pytest.mark.parametrize("dtype", ["q4", "int8"])
def test_an_absurd_low_bit_delta_is_refused_by_the_part_bounds(dtype: str) -> None:
    """A low-bit delta of 1e30 is well-formed (its scales are below the format's bound) but holds
    elements beyond the syncer's bound: refused before its chunk is folded, charged to its island."""
    d = Driver(CFG)
    for i, dt in enumerate(DTYPES):
        d.send(peer(i), hello(i, dt))
    d.send_all(peer(0), init_parts(0, 1, values(0), E, generation=GEN[0]))
    for step in (0, 2):  # every island heartbeats after WELCOME, then the round opens
        for j in range(3):
            d.send(peer(j), Heartbeat(island=j, generation=GEN[j], step=step))
    assert 1 in d.st.rounds
    i = DTYPES.index(dtype)
    delta = torch.cat([t.reshape(-1) for _n, t in values(7, 1e30)])
    out = []
    for h, ts in quant_parts(i, dtype, delta, 10):
        out += d.send(peer(i), h, ts)
    out += d.run(1.0)
    assert "bad_push" in errors(out) and d.st.rounds[1].attempt == 1
    assert f"i{i}:refused1" in d.st.reference.summary()
