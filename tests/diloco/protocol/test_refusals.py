"""Every refusal code the code base raises is a named reason of diloco.protocol.refusals."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from diloco.protocol import refusals

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[3]


def _codes_in_source() -> dict[str, str]:
    """code -> first place it appears: ``Refused("x", ...)``, ``Dropped("x", ...)``, ``Error(code="x")``."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "diloco").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            args: list[ast.expr] = []
            if name in ("Refused", "Dropped") and node.args:
                args.append(node.args[0])
            args += [k.value for k in node.keywords if k.arg == "code" and name in ("Refused", "Dropped", "Error")]
            for a in args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str):
                    found.setdefault(a.value, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_raised_code_is_named() -> None:
    found = _codes_in_source()
    assert len(found) > 20  # the scan sees the syncer's refusals
    unnamed = {c: where for c, where in found.items() if c not in refusals.REASONS}
    assert not unnamed, f"refusal codes missing from diloco/protocol/refusals.py: {unnamed}"


def test_groups_are_named_and_disjoint_where_it_matters() -> None:
    for group in (refusals.FATAL, refusals.REJOIN, refusals.COUNTED, refusals.SILENT):
        assert group <= refusals.REASONS.keys()
    assert not refusals.FATAL & refusals.REJOIN
    assert not refusals.SILENT & (refusals.FATAL | refusals.REJOIN | refusals.COUNTED)
