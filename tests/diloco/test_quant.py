"""Low-bit codec (the diloco.quant package) against an independent numpy reference, bit for bit.

The reference below is written from the format in docs/PROTOCOL.md ("Low-bit
pushes"), not from the implementation: it pads the short last block, rounds
the scale up to bf16 by truncate-then-bump, divides with numpy's IEEE fp32
division and rounds with ``np.rint`` (half to even).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco import quant
from diloco.quant import ErrorFeedback, QuantError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["big_chunks", "small_chunks"])
def chunking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a test with the default cache chunk and with a tiny one (many chunks per range)."""
    if request.param == "small_chunks":
        monkeypatch.setattr(quant.kernels, "_CPU_CHUNK", 256)

QMAX = {"int8": 127, "q4": 7}


def ref_quantize(x: np.ndarray, kind: str, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (codes uint8, scale bits uint16, q int per element) per the documented format."""
    assert x.dtype == np.float32
    n = x.size
    nb = -(-n // block)
    blocks = np.zeros(nb * block, np.float32)
    blocks[:n] = x
    blocks = blocks.reshape(nb, block)
    a = np.max(np.abs(blocks), axis=1)
    t = a / np.float32(QMAX[kind])
    assert t.dtype == np.float32
    trunc = t.view(np.uint32) & np.uint32(0xFFFF0000)
    bumped = np.where(trunc.view(np.float32) < t, trunc + np.uint32(0x10000), trunc).astype(np.uint32)
    s = bumped.view(np.float32)
    # The scale is the SMALLEST bf16 >= t: the previous bf16 is below t.
    assert np.all(s >= t)
    prev = np.where(bumped > 0, bumped - np.uint32(0x10000), 0).astype(np.uint32).view(np.float32)
    assert np.all((bumped == 0) | (prev < t))
    with np.errstate(divide="ignore", invalid="ignore"):
        y = blocks / s[:, None]
    # q is an integer: a -0.0 quotient is the integer 0 (dequantizes to +0.0).
    q = np.where(s[:, None] == 0, np.float32(0), np.rint(y)).reshape(-1)[:n].astype(np.int64)
    assert np.all(np.abs(q) <= QMAX[kind]), "the format promises no clamp is needed"
    if kind == "int8":
        codes = q.astype(np.int8).view(np.uint8)  # two's complement
    else:
        c = (q + 8).astype(np.uint8)
        if n % 2:
            c = np.concatenate([c, np.zeros(1, np.uint8)])
        codes = (c[0::2] | (c[1::2] << 4)).astype(np.uint8)
    return codes, (bumped >> 16).astype(np.uint16), q


def ref_dequantize(q: np.ndarray, scale_bits: np.ndarray, block: int) -> np.ndarray:
    s = (scale_bits.astype(np.uint32) << 16).view(np.float32)
    per_elem = np.repeat(s, block)[: q.size]
    return q.astype(np.float32) * per_elem


def flat_fragment(seed: int) -> np.ndarray:
    """Tensors of odd sizes and very different magnitudes concatenated: blocks span boundaries."""
    rng = np.random.default_rng(seed)
    parts = [
        rng.standard_normal((37, 129)).astype(np.float32).ravel() * np.float32(1e-3),
        np.array([1.7e38], np.float32),  # huge, alone in a tensor but not in its block
        rng.standard_normal(4097).astype(np.float32),
        np.zeros(300, np.float32),  # whole zero blocks
        (rng.standard_normal(301) * 1e-39).astype(np.float32),  # subnormals
        (rng.standard_t(2, 5003) * 1e4).astype(np.float32),  # heavy tails
        rng.uniform(-1, 1, 1001).astype(np.float32) * np.float32(1e-20),
        np.array([-(2.0**127), 1e-30, 1e30], np.float32),  # the largest admitted value next to tiny ones
        np.array([1.4e-45, -1.4e-45, -0.0, 0.0, 5e-45, 1e-44, 2.9e-39], np.float32),  # the tiniest values
    ]
    return np.concatenate(parts)


def torch_bits(codes: torch.Tensor, scales: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    return codes.cpu().numpy(), scales.cpu().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("kind", ["int8", "q4"])
@pytest.mark.parametrize("block", [8, 64, 128, 256, 4096])
def test_quantize_matches_reference_bitwise(kind: str, block: int, chunking: None) -> None:
    x = flat_fragment(block)
    for n in (x.size, x.size - 1, 1, 2, 3, block - 1, block, block + 1, 3 * block + 5):
        xs = np.ascontiguousarray(x[-n:])  # ends with the extreme values, short last block
        codes, scales = quant.quantize(torch.from_numpy(xs.copy()), kind, block)
        rc, rs, q = ref_quantize(xs, kind, block)
        c, s = torch_bits(codes, scales)
        assert codes.numel() + 2 * scales.numel() == quant.wire_nbytes(kind, n, block)
        assert np.array_equal(s, rs), f"scales differ at n={n}"
        assert np.array_equal(c, rc), f"codes differ at n={n}"
        deq = quant.dequantize(codes, scales, kind, block, n).numpy()
        assert np.array_equal(deq.view(np.uint32), ref_dequantize(q, rs, block).view(np.uint32))


@pytest.mark.parametrize("kind", ["int8", "q4"])
def test_blocks_whose_scale_underflows_to_zero(kind: str) -> None:
    """absmax / qmax rounds to fp32 zero: scale 0, every q is 0 (the residual keeps the values)."""
    tiny = np.array([1.4e-45, -1.4e-45, 0.0, -0.0, 2.8e-45, 0.0, 0.0, 1.4e-45], np.float32)
    x = np.concatenate([tiny, np.full(8, -0.0, np.float32), np.ones(3, np.float32)])
    codes, scales = quant.quantize(torch.from_numpy(x.copy()), kind, 8)
    rc, rs, q = ref_quantize(x, kind, 8)
    c, s = torch_bits(codes, scales)
    assert np.array_equal(c, rc) and np.array_equal(s, rs)
    assert s[0] == 0 and s[1] == 0 and s[2] != 0
    deq = quant.dequantize(codes, scales, kind, 8, x.size).numpy()
    assert np.array_equal(deq[:16].view(np.uint32), np.zeros(16, np.uint32))


@pytest.mark.parametrize("kind", ["int8", "q4"])
def test_error_is_at_most_half_a_step(kind: str) -> None:
    x = flat_fragment(1)
    block = 64
    codes, scales = quant.quantize(torch.from_numpy(x.copy()), kind, block)
    deq = quant.dequantize(codes, scales, kind, block, x.size).numpy().astype(np.float64)
    step = np.repeat(scales.float().numpy().astype(np.float64), block)[: x.size]
    assert np.all(np.abs(deq - x.astype(np.float64)) <= step / 2)


@pytest.mark.parametrize("kind", ["int8", "q4"])
def test_parts_quantize_like_the_whole_fragment(kind: str) -> None:
    """A part starting at a multiple of 4096 elements gives exactly the whole fragment's bytes."""
    x = torch.from_numpy(flat_fragment(2))
    block = 128
    codes, scales = quant.quantize(x, kind, block)
    per_byte = 1 if kind == "int8" else 2
    bounds = list(range(0, x.numel(), 2 * quant.PART_ALIGN)) + [x.numel()]
    for lo, hi in zip(bounds, bounds[1:]):
        pc, ps = quant.quantize(x[lo:hi].contiguous(), kind, block)
        assert torch.equal(pc, codes[lo // per_byte : lo // per_byte + pc.numel()])
        assert torch.equal(ps.view(torch.int16), scales[lo // block : hi // block + 1][: ps.numel()].view(torch.int16))


def test_reused_outputs() -> None:
    x = torch.from_numpy(flat_fragment(9))
    codes, scales = quant.quantize(x, "q4", 64)
    c_out = torch.full_like(codes, 0xAA)
    s_out = torch.full_like(scales, 5.0)
    c2, s2 = quant.quantize(x, "q4", 64, codes_out=c_out, scales_out=s_out)
    assert c2 is c_out and s2 is s_out
    assert torch.equal(c_out, codes) and torch.equal(s_out.view(torch.int16), scales.view(torch.int16))
    with pytest.raises(QuantError, match="codes_out"):
        quant.quantize(x, "q4", 64, codes_out=c_out[1:])
    with pytest.raises(QuantError, match="scales_out"):
        quant.quantize(x, "q4", 64, scales_out=s_out.float())


def test_q4_nibble_order_and_padding() -> None:
    x = torch.tensor([7.0, -7.0, 0.0], dtype=torch.float32)  # absmax 7 -> scale 1
    codes, scales = quant.quantize(x, "q4", 8)
    assert scales.float().tolist() == [1.0]
    # element 0 (q=7, code 15) low nibble, element 1 (q=-7, code 1) high nibble; pad nibble 0
    assert codes.tolist() == [0x1F, 0x08]


@pytest.mark.parametrize("kind", ["int8", "q4"])
@pytest.mark.parametrize("weight", [1.0, -1.0, 3.0, 700001.0, 0.37])
def test_fold_matches_reference_bitwise(kind: str, weight: float, chunking: None) -> None:
    block = 64
    x = flat_fragment(3)
    n = x.size
    rng = np.random.default_rng(4)
    codes, scales = quant.quantize(torch.from_numpy(x.copy()), kind, block)
    _, rs, q = ref_quantize(x, kind, block)
    big = torch.from_numpy(rng.standard_normal(n + 4096).astype(np.float32))
    start = big[4096:].numpy().copy()
    quant.dequantize_fold(codes, scales, kind, block, big[4096:], weight)  # a view, like a part of the sum
    with np.errstate(over="ignore"):  # 1.7e38 * 3 is inf on both sides
        expect = start + ref_dequantize(q, rs, block) * np.float32(weight)
    assert np.array_equal(big[4096:].numpy().view(np.uint32), expect.view(np.uint32))


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "q4"])
def test_error_feedback_sum_of_pushes_tracks_sum_of_deltas(kind: str, residual_dtype: torch.dtype,
                                                           chunking: None) -> None:
    rng = np.random.default_rng(5)
    block, n, rounds = 64, 3 * 4096 + 77, 200
    ef = ErrorFeedback(kind, block, residual_dtype=residual_dtype)
    tol = 1e-6 if residual_dtype == torch.float32 else 2.0**-8  # bf16 storage rounds the residual
    sent = np.zeros(n, np.float64)
    true = np.zeros(n, np.float64)
    # A slowly drifting direction plus noise, and a block where one large value
    # hides small ones below half a step: without feedback those never move.
    drift = rng.standard_normal(n).astype(np.float32) * np.float32(0.01)
    last_step = np.zeros(n)
    for r in range(rounds):
        delta = (drift + rng.standard_normal(n).astype(np.float32) * np.float32(0.003)).astype(np.float32)
        delta[:block] = np.float32(0.001)
        delta[0] = np.float32(1.0)
        codes, scales = ef.encode(0, torch.from_numpy(delta.copy()))
        sent += quant.dequantize(codes, scales, kind, block, n).numpy()
        true += delta
        last_step = np.repeat(scales.float().numpy().astype(np.float64), block)[:n]
        residual = ef.residual(0)
        assert residual is not None
        assert np.all(np.abs(residual.float().numpy()) <= last_step / 2 * (1 + tol))
    assert np.all(np.abs(sent - true) <= last_step * (1 + tol))
    # The hidden small values did arrive (q4: 0.001 < half a step of 1/7).
    assert abs(sent[1] - rounds * 0.001) <= last_step[1]
    ef.reset(0)
    assert ef.residual(0) is None


@pytest.mark.parametrize("kind", ["int8", "q4"])
def test_error_feedback_matches_reference_bitwise(kind: str, chunking: None) -> None:
    """Codes of Q(delta + r) and the new residual (delta + r) - x', against numpy, round after round."""
    block = 64
    x = flat_fragment(11)
    x[x.size // 2] = -0.0
    n = x.size
    rng = np.random.default_rng(12)
    ef = ErrorFeedback(kind, block, residual_dtype=torch.float32)  # the exact carry, bit for bit
    r = np.zeros(n, np.float32)
    for _ in range(4):
        delta = (x * rng.uniform(0.2, 0.5, n).astype(np.float32)).astype(np.float32)  # v stays <= 2^127
        codes, scales = ef.encode(1, torch.from_numpy(delta.copy()))
        v = delta + r
        rc, rs, q = ref_quantize(v, kind, block)
        c, s = torch_bits(codes, scales)
        assert np.array_equal(c, rc) and np.array_equal(s, rs)
        deq = ref_dequantize(q, rs, block)
        r = v - deq
        # v - x' is exact (Sterbenz for |q| >= 1, trivial for q = 0): nothing is lost but the residual.
        assert np.array_equal(r.astype(np.float64) + deq.astype(np.float64), v.astype(np.float64))
        got = ef.residual(1)
        assert got is not None
        # + 0.0 maps -0.0 to +0.0: the sign of a zero residual is unspecified (it never changes a code)
        assert np.array_equal((got.numpy() + np.float32(0)).view(np.uint32), (r + np.float32(0)).view(np.uint32))


def test_error_feedback_parts_equal_whole(chunking: None) -> None:
    """Encoding part by part (offsets) keeps the same residual as encoding the fragment at once."""
    rng = np.random.default_rng(6)
    n = 3 * 4096 + 5
    whole, parted = ErrorFeedback("q4", 64), ErrorFeedback("q4", 64)
    for _ in range(3):
        delta = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        wc, ws = whole.encode(7, delta)
        pcs, pss = [], []
        for lo in range(0, n, 4096):
            c, s = parted.encode(7, delta[lo : lo + 4096].contiguous(), offset=lo, fragment_numel=n)
            pcs.append(c)
            pss.append(s)
        assert torch.equal(torch.cat(pcs), wc)
        assert torch.equal(torch.cat(pss).view(torch.int16), ws.view(torch.int16))
    r1, r2 = whole.residual(7), parted.residual(7)
    assert r1 is not None and r2 is not None and torch.equal(r1, r2)


def test_refusals() -> None:
    x = torch.ones(100)
    for bad in ("fp8", "bf16"):
        with pytest.raises(QuantError, match="kind"):
            quant.quantize(x, bad, 64)
    for block in (0, 4, 48, 8192, True):
        with pytest.raises(QuantError, match="block size"):
            quant.quantize(x, "q4", block)  # type: ignore[arg-type]
    for v in (float("nan"), float("inf"), float("-inf")):
        y = torch.ones(1000)
        y[517] = v
        with pytest.raises(QuantError, match="non-finite"):
            quant.quantize(y, "q4", 64)
    for v in (2.0**127 * 1.01, -float(np.finfo(np.float32).max)):
        y = torch.ones(1000)
        y[3] = v
        with pytest.raises(QuantError, match="exceeds"):
            quant.quantize(y, "int8", 64)
    with pytest.raises(QuantError, match="fp32"):
        quant.quantize(x.double(), "int8", 64)
    codes, scales = quant.quantize(torch.ones(129), "q4", 64)
    with pytest.raises(QuantError, match="bytes"):
        quant.dequantize(codes[:-1], scales, "q4", 64, 129)
    with pytest.raises(QuantError, match="scales"):
        quant.dequantize(codes, scales[:-1], "q4", 64, 129)
    for bad_scale in (-1.0, float("inf"), float("nan"), 1e38):
        s = scales.clone()
        s[1] = bad_scale
        with pytest.raises(QuantError, match="scale"):
            quant.dequantize(codes, s, "q4", 64, 129)
    c = codes.clone()
    c[-1] |= 0x30
    with pytest.raises(QuantError, match="padding"):
        quant.dequantize(c, scales, "q4", 64, 129)
    ef = ErrorFeedback("q4", 64)
    ef.encode(3, torch.ones(100))
    with pytest.raises(QuantError, match="non-finite"):
        ef.encode(3, torch.full((100,), float("nan")))
    assert ef.residual(3) is None  # a half-updated residual is dropped, not kept
    with pytest.raises(QuantError, match="offset"):
        ErrorFeedback("q4", 64).encode(0, torch.ones(10), offset=10, fragment_numel=100)


def test_empty_range() -> None:
    codes, scales = quant.quantize(torch.empty(0), "q4", 64)
    assert codes.numel() == 0 and scales.numel() == 0
    assert quant.dequantize(codes, scales, "q4", 64, 0).numel() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["int8", "q4"])
def test_cuda_bytes_equal_cpu_bytes(kind: str) -> None:
    x = torch.from_numpy(flat_fragment(8))
    codes, scales = quant.quantize(x, kind, 64)
    gc, gs = quant.quantize(x.cuda(), kind, 64)
    assert torch.equal(gc.cpu(), codes) and torch.equal(gs.cpu().view(torch.int16), scales.view(torch.int16))
    out = torch.zeros(x.numel())
    gout = out.cuda()
    quant.dequantize_fold(codes, scales, kind, 64, out, 3.0)
    quant.dequantize_fold(gc, gs, kind, 64, gout, 3.0)
    assert torch.equal(gout.cpu().view(torch.int32), out.view(torch.int32))
