"""make_plan / layout_fingerprint: deterministic cut from the canonical table only."""

from __future__ import annotations

import random

import pytest

from diloco.layout.base import ParamSpec, natural_key
from diloco.plan import layout_fingerprint, make_plan, module_of


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
def test_root_tensors_without_layers_are_cut_contiguously_and_too_many_fragments_refused() -> None:
    specs = {f"w{i}": ParamSpec(f"w{i}", (i + 1, 10)) for i in range(5)}
    plan = make_plan(specs, 2)
    assert plan.fragments == (("w0", "w1", "w2"), ("w3", "w4"))  # 240 / 360 bytes: contiguous, closest to 300
    with pytest.raises(ValueError):
        make_plan(specs, 6)
    with pytest.raises(ValueError):
        make_plan(specs, 0)


def _residual_mlp_specs(groups: int = 4, blocks: int = 3, width: int = 64) -> dict[str, ParamSpec]:
    """The issue's model: blocks named ``fragments.<f>.<k>.fc1.weight``, plus an embedding and a head."""
    specs = [ParamSpec("embed.weight", (10, width)), ParamSpec("head.weight", (10, width))]
    for f in range(groups):
        for k in range(blocks):
            for fc in ("fc1", "fc2"):
                specs += [ParamSpec(f"fragments.{f}.{k}.{fc}.weight", (width, width)),
                          ParamSpec(f"fragments.{f}.{k}.{fc}.bias", (width,))]
    return {s.name: s for s in specs}


@pytest.mark.timeout(10)
def test_default_cut_without_layer_indices_keeps_modules_whole_and_contiguous() -> None:
    specs = _residual_mlp_specs()
    plan = make_plan(specs, 4)
    modules = [sorted({module_of(n) for n in plan.names(f)}, key=natural_key) for f in range(4)]
    # Never one module's tensors on two fragments.
    owner: dict[str, int] = {}
    for f, mods in enumerate(modules):
        for m in mods:
            assert owner.setdefault(m, f) == f, m
    # Contiguous in module order: concatenating the fragments gives the modules in order.
    in_order = sorted({module_of(n) for n in specs}, key=natural_key)
    assert [m for mods in modules for m in mods] == in_order
    # Balanced by bytes: here each fragment is one residual group (plus embed / head at the ends).
    assert [{m.split(".")[1] for m in mods if m.startswith("fragments.")} for mods in modules] == \
        [{"0"}, {"1"}, {"2"}, {"3"}]
    sizes = [plan.nbytes(f) for f in range(4)]
    assert max(sizes) - min(sizes) <= specs["embed.weight"].nbytes
    with pytest.raises(ValueError, match="modules"):
        make_plan({n: s for n, s in specs.items() if n.startswith("fragments.0.0.")}, 3)


@pytest.mark.timeout(10)
def test_explicit_assignment_mapping_and_callable() -> None:
    specs = _residual_mlp_specs(groups=2, blocks=2)

    def by_group(name: str) -> int:
        return int(name.split(".")[1]) if name.startswith("fragments.") else 0

    plan = make_plan(specs, 2, assignment=by_group)
    assert plan.rule == "explicit"
    for n in specs:
        assert plan.fragment_of(n) == by_group(n)
    mapping = {n: by_group(n) for n in specs}
    same = make_plan(specs, 2, assignment=mapping)
    assert same.fragments == plan.fragments
    assert layout_fingerprint(same) == layout_fingerprint(plan)
    # The assignment is part of the fingerprint: another cut, another fingerprint.
    other = make_plan(specs, 2, assignment={n: 1 - f if n.startswith("fragments.") else 1 for n, f in mapping.items()})
    assert layout_fingerprint(other) != layout_fingerprint(plan) != layout_fingerprint(make_plan(specs, 2))
    with pytest.raises(ValueError, match="without a fragment"):
        make_plan(specs, 2, assignment={n: f for n, f in mapping.items() if n != "head.weight"})
    with pytest.raises(ValueError, match="does not have"):
        make_plan(specs, 2, assignment=dict(mapping, **{"nope.weight": 0}))
    with pytest.raises(ValueError, match="fragment 2"):
        make_plan(specs, 2, assignment=lambda n: 2)
    with pytest.raises(ValueError, match="empty"):
        make_plan(specs, 2, assignment=lambda n: 0)
