"""Peak resident memory of every process whose command line matches, sampled from /proc.

    python scripts/memwatch.py OUT.json PATTERN [PATTERN ...] [--every-s 1]

Runs until SIGTERM / SIGINT, then writes OUT.json: per process (pid, the first 160
characters of its command line) the peak VmRSS seen and its last VmHWM, a timeline of its VmRSS
(``[unix time, MiB]`` whenever it moved by 64 MiB or more since the last point kept), plus the
host's peak used memory (MemTotal − MemAvailable) and the value at start. For the device runs of the
memory issue (docs/PERFORMANCE.md): start it before the syncer and the islands, stop it after.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path


def _meminfo_used_kib() -> int:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0])
    return info["MemTotal"] - info["MemAvailable"]


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("patterns", nargs="+")
    ap.add_argument("--every-s", type=float, default=1.0)
    args = ap.parse_args()
    stop = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    procs: dict[int, dict] = {}
    host0 = host_peak = _meminfo_used_kib()
    t0 = time.monotonic()
    while not stop:
        host_peak = max(host_peak, _meminfo_used_kib())
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            pid = int(entry)
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if not any(p in cmd for p in args.patterns):
                    continue
                st = _status(pid)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            rec = procs.setdefault(pid, {"pid": pid, "cmd": cmd[:160], "peak_rss_kib": 0, "hwm_kib": 0,
                                         "first_s": round(time.monotonic() - t0, 1)})
            rec["peak_rss_kib"] = max(rec["peak_rss_kib"], st.get("VmRSS", 0))
            rec["hwm_kib"] = max(rec["hwm_kib"], st.get("VmHWM", 0))
            rec["last_s"] = round(time.monotonic() - t0, 1)
            rss_mib = st.get("VmRSS", 0) >> 10
            line = rec.setdefault("rss_mib", [])
            if not line or abs(rss_mib - line[-1][1]) >= 64:
                line.append([round(time.time(), 1), rss_mib])
        time.sleep(args.every_s)
    Path(args.out).write_text(json.dumps({"host_used_start_kib": host0, "host_used_peak_kib": host_peak,
                                          "processes": sorted(procs.values(), key=lambda r: -r["hwm_kib"])},
                                         indent=1))


if __name__ == "__main__":
    main()
