"""Benchmarks of the low-bit push codec (diloco.quant), each against a baseline measured in the same run.

(a) Bytes: ``q4_bytes_vs_fp32`` and ``int8_bytes_vs_fp32`` = wire bytes of a
    push (codes + bf16 scales) / fp32 bytes, at the chosen block size
    (targets <= 0.14 and <= 0.27). Exact arithmetic, printed for every block
    size of the sweep next to the quantization error, which is how the
    default block size was chosen.

(b) Throughput: ``q4_pack_gbps_cpu`` = GB/s of fp32 input that ``quantize``
    (absmax, scales, divide, round, pack) turns into q4 codes on ONE CPU core
    (``torch.set_num_threads(1)``), target >= 1. Baseline: a plain fp32 copy
    of the same bytes into a preallocated tensor, timed alternately with it;
    ``q4_pack_vs_copy_cpu`` = copy_time / pack_time. The same for ``int8``,
    for the syncer's ``dequantize_fold`` (baseline: ``out.add_(delta)``, the
    fp32 push's fold) and for the island's ``ErrorFeedback.encode``.
    With ``--device cuda`` the same figures on the GPU (``*_gpu``; target
    ``q4_pack_gbps_gpu`` >= 100 on an H200), synchronised around each timed
    call after warm-up; the CPU figures are measured too.

(c) Quality per block size: relative RMS error ||x' - x|| / ||x|| of one
    push on synthetic pseudo-gradients (rows of 1024 with log-normal row
    scales and Student-t(4) entries, a stand-in for a delta's heavy tails and
    per-row spread). Smaller blocks: smaller error, more scale bytes.

Usage::

    python benchmarks/bench_lowbit.py [--mib 256] [--repeat 5] [--device cpu|cuda] [--block 64]

Human-readable lines first; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diloco import quant  # noqa: E402

SWEEP_BLOCKS = (32, 64, 128, 256)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call of ``fn``, synchronised before and after on CUDA."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


_BEST: dict[str, float] = {}
"""Fastest repetition of the last ``_paired`` call's ``ours`` (key ``"ours"``): on a shared,
loaded machine the median measures the neighbours; the best run is the closest to one free core."""


def _paired(
    ours: Callable[[], object], base: Callable[[], object], device: torch.device, repeat: int
) -> tuple[float, float]:
    """Median seconds of ``ours`` and ``base``, timed alternately after one warm-up each."""
    ours()
    base()
    t_ours, t_base = [], []
    for _ in range(repeat):
        t_ours.append(_time(ours, device))
        t_base.append(_time(base, device))
    _BEST["ours"] = min(t_ours)
    return statistics.median(t_ours), statistics.median(t_base)


def pseudo_gradient(n: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """A delta-like fp32 vector: rows of 1024, log-normal row scales, Student-t(4) entries."""
    gen = torch.Generator().manual_seed(seed)
    rows = -(-n // 1024)
    scale = torch.exp(torch.randn(rows, 1, generator=gen))
    # Student-t(4) = normal / sqrt(chi2_4 / 4); chi2_4 = sum of 4 squared normals.
    chi = torch.randn(rows, 1024, 4, generator=gen).square_().sum(-1).div_(4).sqrt_()
    x = torch.randn(rows, 1024, generator=gen).div_(chi).mul_(scale).mul_(1e-3)
    return x.view(-1)[:n].contiguous().to(device)


def bench_quality(block_choice: int, n: int = 1 << 22) -> dict[str, object]:
    """Bytes ratio, relative RMS error and 1-core speed (best of 3) per kind and block size (CPU, ``n`` elements)."""
    x = pseudo_gradient(n, torch.device("cpu"), seed=1)
    norm = float(x.double().norm())
    table: dict[str, dict[str, float]] = {}
    print(f"{'kind':>5} {'block':>5} {'bytes/fp32':>10} {'rel. RMS err':>12} {'GB/s 1 core':>11}")
    cpu = torch.device("cpu")
    for kind in quant.KINDS:
        for block in SWEEP_BLOCKS:
            codes, scales = quant.quantize(x, kind, block)
            deq = quant.dequantize(codes, scales, kind, block, x.numel())
            err = float((deq.double() - x.double()).norm()) / norm
            ratio = quant.wire_nbytes(kind, x.numel(), block) / (4 * x.numel())
            best = min(
                _time(lambda: quant.quantize(x, kind, block, codes_out=codes, scales_out=scales), cpu)
                for _ in range(3)
            )
            gbps = 4 * x.numel() / best / 1e9
            table[f"{kind}_b{block}"] = {
                "bytes_vs_fp32": round(ratio, 5),
                "rel_rms_err": round(err, 5),
                "pack_gbps_cpu": round(gbps, 3),
            }
            mark = "  <- default" if block == block_choice else ""
            print(f"{kind:>5} {block:>5} {ratio:>10.4f} {err:>12.5f} {gbps:>11.2f}{mark}")
    return {"quality_sweep": table}


def bench_throughput(device: torch.device, mib: int, repeat: int, block: int) -> dict[str, float]:
    """Quantize, fold and encode throughput on ``device`` against copy/add baselines."""
    suffix = "gpu" if device.type == "cuda" else "cpu"
    n = (mib << 20) // 4
    x = pseudo_gradient(n, device, seed=2)
    dst = torch.empty_like(x)
    acc = torch.zeros_like(x)
    gb = 4 * n / 1e9
    out: dict[str, float] = {}
    t_copy = None
    for kind in quant.KINDS:
        # Steady state: output buffers reused push after push (the island's part buffers).
        codes, scales = quant.quantize(x, kind, block)
        t_q, t_copy = _paired(
            lambda: quant.quantize(x, kind, block, codes_out=codes, scales_out=scales),
            lambda: dst.copy_(x),
            device,
            repeat,
        )
        out[f"{kind}_pack_gbps_{suffix}"] = round(gb / t_q, 3)
        out[f"{kind}_pack_gbps_{suffix}_best"] = round(gb / _BEST["ours"], 3)
        out[f"{kind}_pack_vs_copy_{suffix}"] = round(t_copy / t_q, 3)
        print(
            f"{suffix}: quantize {kind:>4} {mib} MiB: {t_q * 1e3:8.1f} ms = {gb / t_q:7.2f} GB/s "
            f"(best {gb / _BEST['ours']:.2f}) "
            f"(fp32 copy {t_copy * 1e3:.1f} ms = {gb / t_copy:.2f} GB/s; copy/quantize {t_copy / t_q:.3f})"
        )
        # Fresh outputs every call: on CPU the page faults of the new codes are extra.
        t_fresh, _ = _paired(lambda: quant.quantize(x, kind, block), lambda: None, device, repeat)
        out[f"{kind}_pack_gbps_{suffix}_fresh_out"] = round(gb / t_fresh, 3)
        print(f"{suffix}: quantize {kind:>4} into fresh outputs: {t_fresh * 1e3:8.1f} ms = {gb / t_fresh:7.2f} GB/s")
        t_f, t_add = _paired(
            lambda: quant.dequantize_fold(codes, scales, kind, block, acc, 3.0), lambda: acc.add_(x), device, repeat
        )
        out[f"{kind}_fold_gbps_{suffix}"] = round(gb / t_f, 3)
        out[f"{kind}_fold_vs_fp32_add_{suffix}"] = round(t_add / t_f, 3)
        print(
            f"{suffix}: fold     {kind:>4} {mib} MiB: {t_f * 1e3:8.1f} ms = {gb / t_f:7.2f} GB/s of fp32 output "
            f"(fp32 add_ {t_add * 1e3:.1f} ms; add/fold {t_add / t_f:.3f})"
        )
    ef = quant.ErrorFeedback("q4", block)
    t_ef, t_copy2 = _paired(lambda: ef.encode(0, x), lambda: dst.copy_(x), device, repeat)
    out[f"q4_ef_encode_gbps_{suffix}"] = round(gb / t_ef, 3)
    print(f"{suffix}: ErrorFeedback.encode q4: {t_ef * 1e3:8.1f} ms = {gb / t_ef:7.2f} GB/s (copy {t_copy2 * 1e3:.1f} ms)")
    if t_copy is not None:
        out[f"fp32_copy_gbps_{suffix}"] = round(gb / t_copy, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="fp32 MiB per push in the throughput runs")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions (median)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--block", type=int, default=quant.DEFAULT_BLOCK, help="elements per scale")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (1 MiB, 1 repetition): checks the benchmark runs")
    args = ap.parse_args()
    if args.smoke:
        args.mib, args.repeat = 1, 1
    quant.check_block(args.block)
    torch.set_num_threads(1)  # the CPU figures are per core
    result: dict[str, object] = {
        "block": args.block,
        "q4_bytes_vs_fp32": round(quant.wire_nbytes("q4", 1 << 20, args.block) / (4 << 20), 5),
        "int8_bytes_vs_fp32": round(quant.wire_nbytes("int8", 1 << 20, args.block) / (4 << 20), 5),
    }
    result.update(bench_quality(args.block, 1 << 16 if args.smoke else 1 << 22))
    result.update(bench_throughput(torch.device("cpu"), args.mib, args.repeat, args.block))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no CUDA device")
        result["gpu"] = torch.cuda.get_device_name()
        result.update(bench_throughput(torch.device("cuda"), args.mib, args.repeat, args.block))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
