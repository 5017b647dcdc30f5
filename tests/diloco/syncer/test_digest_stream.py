"""The incremental fragment digest equals the whole-fragment one, however the stream is cut."""

from __future__ import annotations

import pytest
import torch

from diloco.digest import FragmentDigest, StreamDigest, tensor_digest
from diloco.wire import FragmentLayout

pytestmark = pytest.mark.timeout(60)

LAYOUT = FragmentLayout.of([("e0", (0,)), ("a", (3,)), ("e", (0,)), ("b", (2, 4100)), ("c", (4,)), ("z", (0, 3))])


@pytest.mark.parametrize("step", [1, 7, 4096, 8203, 10**6])
def test_fragment_digest_fed_in_pieces_equals_the_whole(step: int) -> None:
    value = torch.randn(LAYOUT.numel, generator=torch.Generator().manual_seed(step))
    whole = tensor_digest(LAYOUT.flat_views(value))
    d = FragmentDigest(LAYOUT.names, LAYOUT.shapes)
    for a in range(0, LAYOUT.numel, step):
        d.update(value[a : a + step])
    assert d.hexdigest() == whole and len(whole) == 32


def test_digest_sees_every_byte_name_and_shape() -> None:
    value = torch.randn(LAYOUT.numel)
    base = tensor_digest(LAYOUT.flat_views(value))
    flipped = value.clone()
    flipped.view(torch.int32)[5000] ^= 1  # one bit of one element
    assert tensor_digest(LAYOUT.flat_views(flipped)) != base
    renamed = [("x" if n == "c" else n, t) for n, t in LAYOUT.flat_views(value)]
    assert tensor_digest(renamed) != base
    reshaped = [(n, t.reshape(-1) if n == "b" else t) for n, t in LAYOUT.flat_views(value)]
    assert tensor_digest(reshaped) != base
    s = StreamDigest()  # the streaming class is the whole-tensor function, piece by piece
    for n, t in LAYOUT.flat_views(value):
        s.begin(n, t.dtype, t.shape)
        flat = t.reshape(-1)
        s.update(flat[:2])
        s.update(flat[2:])
    assert s.hexdigest() == base


def test_fragment_digest_refuses_a_wrong_stream() -> None:
    d = FragmentDigest(LAYOUT.names, LAYOUT.shapes)
    with pytest.raises(ValueError, match="float32"):
        d.update(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="elements fed"):
        d.update(torch.zeros(LAYOUT.numel + 1))
    d.update(torch.zeros(10))
    with pytest.raises(ValueError, match="10 of"):
        d.hexdigest()
