"""What a fork costs a process holding page-locked host memory (device host probe).

    python scripts/probe_fork.py [--gib 10]

Allocates ``--gib`` of host memory registered with cudaHostRegister, once plain and once through
``gloo_bridge.device.host_buffer`` (which also marks it ``MADV_DONTFORK``), touches it, and
times ``fork()`` + the child's ``_exit`` + ``waitpid`` three times each (megatron's checkpoint
writers and data-loader workers are forked children). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from gloo_bridge import device


def _fork_s() -> float:
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=10.0)
    n = int(p.parse_args().gib * 2**30)
    out: dict[str, object] = {"gib": n / 2**30, "baseline_s": [round(_fork_s(), 4) for _ in range(3)]}
    plain = torch.ones(n, dtype=torch.uint8)
    out["pageable_s"] = [round(_fork_s(), 4) for _ in range(3)]
    assert int(torch.cuda.cudart().cudaHostRegister(plain.data_ptr(), n, 0)) == 0
    out["registered_s"] = [round(_fork_s(), 4) for _ in range(3)]
    torch.cuda.cudart().cudaHostUnregister(plain.data_ptr())
    del plain
    buf = device.host_buffer(n, pinned=True)
    buf.fill_(1)
    out["registered_dontfork_s"] = [round(_fork_s(), 4) for _ in range(3)]
    device.free_host_buffer(buf)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
