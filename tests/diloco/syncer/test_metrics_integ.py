"""``yeto-syncer --metrics-port``: a real syncer process and two real islands, scraped over HTTP.

The endpoint's text parses with ``prometheus_client.parser``; after the run (the syncer keeps
serving its final values for ``--metrics-linger-s``) every counter equals what the syncer's own
event log says; ``/healthz`` is 200 while the control loop turns and 503 once it has stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import spawn
from tests.support.syncer_proc import REPO, SyncerProc

pytestmark = [pytest.mark.integ, pytest.mark.timeout(240)]

ISLAND = REPO / "tests" / "diloco" / "island" / "world1_island.py"
STEPS = 24


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except urllib.error.URLError as e:  # not listening yet (the endpoint starts after the bound line)
        return 0, str(e)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _wait(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_metrics_match_the_event_log_and_healthz_follows_the_loop(
        tmp_path: Path, free_port: int, syncer_proc: Callable[..., SyncerProc],
        spawned: list[subprocess.Popen[Any]]) -> None:
    events = tmp_path / "events.jsonl"
    syncer = syncer_proc(["--islands", "2", "--sync-every", "8", "--total-steps", str(STEPS), "--grace-ms", "200",
                          "--quorum-timeout-s", "60", "--event-log", str(events), "--metrics-port", str(free_port),
                          "--metrics-linger-s", "120"])
    base = f"http://127.0.0.1:{free_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for i in range(2):
        spawned.append(spawn([sys.executable, str(ISLAND), "--addr", syncer.endpoint, "--island-id", str(i),
                              "--out", str(tmp_path), "--steps", str(STEPS), "--start-together", "2"],
                             stdout=open(tmp_path / f"island{i}.log", "w"), stderr=subprocess.STDOUT,
                             cwd=str(REPO), env=env))
    # While the islands train: healthy, and the text parses.
    code, text = _wait(lambda: (r := _get(base + "/healthz"))[0] == 200 and r, 60, "/healthz 200")
    assert text.startswith("ok")
    running = ("yeto_syncer_phase", (("phase", "running"),))
    # The loop publishes a snapshot every 0.5 s: /healthz can answer before the first one.
    mid = _wait(lambda: (m := _samples(_get(base + "/metrics")[1])).get(running) == 1.0 and m, 60, "phase running")
    assert mid[running] == 1.0
    for i, p in enumerate(spawned):
        assert p.wait(timeout=180) == 0, (tmp_path / f"island{i}.log").read_text()[-3000:]
    # The loop returned (every island acknowledged the final cut): 503, final values still served.
    code, why = _wait(lambda: (r := _get(base + "/healthz"))[0] == 503 and r, 60, "/healthz 503")
    assert "stopped" in why
    final = _samples(_get(base + "/metrics")[1])
    syncer.proc.send_signal(signal.SIGTERM)  # ends the linger
    assert syncer.wait(timeout=30) == 0, syncer.log()[-3000:]

    log = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    commits = [e for e in log if "round" in e and "version" in e and "dropped" not in e]
    assert len(commits) >= 3 and any(e["changed"] for e in commits)

    def value(name: str, **labels: str) -> float:
        return final[(name, tuple(sorted(labels.items())))]

    assert value("yeto_syncer_phase", phase="done") == 1.0
    assert value("yeto_syncer_rounds_committed_total") == len(commits)
    assert value("yeto_syncer_rounds_changed_total") == sum(e["changed"] for e in commits)
    assert value("yeto_syncer_rounds_failed_total") == sum("dropped" in e for e in log)
    assert value("yeto_syncer_rounds_repulled_total") == sum(e["attempt"] for e in commits)
    assert value("yeto_syncer_open_rounds") == 0
    changed = 0
    merged_at = {0: 0, 1: 0}
    for e in commits:
        changed += e["changed"]
        for i, w in e["weights"].items():
            if w > 0:
                merged_at[int(i)] = changed
    for i in (0, 1):
        merged = sum(1 for e in commits if e["weights"].get(str(i), 0) > 0)
        empty = sum(1 for e in commits if e["weights"].get(str(i), -1) == 0)
        assert merged > 0
        assert value("yeto_syncer_pushes_total", island=str(i), outcome="merged") == merged
        assert value("yeto_syncer_pushes_total", island=str(i), outcome="empty") == empty
        assert value("yeto_syncer_island_lag_versions", island=str(i)) == changed - merged_at[i]
        assert value("yeto_syncer_island_last_heard_age_seconds", island=str(i)) >= 0
        # The link as the syncer measured it: pushes came up, so the uplink has a rate.
        assert value("yeto_syncer_island_up_bytes_per_second", island=str(i)) > 0
        for name in ("down_bytes_per_second", "rtt_seconds", "round_transfer_predicted_seconds",
                     "round_window_seconds"):  # served for every island (value() raises when absent)
            assert value("yeto_syncer_island_" + name, island=str(i)) >= 0
    assert value("yeto_syncer_commit_seconds_count") == len(commits)
    assert value("yeto_syncer_commit_seconds_sum") == pytest.approx(sum(e["commit_s"] for e in commits), abs=1e-3)
    assert value("yeto_syncer_commit_seconds_bucket", le="+Inf") == len(commits)
    assert value("yeto_syncer_versions_published") == sum(e["changed"] for e in commits)
    # Bytes: at least every island's pushed payload came in, and the cuts and commits went out.
    pushed = 0
    for i in (0, 1):
        result = json.loads((tmp_path / f"island{i}.json").read_text())
        pushed += result["stats"]["data_bytes_sent"]
        assert value("yeto_syncer_sent_bytes_total") >= result["stats"]["data_bytes_recv"]
    assert value("yeto_syncer_received_bytes_total") >= pushed > 0
    assert value("yeto_syncer_connections_accepted_total") >= 2
    assert value("yeto_syncer_buffer_bytes", kind="value") > 0
    assert value("yeto_syncer_resident_memory_bytes") > 0
    assert ("process_resident_memory_bytes", ()) in final
