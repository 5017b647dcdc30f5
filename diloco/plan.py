"""The fragment plan: which canonical parameters are synced together, and the layout fingerprint.

Streaming DiLoCo syncs the model one fragment per round. Every island and the
syncer must cut the model the same way, whatever each island's TP / PP / EP /
DP layout, so the plan is a pure function of the canonical table (names and
global shapes) and the number of fragments, and islands prove they agree with
`layout_fingerprint` at HELLO.

The cut (documented choice):
- Transformer layers (names with `layers.<i>.`) are **strided**: layer i goes
  to fragment i mod P, as in Streaming DiLoCo, so each fragment spans the
  depth of the network and fragments are of similar size.
- Every other parameter (embedding, final norm, output layer, or all params
  of a module without layers) is then placed, largest first, on an empty
  fragment if any, else the one with the fewest bytes so far (ties: lowest
  index): greedy balancing by bytes.
- Within a fragment, names keep the natural canonical order (layer 10 after 9),
  which is the order tensors travel in.
Every fragment must end up non-empty; asking for more fragments than that
allows is an error.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from diloco.layout.base import ParamSpec, natural_key

PLAN_VERSION = 1
"""Bumped whenever the cut changes, so islands with different code refuse each other at HELLO."""

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class FragmentPlan:
    """The cut of the canonical table into fragments; identical on every island."""

    fragments: tuple[tuple[str, ...], ...]
    """Canonical names of each fragment, in travel order."""
    specs: dict[str, ParamSpec]
    """The canonical table the plan was made from."""

    @property
    def n_fragments(self) -> int:
        return len(self.fragments)

    def names(self, f: int) -> tuple[str, ...]:
        return self.fragments[f]

    def specs_of(self, f: int) -> list[ParamSpec]:
        return [self.specs[n] for n in self.fragments[f]]

    def nbytes(self, f: int) -> int:
        """Bytes of the fragment's fp32 global tensors."""
        return sum(s.nbytes for s in self.specs_of(f))

    def fragment_of(self, name: str) -> int:
        for f, names in enumerate(self.fragments):
            if name in names:
                return f
        raise KeyError(name)


def make_plan(specs: dict[str, ParamSpec], n_fragments: int) -> FragmentPlan:
    """Cut the canonical table into `n_fragments` non-empty fragments (see the module docstring)."""
    if n_fragments < 1:
        raise ValueError(f"n_fragments must be >= 1, got {n_fragments}")
    if len(specs) < n_fragments:
        raise ValueError(f"cannot cut {len(specs)} parameters into {n_fragments} non-empty fragments")
    members: list[list[str]] = [[] for _ in range(n_fragments)]
    loads = [0] * n_fragments
    rest: list[str] = []
    for name in sorted(specs, key=natural_key):
        m = _LAYER_RE.search(name)
        if m is None:
            rest.append(name)
            continue
        f = int(m.group(1)) % n_fragments
        members[f].append(name)
        loads[f] += specs[name].nbytes
    # Largest first; sorted() is stable, so equal sizes keep canonical order.
    for name in sorted(rest, key=lambda n: (-specs[n].nbytes, natural_key(n))):
        f = min(range(n_fragments), key=lambda i: (len(members[i]) > 0, loads[i], i))
        members[f].append(name)
        loads[f] += specs[name].nbytes
    empty = [f for f, m in enumerate(members) if not m]
    if empty:
        raise ValueError(f"fragments {empty} would be empty: use fewer fragments (at most the number of layers)")
    fragments = tuple(tuple(sorted(m, key=natural_key)) for m in members)
    return FragmentPlan(fragments=fragments, specs={n: specs[n] for n in sorted(specs, key=natural_key)})


def layout_fingerprint(plan: FragmentPlan) -> str:
    """Hex SHA-256 over the plan version, fragment cut, names, global shapes and dtype (fp32)."""
    body = {
        "plan_version": PLAN_VERSION,
        "dtype": "float32",
        "fragments": [[[n, list(plan.specs[n].shape)] for n in names] for names in plan.fragments],
    }
    return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()
