"""Summarise py-spy raw (collapsed) stacks: samples per thread and the commonest leaf frames.

    python scripts/spy_summary.py FILE [--leaves 25] [--depth 4]
"""

from __future__ import annotations

import argparse
import collections


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("--leaves", type=int, default=25)
    ap.add_argument("--depth", type=int, default=4)
    a = ap.parse_args()
    per_thread: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[tuple[str, str]] = collections.Counter()
    with open(a.file) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not n.isdigit():
                continue
            frames = stack.split(";")
            per_thread[frames[0]] += int(n)
            leaves[(frames[0], ";".join(fr.split(" (")[0] for fr in frames[-a.depth:]))] += int(n)
    print(f"{a.file}: {sum(per_thread.values())} samples")
    for th, n in per_thread.most_common():
        print(f"  {n:6d} {th}")
    for (th, s), n in leaves.most_common(a.leaves):
        print(f"    {n:6d} {th[:32]} {s[:200]}")


if __name__ == "__main__":
    main()
