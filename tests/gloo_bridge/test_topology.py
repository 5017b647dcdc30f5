"""Node layout: where ranks-per-node comes from and which rank lists span nodes."""

from __future__ import annotations

import pytest

from gloo_bridge.topology import NodeLayout, resolve_node_layout

pytestmark = pytest.mark.timeout(30)


def test_argument_wins_over_environment() -> None:
    layout = resolve_node_layout(4, env={"YETO_RANKS_PER_NODE": "2", "LOCAL_WORLD_SIZE": "8"})
    assert (layout.ranks_per_node, layout.source) == (4, "ranks_per_node")


def test_override_variable_wins_over_launcher() -> None:
    layout = resolve_node_layout(env={"YETO_RANKS_PER_NODE": " 2 ", "LOCAL_WORLD_SIZE": "8"})
    assert (layout.ranks_per_node, layout.source) == (2, "YETO_RANKS_PER_NODE")
    assert resolve_node_layout(env={"LOCAL_WORLD_SIZE": "8"}).source == "LOCAL_WORLD_SIZE"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({}, "YETO_RANKS_PER_NODE"),
        ({"YETO_RANKS_PER_NODE": "two"}, "YETO_RANKS_PER_NODE='two' is not an integer"),
        ({"YETO_RANKS_PER_NODE": "0"}, "YETO_RANKS_PER_NODE=0 must be >= 1"),
        ({"LOCAL_WORLD_SIZE": "-3"}, "LOCAL_WORLD_SIZE=-3 must be >= 1"),
        ({"LOCAL_WORLD_SIZE": "1.5"}, "LOCAL_WORLD_SIZE='1.5' is not an integer"),
    ],
)
def test_bad_environment_names_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        resolve_node_layout(env=env)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_bad_argument(bad: object) -> None:
    with pytest.raises(ValueError, match="ranks_per_node"):
        resolve_node_layout(bad, env={})  # type: ignore[arg-type]


def test_spans_nodes() -> None:
    layout = NodeLayout(2, "ranks_per_node")
    assert not layout.spans_nodes([0, 1])
    assert not layout.spans_nodes([3, 2])
    assert layout.spans_nodes([1, 2])
    assert layout.spans_nodes([0, 2])
    assert layout.nodes_of([5, 0, 4]) == [0, 2]
    assert not NodeLayout(1, "x").spans_nodes([7])


def test_world_must_be_whole_nodes() -> None:
    NodeLayout(2, "YETO_RANKS_PER_NODE").check_world(4)
    with pytest.raises(ValueError, match="YETO_RANKS_PER_NODE=3 does not divide the world size 4"):
        NodeLayout(3, "YETO_RANKS_PER_NODE").check_world(4)
