"""Profile a running syncer from outside: CPU time per thread, and one py-spy window (device runs).

    python scripts/profile_syncer.py OUT_DIR [--delay-s 30] [--spy-s 40]

Waits (up to 10 minutes) for a process whose command line holds ``diloco.syncer``, then until it
exits samples every thread's CPU time from ``/proc/PID/task/*/stat`` once a second and writes
``OUT_DIR/threads.json`` (per thread: name, CPU seconds per one-second sample). After
``--delay-s`` it runs ``py-spy record --native`` for ``--spy-s`` seconds into
``OUT_DIR/syncer.spy.txt`` (collapsed stacks), if py-spy is installed. It prints a summary: each
thread's busiest 10-second window as a share of one core, so a saturated thread (a zmq I/O thread
at 100 %) shows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def find_syncer(timeout_s: float) -> int | None:
    """The pid of the first process whose command line holds ``diloco.syncer``."""
    deadline = time.monotonic() + timeout_s
    me = os.getpid()
    while time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == me:
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"-m diloco.syncer" in cmd:
                return int(d.name)
        time.sleep(0.2)
    return None


def thread_times(pid: int) -> dict[str, tuple[str, float]]:
    """tid -> (thread name, CPU seconds so far)."""
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (t / "stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        out[t.name] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--delay-s", type=float, default=30.0)
    p.add_argument("--spy-s", type=float, default=40.0)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    pid = find_syncer(600.0)
    if pid is None:
        print("profile_syncer: no syncer appeared", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    spy = None
    series: dict[str, dict] = {}
    last: dict[str, float] = {}
    while Path(f"/proc/{pid}").exists():
        now = time.monotonic() - t0
        try:
            times = thread_times(pid)
        except OSError:
            break
        for tid, (name, cpu) in times.items():
            s = series.setdefault(tid, {"name": name, "t": [], "cpu": []})
            s["t"].append(round(now, 2))
            s["cpu"].append(round(cpu - last.get(tid, cpu), 3))
            last[tid] = cpu
        if spy is None and now >= a.delay_s and shutil.which("py-spy"):
            spy = subprocess.Popen(["py-spy", "record", "--native", "--pid", str(pid), "--duration",
                                    str(int(a.spy_s)), "--rate", "50", "--format", "raw", "--threads",
                                    "--output", str(a.out / "syncer.spy.txt")],
                                   stdout=subprocess.DEVNULL, stderr=open(a.out / "pyspy.log", "w"))
        time.sleep(1.0)
    if spy is not None:
        try:
            spy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
    (a.out / "threads.json").write_text(json.dumps(series))
    for tid, s in sorted(series.items(), key=lambda kv: -sum(kv[1]["cpu"])):
        cpu = s["cpu"]
        best = max((sum(cpu[i : i + 10]) / 10 for i in range(max(1, len(cpu) - 9))), default=0.0)
        if sum(cpu) > 0.5:
            print(f"thread {tid} {s['name']!r}: {sum(cpu):.1f} CPU s, busiest 10 s window {100 * best:.0f} % of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
