"""The syncer's automatic part size (``--part-mib auto``, the default): chosen from the plan's
fragment sizes when the first HELLO fixes the layout, told to every island in WELCOME, the same
after a resume; a fixed ``--part-mib`` is kept as given."""

from __future__ import annotations

import logging

import pytest
import torch

from diloco.syncer.cli import EXIT_CONFIG, _part_elems, main
from diloco.syncer.core.config import SyncerConfig
from diloco.syncer.core.records import FragmentRecord
from diloco.wire import PROTOCOL_VERSION, Hello
from diloco.wire.parts import AUTO_MIN_PART_ELEMS, FragmentLayout, auto_part_elems, check_part_elems
from diloco.wire.schema import DEFAULT_PART_ELEMS

from state_driver import Driver, bitwise, errors, init_parts

pytestmark = pytest.mark.timeout(60)

FP = "a" * 16
MIB = 1 << 18  # fp32 elements per MiB


def hello(i: int, numel: tuple[int, ...]) -> Hello:
    return Hello(protocol=PROTOCOL_VERSION, island=i, generation=1 + i, fingerprint=FP, n_fragments=len(numel),
                 wire_dtype="float32", fragment_numel=numel)


@pytest.mark.parametrize(
    "fragment_mib, part_mib",
    [
        (0.01, 1),  # a tiny fragment: the floor, one part
        (128, 1),  # bench_memory's 512 MiB model in 4 fragments
        (660, 4),  # 0.7B in 4 fragments
        (2580, 16),  # 2.7B in 4 fragments
        (6700, 32),  # 7B in 4 fragments: the cap
        (1 << 17, 32),  # 120B in 4 fragments: the cap
    ],
)
def test_auto_part_is_a_power_of_two_near_1_128_of_the_largest_fragment(fragment_mib: float, part_mib: int) -> None:
    numel = int(fragment_mib * MIB)
    got = auto_part_elems((numel // 3, numel, numel // 2), DEFAULT_PART_ELEMS)
    assert got == part_mib * MIB and check_part_elems(got) is None
    assert got == AUTO_MIN_PART_ELEMS or numel // got >= 128  # a part is at most 1/128 of the fragment above the floor


def test_auto_part_never_exceeds_its_cap() -> None:
    assert auto_part_elems((1 << 40,), 4 * MIB) == 4 * MIB
    assert auto_part_elems((1 << 40,), 4096) == 4096  # a cap below the floor wins
    with pytest.raises(ValueError):
        auto_part_elems((1 << 30,), 1000)


def test_welcome_tells_every_island_the_part_size_the_first_hello_fixed() -> None:
    d = Driver(SyncerConfig(islands=2, sync_every=2))
    assert d.E == DEFAULT_PART_ELEMS  # before the layout: the largest this run may use
    numel = (256 * MIB, 250 * MIB)  # 1 GiB and a bit less: 2 MiB parts
    first = d.send(b"p0", hello(0, numel))[0].header
    second = d.send(b"p1", hello(1, numel))[0].header
    assert first.part_elems == second.part_elems == d.E == 2 * MIB


def test_a_fixed_part_mib_is_kept_whatever_the_plan() -> None:
    d = Driver(SyncerConfig(islands=1, sync_every=2, part_elems=8192))
    assert d.send(b"p0", hello(0, (256 * MIB,)))[0].header.part_elems == 8192


def test_init_streams_in_auto_parts_and_the_value_lands_bitwise() -> None:
    d = Driver(SyncerConfig(islands=1, sync_every=2))
    t = [("w", torch.randn(3 * MIB + 5, generator=torch.Generator().manual_seed(3)))]
    d.send(b"p0", hello(0, (t[0][1].numel(),)))
    assert d.E == AUTO_MIN_PART_ELEMS
    parts = init_parts(0, 1, t, d.E, generation=1)
    assert len(parts) == 4
    d.send_all(b"p0", parts)
    frag = d.st.fragments[0]
    assert frag.initialised and bitwise(frag.value, t[0][1])


def test_a_resumed_table_fixes_the_same_part_size(caplog) -> None:
    d = Driver(SyncerConfig(islands=1, sync_every=2))
    layouts = [FragmentLayout.of([("w", (300 * MIB,))]), FragmentLayout.of([("v", (100 * MIB,))])]
    with caplog.at_level(logging.INFO, logger="diloco.syncer.core.book"):
        d.st.book.adopt_table(FP, [FragmentRecord(index=i, layout=lay) for i, lay in enumerate(layouts)])
    assert d.E == auto_part_elems((300 * MIB, 100 * MIB), DEFAULT_PART_ELEMS) == 2 * MIB
    assert "parts of 2.00 MiB (--part-mib auto" in caplog.text


def test_part_mib_flag() -> None:
    assert _part_elems("auto") == 0
    assert _part_elems("8") == 8 * MIB
    assert _part_elems("0.015625") == 4096


@pytest.mark.parametrize("value", ["x", "0", "-1", "nan", "inf", "1e308", "0.001"])
def test_a_bad_part_mib_exits_2_naming_it(value: str, caplog) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["--bind", "tcp://127.0.0.1:*", "--islands", "1", "--insecure", "--part-mib", value]) == EXIT_CONFIG
    assert "--part-mib" in caplog.text


def test_a_commit_work_item_spans_32_mib_of_parts_whatever_the_part_size() -> None:
    from diloco.syncer.core.work import COMMIT_SPAN_ELEMS, commit_span

    assert COMMIT_SPAN_ELEMS == 32 * MIB
    assert [commit_span(p * MIB) for p in (1, 4, 16, 32, 128)] == [32, 8, 2, 1, 1]
    assert commit_span(4096) == 32 * MIB // 4096


def test_init_must_hold_the_sizes_the_hello_that_fixed_the_parts_declared() -> None:
    """The part size comes from the declared sizes and a resume recomputes it from the real ones:
    an island 0 that declared other sizes than it sends is refused, so both agree."""
    d = Driver(SyncerConfig(islands=1, sync_every=2))
    d.send(b"p0", hello(0, (300 * MIB,)))  # 300 Mi elements declared: 2 MiB parts
    t = [("w", torch.zeros(5000))]
    out = d.send_all(b"p0", init_parts(0, 1, t, d.E, generation=1))
    assert "fragments_mismatch" in errors(out) and not d.st.fragments[0].initialised


def test_commit_spans_spread_over_workers_even_when_the_last_is_short() -> None:
    from diloco.syncer.core.work import CommitPart, commit_span
    from diloco.syncer.dataplane import lane

    E = AUTO_MIN_PART_ELEMS
    span = commit_span(E)

    def commit(part: int, parts: int) -> CommitPart:
        return CommitPart(round=1, fragment=0, part=part, value=torch.zeros(1),
                          momentum=None, new_momentum=None, sum=None, total_weight=1, hyper=None,  # type: ignore[arg-type]
                          layout=None, part_elems=E, encode_dtypes=(), version=1, parts=parts)  # type: ignore[arg-type]

    assert [lane(commit(0, span)), lane(commit(span, 2)), lane(commit(2 * span, 1))] == [0, 1, 2]
