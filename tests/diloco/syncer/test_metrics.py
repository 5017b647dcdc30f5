"""SyncerMetrics without processes: event counting, the health rule, the missing-extra error."""

from __future__ import annotations

import sys

import pytest

from diloco.syncer import metrics_http
from diloco.syncer.cli import main
from diloco.syncer.metrics import COMMIT_BUCKETS_S, SyncerMetrics

pytestmark = pytest.mark.timeout(30)


def test_events_are_counted_as_the_event_log_says() -> None:
    m = SyncerMetrics(islands=2)
    m.on_events([
        {"round": 1, "fragment": 0, "version": 1, "attempt": 0, "weights": {"0": 16, "1": 16}, "changed": True,
         "commit_s": 0.02},
        {"round": 2, "fragment": 1, "attempt": 1, "dropped": "non-finite commit", "pushed": [0]},
        {"evicted": 1, "reason": "bad_push"},
        {"round": 2, "fragment": 1, "version": 1, "attempt": 2, "weights": {"0": 16, "1": 0}, "changed": True,
         "commit_s": 1000.0},
        {"summary": {"committed_rounds": 2}},
    ])
    c = m._commits
    assert (c.committed, c.changed, c.failed, c.repulled) == (2, 2, 1, 2)
    assert m._merged == [2, 1] and m._empty == [0, 1]
    assert m._merged_at == [2, 1]  # island 1's push last merged at the first change: lag 1
    assert c.latency_count == 2 and c.latency_sum == pytest.approx(1000.02)
    assert c.buckets[COMMIT_BUCKETS_S.index(0.025)] == 1 and c.buckets[-1] == 1


def test_health_turns_503_when_stalled_or_stopped() -> None:
    m = SyncerMetrics(islands=1, stall_after_s=5.0)
    m.beat_at = 100.0
    assert m.healthy(104.0)[0]
    ok, why = m.healthy(106.0)
    assert not ok and "not turned for 6.0s" in why
    m.beat_at = 106.0
    m.stopped = True
    assert m.healthy(106.0) == (False, "the control loop has stopped")


def test_missing_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(metrics_http.MetricsUnavailable, match=r"yeto-diloco\[metrics\]"):
        metrics_http.start_metrics_server(SyncerMetrics(islands=1), 0)


@pytest.mark.parametrize("flag, value", [("--metrics-port", "-1"), ("--metrics-port", "70000"),
                                         ("--metrics-linger-s", "-1")])
def test_bad_metrics_flags_fail_at_start(flag: str, value: str) -> None:
    assert main(["--islands", "1", "--insecure", flag, value]) == 2
