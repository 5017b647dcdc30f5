"""A real syncer and 2 real islands, each behind its own emulated slow link (tests/support/linkemu.py).

Scaled from issue 27's 256 MiB model at 10 MB/s / 50 ms (where island 1 rejoined for nothing
while island 0's INIT was still streaming): a 4 MiB model at 1 MB/s / 50 ms, with the islands'
silence rule at 2 s, so start-up (INIT, then the cut) takes several times that rule while bytes
keep moving.  Checked: no island rejoins (one TCP connection per island through its link),
the islands end bitwise identical with the syncer's final checkpoint, and the syncer names the
link as too slow for H together with the fix.  Then connection resets in the middle of a push
and of a cut: the island recovers, nothing is lost or merged twice, and the end state is equal.
And a stall of island 0's INIT (its link down for several silence rules): island 1, whose cut
waits for that INIT over a healthy link, does not redial.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))
import linkemu  # noqa: E402
import wan_harness  # noqa: E402

pytestmark = [pytest.mark.integ, pytest.mark.timeout(240)]

SLOW = linkemu.LinkSpec(up_bytes_s=1e6, down_bytes_s=1e6, delay_s=0.05)


def _settings(**kw: object) -> wan_harness.WanRun:
    base = dict(model_mib=4, links=[SLOW, SLOW], steps=30, sync_every=10, fragments=2, step_s=0.1,
                sync_timeout_s=2.0, heartbeat_s=0.25, part_mib=0.25, timeout_s=180.0)
    base.update(kw)
    return wan_harness.WanRun(**base)  # type: ignore[arg-type]


def _check_identical(res: wan_harness.WanResult) -> None:
    for i, code in enumerate(res.island_codes):
        assert code == 0, res.island_logs[i][-3000:]
    assert res.syncer_code == 0, res.syncer_log[-3000:]
    a, b = res.islands
    assert a["versions"] == b["versions"] and a["digest"] == b["digest"]
    assert res.checkpoint is not None
    from diloco.digest import combined_digest

    versions, digests = res.checkpoint
    assert versions == a["versions"] and combined_digest(digests) == a["digest"]


def _commits(res: wan_harness.WanResult) -> list[dict]:
    events = [json.loads(line) for line in (res.out / "events.jsonl").read_text().splitlines()]
    return [e for e in events if "pushed" in e]  # commit events (the log also holds other kinds)


def _start_record(res: wan_harness.WanResult, i: int) -> dict:
    """Island ``i``'s step-log record of start-up (phase ``start``)."""
    lines = (res.out / f"island{i}.steplog.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, lines) if r["phase"] == "start")


def test_slow_links_never_rejoin_and_the_syncer_names_the_fix(tmp_path: Path) -> None:
    # Every island downloads its cut here (no claims), so start-up carries INIT up, then the cut down.
    res = wan_harness.run(_settings(skip_matching_cut=False), tmp_path)
    _check_identical(res)
    assert [r["redials"] for r in res.islands] == [0, 0], [log[-2000:] for log in res.island_logs]
    assert [s.connections for s in res.links] == [2, 1]  # island 0: its session and its INIT lane
    assert all("rejoining" not in log and "redialing" not in log for log in res.island_logs)
    # Start-up waited far longer than the islands' 2 s silence rule: the notices carried it.
    assert max(r["start_s"] for r in res.islands) > 2 * 2.0
    assert "link carries" in res.syncer_log and "raise --sync-every to >=" in res.syncer_log
    assert "YETO_WIRE_DTYPE=q4" in res.syncer_log
    commits = _commits(res)
    assert sorted(c["round"] for c in commits) == list(range(1, len(commits) + 1))  # each round once


@pytest.mark.parametrize("where", ["push", "cut"])
def test_a_reset_mid_push_or_mid_cut_loses_and_doubles_nothing(tmp_path: Path, where: str) -> None:
    # "cut": island 1's downlink dies 1.5 MB into its initial cut (4 MiB); "push": island 1's
    # uplink dies 1 MB into its first push (after its HELLO and heartbeats, the only bytes it sends).
    direction, after = (linkemu.DOWN, 1_500_000) if where == "cut" else (linkemu.UP, 1_000_000)
    res = wan_harness.run(_settings(faults={1: lambda emu: emu.arm_reset(direction, after)},
                                    skip_matching_cut=False), tmp_path)
    _check_identical(res)
    # The link really dropped once: zmq reconnected through it, plus one socket per rejoin.
    assert res.links[1].resets == 1 and res.islands[1]["redials"] <= 1
    assert res.links[1].connections == 2 + res.islands[1]["redials"]
    assert res.links[0].connections == 2 and res.islands[0]["redials"] == 0  # its session and its INIT lane
    commits = _commits(res)
    assert sorted(c["round"] for c in commits) == list(range(1, len(commits) + 1))
    for c in commits:  # no island's push merged twice into one round
        assert len(c["pushed"]) == len(set(c["pushed"]))


def test_islands_starting_from_the_same_weights_download_no_cut(tmp_path: Path) -> None:
    # Both islands start from one seed: their HELLOs claim the values island 0 streams as INIT, so
    # neither downloads its cut (HELD per fragment as INIT lands). Compared with the same run that
    # downloads it: the start-up records and the links' down bytes differ by a whole model per island.
    model = 4 * 2**20
    res = wan_harness.run(_settings(), tmp_path / "held")
    _check_identical(res)
    for i in range(2):
        start = _start_record(res, i)
        # Island 0's fragments travel on two connections (its INIT lane), so either may land first.
        assert start["data_bytes_recv"] == 0 and sorted(start["installed"]) == [0, 1]
        assert [e.get("held") for e in start["events"] if e["type"] == "cut"] == [True, True]
        assert f"island {i}: fragments 0-1 match the syncer's values, no cut needed" in res.syncer_log
    cut = wan_harness.run(_settings(skip_matching_cut=False), tmp_path / "cut")
    _check_identical(cut)
    for i in range(2):
        assert _start_record(cut, i)["data_bytes_recv"] >= model
        assert cut.links[i].bytes[linkemu.DOWN] - res.links[i].bytes[linkemu.DOWN] >= model
    print("start-up s, claims:", [round(r["start_s"], 2) for r in res.islands],
          "cut downloaded:", [round(r["start_s"], 2) for r in cut.islands])


def test_a_reset_mid_init_resumes_it_and_sends_no_fragment_twice(tmp_path: Path) -> None:
    # Island 0's uplink dies 3 MB into its INIT (4 MiB, 2 fragments): fragment 0 is in, fragment 1
    # is cut off (what TCP held is lost). Island 0 learns it either from the syncer (init_gap: later
    # parts came without the lost ones) or when its cut stops arriving; it redials, and its WELCOME
    # says the syncer holds fragment 0: only fragment 1 is streamed again, from part 0. Island 1
    # (same seed) is told HELD for both.
    res = wan_harness.run(_settings(faults={0: lambda emu: emu.arm_reset(linkemu.UP, 3_000_000)}), tmp_path)
    _check_identical(res)
    assert res.links[0].resets == 1 and res.islands[0]["redials"] >= 1
    assert "init_gap" in res.syncer_log or "the syncer lost INIT of fragments [1]" in res.island_logs[0]
    for f in range(2):
        assert res.syncer_log.count(f"fragment {f} initialised by island 0") == 1
    assert "duplicate_init" not in res.syncer_log  # nothing the syncer held came again
    handed = [e["fragment"] for e in _start_record(res, 0)["events"] if e["type"] == "init"]
    assert handed.count(0) == 1 and 1 <= handed.count(1) <= 2  # fragment 0 once; 1 again only if lost whole
    assert "island 1: fragments 0-1 match the syncer's values, no cut needed" in res.syncer_log


def test_a_stalled_init_of_island_0_does_not_make_island_1_redial(tmp_path: Path) -> None:
    # Island 0's link goes down 3 MB into its INIT (4 MiB, 2 fragments) and stays down for 3 times
    # the islands' 2 s silence rule: island 0 redials (its connection is gone) and resumes INIT.
    # Island 1 waits for its cut of fragment 1, which needs that INIT; its own link is fine (the
    # syncer answers its heartbeats and its notices say INIT stands still), so it must not redial.
    outage_s = 6.0
    res = wan_harness.run(_settings(faults={0: lambda emu: emu.arm_reset(linkemu.UP, 3_000_000, outage_s)}),
                          tmp_path)
    _check_identical(res)
    assert res.links[0].resets == 1 and res.links[0].refused >= 1 and res.islands[0]["redials"] >= 1
    assert res.islands[1]["redials"] == 0, res.island_logs[1][-3000:]
    assert res.links[1].connections == 1
    assert all(why not in res.island_logs[1] for why in ("rejoining", "no word from the syncer", "socket error"))
    assert "island 1: initial cut waits on island 0's INIT" in res.island_logs[1]
    assert res.islands[1]["start_s"] > outage_s  # it really waited out the stall
    for f in range(2):
        assert res.syncer_log.count(f"fragment {f} initialised by island 0") == 1
