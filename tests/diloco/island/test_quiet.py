"""QuietAnchors: at most one received value takes a fragment's anchors, and only when nothing
else of that fragment is outstanding (plain values, no threads needed)."""

from diloco.island.quiet import QuietAnchors


def test_one_value_takes_the_anchors_until_it_is_installed() -> None:
    q = QuietAnchors(2)
    assert q.begin(0, True) == (True, 1)
    assert q.begin(0, True) == (False, 2), "a second value of the fragment while the first is out"
    assert q.begin(1, True) == (True, 1), "fragments are independent"
    q.installed(0, 1)
    assert q.begin(0, True)[0] is False, "value 2 began after value 1: installing 1 frees nothing"
    q.installed(0, 3)
    assert q.begin(0, True) == (True, 4)


def test_a_pooled_value_keeps_the_anchors_busy_until_installed() -> None:
    q = QuietAnchors(1)
    assert q.begin(0, False) == (False, 1)  # e.g. bf16, or another stream arriving: pooled
    assert q.begin(0, True) == (False, 2), "value 1 will be staged into the anchors: busy"
    q.installed(0, 1)
    assert q.begin(0, True)[0] is False, "value 2 is still outstanding"
    q.installed(0, 3)
    assert q.begin(0, True) == (True, 4)
