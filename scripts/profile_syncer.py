"""Profile a running syncer (or island) from outside: CPU time per thread, one py-spy window (device runs).

    python scripts/profile_syncer.py OUT_DIR [--delay-s 30] [--spy-s 40] [--match TEXT] [--env VAR=VALUE] [--gil]

Waits (up to 10 minutes) for a process whose command line holds ``--match`` (default
``-m diloco.syncer``) and, with ``--env``, whose environment holds that pair (an island:
``--match _megatron --env YETO_ISLAND_ID=0``; of several, the one with the most threads once
``--delay-s`` passed), then until it
exits samples every thread's CPU time from ``/proc/PID/task/*/stat`` once a second and writes
``OUT_DIR/threads.json`` (per thread: name, CPU seconds per one-second sample). After
``--delay-s`` it runs ``py-spy record --native`` for ``--spy-s`` seconds into
``OUT_DIR/spy.txt`` (collapsed stacks; with ``--gil`` only the thread holding the GIL is
sampled, so each thread's share of the samples is its share of the GIL), plus one ``py-spy dump``
(``OUT_DIR/dump.txt``: the threads' Python names), if py-spy is installed. It prints a summary: each
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


def matching(match: str, env: str | None, exclude: str = "") -> list[int]:
    """Pids whose command line holds ``match`` but not ``exclude`` (when given) and (if given) whose
    environment holds ``env``."""
    me = os.getpid()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            if match.encode() not in cmd or b"profile_syncer" in cmd or (exclude and exclude.encode() in cmd):
                continue
            if env is not None and env.encode() not in (d / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        found.append(int(d.name))
    return found


def find_target(match: str, env: str | None, timeout_s: float, settle_s: float, exclude: str = "") -> int | None:
    """The matching process with the most threads, ``settle_s`` after the first one appeared."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not matching(match, env, exclude):
        time.sleep(0.2)
    time.sleep(settle_s)
    best: tuple[int, int] | None = None
    for pid in matching(match, env, exclude):
        try:
            n = len(list(Path(f"/proc/{pid}/task").iterdir()))
        except OSError:
            continue
        if best is None or n > best[0]:
            best = (n, pid)
    return None if best is None else best[1]


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
    p.add_argument("--match", default="-m diloco.syncer")
    p.add_argument("--env", default=None)
    p.add_argument("--settle-s", type=float, default=0.0, help="wait this long after the first match")
    p.add_argument("--exclude", default="", help="skip processes whose command line holds this (a launcher)")
    p.add_argument("--gil", action="store_true", help="py-spy samples only the GIL holder")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    pid = find_target(a.match, a.env, 600.0, a.settle_s, a.exclude)
    if pid is None:
        print(f"profile_syncer: no process matching {a.match!r} appeared", file=sys.stderr)
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
            with open(a.out / "dump.txt", "w") as dump:
                subprocess.run(["py-spy", "dump", "--pid", str(pid)], stdout=dump, stderr=subprocess.STDOUT,
                               timeout=30, check=False)
            spy = subprocess.Popen(["py-spy", "record", "--native", "--pid", str(pid), "--duration",
                                    str(int(a.spy_s)), "--rate", "50", "--format", "raw", "--threads",
                                    *(["--gil"] if a.gil else []), "--output", str(a.out / "spy.txt")],
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
