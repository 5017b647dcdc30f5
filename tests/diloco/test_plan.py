"""make_plan / layout_fingerprint: deterministic cut from the canonical table only."""

from __future__ import annotations

import random

import pytest

from diloco.layout.base import ParamSpec
from diloco.plan import layout_fingerprint, make_plan


def _gpt_specs(layers: int = 6) -> dict[str, ParamSpec]:
    specs = [ParamSpec("embedding.word_embeddings.weight", (100, 64)), ParamSpec("decoder.final_layernorm.weight", (64,))]
    for i in range(layers):
        specs += [
            ParamSpec(f"decoder.layers.{i}.self_attention.linear_qkv.weight", (128, 64)),
            ParamSpec(f"decoder.layers.{i}.mlp.linear_fc1.weight", (256, 64)),
        ]
    return {s.name: s for s in specs}


@pytest.mark.timeout(10)
def test_every_name_once_and_layers_strided() -> None:
    specs = _gpt_specs(12)
    plan = make_plan(specs, 4)
    names = [n for f in range(plan.n_fragments) for n in plan.names(f)]
    assert sorted(names) == sorted(specs) and len(names) == len(set(names))
    for f in range(4):
        assert plan.names(f)
        for n in plan.names(f):
            if ".layers." in n:
                assert int(n.split(".")[2]) % 4 == f
    assert "decoder.layers.10.mlp.linear_fc1.weight" in plan.names(2)
    assert sum(plan.nbytes(f) for f in range(4)) == sum(s.nbytes for s in specs.values())
    # the embedding (largest non-layer param) balances onto the lightest fragment
    assert plan.fragment_of("embedding.word_embeddings.weight") == 0


@pytest.mark.timeout(10)
def test_independent_of_table_order() -> None:
    specs = _gpt_specs(5)
    items = list(specs.items())
    random.Random(3).shuffle(items)
    a, b = make_plan(specs, 3), make_plan(dict(items), 3)
    assert a.fragments == b.fragments
    assert layout_fingerprint(a) == layout_fingerprint(b)


@pytest.mark.timeout(10)
def test_fingerprint_sees_shapes_and_cut() -> None:
    specs = _gpt_specs(4)
    fp = layout_fingerprint(make_plan(specs, 2))
    assert fp != layout_fingerprint(make_plan(specs, 3))
    changed = dict(specs)
    changed["decoder.final_layernorm.weight"] = ParamSpec("decoder.final_layernorm.weight", (65,))
    assert fp != layout_fingerprint(make_plan(changed, 2))
    assert len(fp) == 64 and int(fp, 16) >= 0


@pytest.mark.timeout(10)
def test_no_layers_is_bin_packed_and_too_many_fragments_refused() -> None:
    specs = {f"w{i}": ParamSpec(f"w{i}", (i + 1, 10)) for i in range(5)}
    plan = make_plan(specs, 2)
    assert abs(plan.nbytes(0) - plan.nbytes(1)) <= 4 * 50
    with pytest.raises(ValueError):
        make_plan(specs, 6)
    with pytest.raises(ValueError):
        make_plan(specs, 0)
