"""What the island client's chunk work costs a training loop's Python, by how it runs.

A thread launches small torch ops back to back (as a launch-bound training loop does: each op
releases the GIL and takes it back) while a second thread encodes and receives 16 MiB parts as the
client does (``encode_payload`` + ``Opened.copy_into``), paced to ``--gibps`` (0: flat out). Prints
the training thread's rate beside the client over its rate alone, and the client's throughput, for
the chunk work on the shared chunk threads (``parallel``) or inline on the client thread
(``inline``, the island's ``CHUNK_PARALLEL = False``). The last line is one JSON object.

usage: python scripts/probe_client_gil.py [--gibps 2] [--seconds 4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from diloco import wire  # noqa: E402
from probe_init import Trainer  # noqa: E402  # the thread of small torch ops

PART_ELEMS = 4 << 20  # 16 MiB of fp32


def run(mode: str, gibps: float, seconds: float) -> dict:
    parallel = mode == "parallel"
    part = torch.randn(PART_ELEMS)
    dest = torch.empty_like(part)
    header = wire.Push(island=0, generation=1, fragment=0, round=1, attempt=0, base_version=0, local_steps=1,
                       tokens=1, part=0, n_parts=1)
    opened = wire.open_message(wire.seal(header, wire.encode_payload([("w", part)])))
    part_gib = 2 * part.numel() * 4 / 2**30  # sent and received
    stop, done = threading.Event(), [0]
    t_start = [0.0]

    def client() -> None:
        while not stop.is_set():
            wire.encode_payload([("w", part)], parallel=parallel)
            opened.copy_into([dest], parallel=parallel)
            done[0] += 1
            if gibps > 0:
                wait = t_start[0] + done[0] * part_gib / gibps - time.monotonic()
                if wait > 0:
                    time.sleep(wait)

    trainer = Trainer()
    alone = trainer.rate_alone(seconds / 2)
    t_start[0] = time.monotonic()
    thread = threading.Thread(target=client, name="probe-client")
    thread.start()
    beside = trainer.rate_alone(seconds)  # on this thread, beside the client
    stop.set()
    thread.join()
    elapsed = time.monotonic() - t_start[0]
    return {"mode": mode, "train_rate_ratio": round(beside / alone, 3), "client_gibps": round(done[0] * part_gib / elapsed, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gibps", type=float, default=2.0, help="the client's pace in GiB/s, sent + received (0: flat out)")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each mode; the JSON gives their medians")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for _ in range(a.repeat):
        for mode in ("parallel", "inline"):
            row = run(mode, a.gibps, a.seconds)
            print(f"{mode:8s} training thread at {row['train_rate_ratio']:.3f} of its rate alone, "
                  f"client {row['client_gibps']:.2f} GiB/s")
            rows.append(row)
    mid = {m: round(statistics.median(r["train_rate_ratio"] for r in rows if r["mode"] == m), 3)
           for m in ("parallel", "inline")}
    print(json.dumps({"gibps": a.gibps, "train_rate_ratio_parallel": mid["parallel"],
                      "train_rate_ratio_inline": mid["inline"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
