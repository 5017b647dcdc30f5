"""DeltaSource: a push's parts computed as they are sent, bit for bit ``θ_push − anchor``."""

from __future__ import annotations

import pytest
import torch

from diloco import wire
from diloco.island.delta_source import DeltaSource

pytestmark = pytest.mark.timeout(30)


def _case(device: str) -> tuple[DeltaSource, wire.FragmentLayout, list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 7), (33,), (4, 4)]
    snaps = [torch.randn(*s, generator=gen).reshape(-1) for s in shapes]
    anchors = [torch.randn(*s, generator=gen).reshape(-1) for s in shapes]
    layout = wire.FragmentLayout.of([(f"t{i}", s) for i, s in enumerate(shapes)])
    src = DeltaSource([f"t{i}" for i in range(3)], [s.to(device) for s in snaps], anchors)
    return src, layout, snaps, anchors


def _parts(src: DeltaSource, layout: wire.FragmentLayout, part_elems: int, ring: bool) -> torch.Tensor:
    out = []
    for k in range(layout.n_parts(part_elems)):
        buf = torch.full((part_elems,), float("nan")) if ring else None
        out += [t.clone() for _n, t in src.slice_part(layout, k, part_elems, out=buf)]
    return torch.cat(out)


@pytest.mark.parametrize("ring", [True, False])
def test_parts_are_the_delta_bit_for_bit(ring: bool) -> None:
    src, layout, snaps, anchors = _case("cpu")
    want = torch.cat([s - a for s, a in zip(snaps, anchors)])
    assert torch.equal(_parts(src, layout, 16, ring), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ring", [True, False])
def test_device_snapshots_are_copied_down_one_part_at_a_time(ring: bool) -> None:
    src, layout, snaps, anchors = _case("cuda")
    want = torch.cat([s - a for s, a in zip(snaps, anchors)])
    assert torch.equal(_parts(src, layout, 16, ring), want)
    assert torch.equal(torch.cat([t.reshape(-1) for _n, t in src.materialize([(35,), (33,), (16,)])]), want)
