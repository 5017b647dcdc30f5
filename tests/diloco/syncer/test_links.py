"""Link figures and what they mean: the round-fit prediction, the rate meter, the island's progress clocks."""

from __future__ import annotations

import math

import pytest

from diloco import wire
from diloco.island.liveness import Liveness
from diloco.syncer.links import LinkFigures, LinkWatch, RoundFit, _changed, advice, predict_fit, wire_bytes_per_elem
from diloco.wire.rates import RateMeter

pytestmark = pytest.mark.timeout(30)

FRAGMENT = 128 * 2**20 // 4
"""Elements of one fragment of the issue's 256 MiB model in 2 fragments."""


def test_the_issue_10mb_link_does_not_fit_and_names_the_fix() -> None:
    fit = predict_fit(FRAGMENT, "float32", 10e6, 10e6, 0.0, sync_every=20, n_fragments=2, step_s=0.5)
    assert fit.up_s == pytest.approx(13.42, abs=0.01) and fit.down_s == pytest.approx(13.42, abs=0.01)
    assert fit.window_s == pytest.approx(5.0)
    assert not fit.fits
    assert fit.need_sync_every == 110  # 2 x 26.8 s / 0.5 s = 107.4, rounded up to two digits
    assert fit.q4_ratio == pytest.approx(0.133, abs=0.001)
    assert not fit.q4_fits  # q4 up (1.8 s) + bf16 down (6.7 s) is still more than 5 s
    text = advice(1, fit, 10e6, 10e6, "float32")
    assert "island 1's link carries 10 MB/s" in text
    assert "13.4 s up and 13.4 s down, rounds come every 5 s" in text
    assert "raise --sync-every to >= 110" in text and "YETO_WIRE_DTYPE=q4, 0.13 of the bytes" in text


def test_a_large_enough_h_fits_and_the_needed_h_does() -> None:
    slow = predict_fit(FRAGMENT, "float32", 10e6, 10e6, 0.1, sync_every=20, n_fragments=2, step_s=0.5)
    again = predict_fit(FRAGMENT, "float32", 10e6, 10e6, 0.1, sync_every=slow.need_sync_every, n_fragments=2,
                        step_s=0.5)
    assert again.fits and again.need_sync_every == slow.need_sync_every
    fast = predict_fit(FRAGMENT, "float32", 1e9, 1e9, 0.0, sync_every=20, n_fragments=2, step_s=0.5)
    assert fast.fits and fast.need_sync_every == 20


def test_the_commit_counts_between_the_push_and_the_broadcast() -> None:
    # The 2.7B device run: 2.6 GB fragments, ~1 GB/s up, ~1.9 GB/s down, 1.15 s steps, H 16, P 4.
    numel = 2590 * 2**20 // 4
    bare = predict_fit(numel, "float32", 1.04e9, 1.9e9, 0.03, 16, 4, 1.15)
    fit = predict_fit(numel, "float32", 1.04e9, 1.9e9, 0.03, 16, 4, 1.15, commit_s=0.45)
    assert bare.fits and bare.round_s == pytest.approx(bare.up_s + bare.down_s)
    assert fit.round_s == pytest.approx(bare.round_s + 0.45) and fit.commit_s == 0.45
    slow = predict_fit(numel, "float32", 1.04e9, 1.9e9, 0.03, 16, 4, 1.15, commit_s=1.97)  # its worst commit
    assert not slow.fits and slow.need_sync_every == math.ceil(slow.round_s * 4 / 1.15)
    assert "plus 2 s to merge" in advice(0, slow, 1.04e9, 1.9e9, "float32")


def test_rtt_and_dtypes_count() -> None:
    base = predict_fit(FRAGMENT, "float32", 50e6, 50e6, 0.0, 20, 2, 0.5)
    rtt = predict_fit(FRAGMENT, "float32", 50e6, 50e6, 0.05, 20, 2, 0.5)
    assert rtt.up_s - base.up_s == pytest.approx(0.025)
    q4 = predict_fit(FRAGMENT, "q4", 50e6, 50e6, 0.0, 20, 2, 0.5)
    assert q4.up_s == pytest.approx(base.up_s * wire_bytes_per_elem("q4") / 4)
    assert q4.down_s == pytest.approx(base.down_s / 2)  # low-bit pushes get bf16 broadcasts
    assert "push q4" not in advice(0, q4, 50e6, 50e6, "q4")
    with pytest.raises(ValueError):
        predict_fit(FRAGMENT, "float32", 0.0, 1.0, 0.0, 20, 2, 0.5)


def test_a_warning_is_repeated_only_when_the_verdict_changes() -> None:
    def fit(fits: bool, need: int) -> RoundFit:
        return RoundFit(1, 1, 1, fits, need, 1, 1, False, 0.13)

    assert _changed(None, fit(False, 100))
    assert not _changed((False, 100), fit(False, 120))  # noise
    assert _changed((False, 100), fit(False, 140))
    assert _changed((False, 100), fit(True, 20))
    assert not _changed((True, 20), fit(True, 20))


def test_link_figures_are_the_measured_rates_and_the_last_prediction() -> None:
    watch = LinkWatch(n_islands=2)
    assert watch.figures(0) == LinkFigures() and watch.figures(7) == LinkFigures()
    for k in range(11):
        watch.on_receive(1, 1_000_000, k * 0.1)  # 10 MB/s up from island 1
    watch.on_receive(1, 0, 1.2, wire.Heartbeat(island=1, down_bytes_s=4_000_000, rtt_us=50_000))
    fit = predict_fit(FRAGMENT, "q4", 10e6, 4e6, 0.05, sync_every=20, n_fragments=2, step_s=0.5)
    watch.last_fit[1] = fit
    got = watch.figures(1)
    assert got.up_bytes_s == pytest.approx(10e6) and got.down_bytes_s == 4e6 and got.rtt_s == pytest.approx(0.05)
    assert got.round_s == pytest.approx(fit.up_s + fit.down_s) and got.window_s == fit.window_s == 5.0
    assert watch.figures(0) == LinkFigures()  # island 0 moved nothing
    commit = {"round": 3, "pushed": [0, 1]}
    assert watch.annotated(commit) == {**commit, "predicted_s": {"1": round(fit.round_s, 3)}}
    dropped = {"round": 3, "pushed": [0, 1], "dropped": "non-finite commit"}
    assert watch.annotated(dropped) is dropped and watch.annotated({"summary": 1}) == {"summary": 1}


def test_rate_meter_times_bursts_not_idle_time() -> None:
    m = RateMeter(window_s=0.5, gap_s=1.0, alpha=1.0)
    for k in range(11):
        m.add(1000, k * 0.1)  # 10 kB/s; the first 1000 bytes start the clock
    assert m.rate == pytest.approx(10_000)
    for k in range(11):
        m.add(1000, 100.0 + k * 0.05)  # after an idle minute: 20 kB/s, the gap is not counted
    assert m.rate == pytest.approx(20_000)
    assert m.total == 22_000


def test_a_burst_shorter_than_a_window_is_measured_when_the_next_begins() -> None:
    m = RateMeter(window_s=0.5, gap_s=1.0, alpha=1.0)
    for k in range(3):
        m.add(8_000_000, k * 0.16)  # a small push: 3 parts over 0.32 s (the first starts the clock)
    assert m.rate == 0  # still open
    m.add(8_000_000, 10.0)  # the next push, after a gap: the first burst is a sample
    assert m.rate == pytest.approx(16_000_000 / 0.32)
    m.add(1_000_000, 10.01)  # back-to-back parts then a gap: too short a span to be the link's
    m.add(1_000_000, 30.0)
    assert m.rate == pytest.approx(16_000_000 / 0.32)


def test_progress_clocks_move_only_when_counters_change() -> None:
    lv = Liveness()
    t0 = lv.cut_progress_at
    note = wire.Progress(init_bytes=10, in_bytes=10, commits=0, sent_bytes=0, queue=2, syncer_id=7)
    assert lv.on_progress(note, t0 + 1) is None  # the first notice is the baseline
    assert lv.cut_progress_at == t0 and lv.queue == 2
    assert lv.on_progress(note, t0 + 2) is None  # the same counters: nothing moved
    assert lv.cut_progress_at == t0 and lv.any_progress_at == t0
    lv.on_progress(wire.Progress(init_bytes=10, in_bytes=99, commits=1, sent_bytes=0, syncer_id=7), t0 + 3)
    assert lv.cut_progress_at == t0 and lv.any_progress_at == t0 + 3  # pushes move, the cut does not
    lv.on_progress(wire.Progress(init_bytes=20, in_bytes=99, commits=1, sent_bytes=0, syncer_id=7), t0 + 4)
    assert lv.cut_progress_at == t0 + 4
    lv.on_value_part(1 << 20, t0 + 5)
    assert lv.cut_progress_at == lv.any_progress_at == t0 + 5
    assert lv.on_progress(wire.Progress(init_bytes=-1, syncer_id=7), t0 + 6) is not None
    assert lv.cut_progress_at == t0 + 5


def test_progress_round_trips_the_wire_and_heartbeats_carry_link_figures() -> None:
    key = b"k" * 16
    for h in (wire.Progress(init_bytes=5, in_bytes=6, commits=1, sent_bytes=3, queue=1, syncer_id=9),
              wire.Heartbeat(island=1, generation=2, step=3, down_bytes_s=10_000_000, rtt_us=100_000)):
        assert wire.open_message(wire.encode(h, key=key, nonce=1, seq=1), key=key).header == h
