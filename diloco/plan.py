"""The fragment plan: which canonical parameters are synced together, and the layout fingerprint.

Streaming DiLoCo syncs the model one fragment per round. Every island must cut the
model the same way, whatever its TP / PP / EP / DP layout, so the plan is a pure
function of the canonical table (names and global shapes), the number of fragments
and, when the user gives one, an explicit assignment; islands prove they agree with
:func:`layout_fingerprint` at HELLO (the syncer refuses a fingerprint that differs
from the first island's).

The cut (documented in ``docs/API.md``):

- **Explicit assignment** (``assignment=``): a mapping ``name -> fragment`` covering
  every canonical name, or a function ``name -> fragment`` called once per name. The
  plan is exactly that; the fingerprint records that it was explicit.
- **Models with transformer layers** (some name contains ``layers.<i>.``): layer i
  goes to fragment i mod P (**strided**, as in Streaming DiLoCo: each fragment spans
  the depth of the network and fragments are of similar size). Every other parameter
  (embedding, final norm, output layer) is then placed, largest first, on an empty
  fragment if any, else on the one with the fewest bytes so far (ties: lowest index).
- **Models without layer indices**: **contiguous blocks** in module order (the
  natural order of the module paths: ``blocks.2`` before ``blocks.10``), balanced by
  bytes, never splitting one module's own tensors (``fc.weight`` and ``fc.bias``
  travel together; tensors held by the root module itself are placed one by one).
  Fragment k takes whole modules while that brings its size closer to
  (bytes left) / (fragments left), keeping one module for each later fragment.

Within a fragment, names keep the natural canonical order (layer 10 after 9), which is
the order tensors travel in. Every fragment must end up non-empty; asking for more
fragments than that allows is an error.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from diloco.layout.base import ParamSpec, natural_key

PLAN_VERSION = 2
"""Bumped whenever the cut of any model changes, so islands running different code refuse
each other at HELLO. 2: contiguous module blocks for models without ``layers.<i>.``;
explicit assignments."""

Assignment = Mapping[str, int] | Callable[[str], int]
"""An explicit cut: ``{name: fragment}`` for every canonical name, or ``fn(name) -> fragment``."""

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class FragmentPlan:
    """The cut of the canonical table into fragments; identical on every island."""

    fragments: tuple[tuple[str, ...], ...]
    """Canonical names of each fragment, in travel order."""
    specs: dict[str, ParamSpec]
    """The canonical table the plan was made from."""
    rule: str = "default"
    """How the cut was made: ``"default"`` (the rules above) or ``"explicit"`` (an assignment)."""

    @property
    def n_fragments(self) -> int:
        """Number of fragments P (round t syncs fragment (t-1) mod P)."""
        return len(self.fragments)

    def names(self, f: int) -> tuple[str, ...]:
        """Canonical names of fragment ``f`` in travel order."""
        return self.fragments[f]

    def specs_of(self, f: int) -> list[ParamSpec]:
        """Specs of fragment ``f`` in travel order (what export and apply iterate)."""
        return [self.specs[n] for n in self.fragments[f]]

    def nbytes(self, f: int) -> int:
        """Bytes of the fragment's fp32 global tensors."""
        return sum(s.nbytes for s in self.specs_of(f))

    def fragment_of(self, name: str) -> int:
        """The fragment holding canonical parameter ``name`` (KeyError if none)."""
        for f, names in enumerate(self.fragments):
            if name in names:
                return f
        raise KeyError(name)


def make_plan(specs: Mapping[str, ParamSpec], n_fragments: int, assignment: Assignment | None = None) -> FragmentPlan:
    """Cut the canonical table into ``n_fragments`` non-empty fragments (see the module docstring).

    Args:
        specs: the canonical table (``layout.specs()``); its order does not matter.
        n_fragments: P, the number of fragments.
        assignment: an explicit cut (mapping or function of the name); None = the default rules.

    Raises:
        ValueError: P < 1, a fragment would be empty, or the assignment is incomplete, names
            unknown parameters or gives a fragment outside ``0 .. P-1``.
    """
    if n_fragments < 1:
        raise ValueError(f"n_fragments must be >= 1, got {n_fragments}")
    if len(specs) < n_fragments:
        raise ValueError(f"cannot cut {len(specs)} parameters into {n_fragments} non-empty fragments")
    ordered = sorted(specs, key=natural_key)
    if assignment is not None:
        members = _explicit(ordered, n_fragments, assignment)
        rule = "explicit"
    elif any(_LAYER_RE.search(n) for n in ordered):
        members = _strided(specs, ordered, n_fragments)
        rule = "default"
    else:
        members = _contiguous(specs, ordered, n_fragments)
        rule = "default"
    empty = [f for f, m in enumerate(members) if not m]
    if empty:
        hint = "assign at least one parameter to each" if assignment is not None else \
            "use fewer fragments (at most the number of layers, or of modules)"
        raise ValueError(f"fragments {empty} would be empty: {hint}")
    fragments = tuple(tuple(sorted(m, key=natural_key)) for m in members)
    return FragmentPlan(fragments=fragments, specs={n: specs[n] for n in ordered}, rule=rule)


def _explicit(ordered: list[str], n: int, assignment: Assignment) -> list[list[str]]:
    if isinstance(assignment, Mapping):
        unknown = sorted(set(assignment) - set(ordered), key=natural_key)
        if unknown:
            raise ValueError(f"assignment names {len(unknown)} parameter(s) the model does not have: {unknown[:5]}")
        missing = [name for name in ordered if name not in assignment]
        if missing:
            raise ValueError(f"assignment leaves {len(missing)} parameter(s) without a fragment: {missing[:5]}")
        lookup: Callable[[str], int] = assignment.__getitem__
    elif callable(assignment):
        lookup = assignment
    else:
        raise TypeError(f"assignment must be a mapping or a callable, got {type(assignment).__name__}")
    members: list[list[str]] = [[] for _ in range(n)]
    for name in ordered:
        f = lookup(name)
        if not isinstance(f, int) or isinstance(f, bool) or not 0 <= f < n:
            raise ValueError(f"assignment puts {name} on fragment {f!r}; fragments are 0 .. {n - 1}")
        members[f].append(name)
    return members


def _strided(specs: Mapping[str, ParamSpec], ordered: list[str], n: int) -> list[list[str]]:
    members: list[list[str]] = [[] for _ in range(n)]
    loads = [0] * n
    rest: list[str] = []
    for name in ordered:
        m = _LAYER_RE.search(name)
        if m is None:
            rest.append(name)
            continue
        f = int(m.group(1)) % n
        members[f].append(name)
        loads[f] += specs[name].nbytes
    # Largest first; sorted() is stable, so equal sizes keep canonical order.
    for name in sorted(rest, key=lambda x: (-specs[x].nbytes, natural_key(x))):
        f = min(range(n), key=lambda i: (len(members[i]) > 0, loads[i], i))
        members[f].append(name)
        loads[f] += specs[name].nbytes
    return members


def module_of(name: str) -> str:
    """The module path owning a parameter: ``blocks.3.fc1.weight`` -> ``blocks.3.fc1`` (root: ``""``)."""
    return name.rpartition(".")[0]


def _contiguous(specs: Mapping[str, ParamSpec], ordered: list[str], n: int) -> list[list[str]]:
    units: dict[str, list[str]] = {}
    for name in ordered:
        # Tensors held by the root module itself have no smaller module to stay with: each is a unit.
        units.setdefault(module_of(name) or name, []).append(name)
    blocks = [units[m] for m in sorted(units, key=natural_key)]
    if len(blocks) < n:
        raise ValueError(f"cannot cut {len(blocks)} modules into {n} non-empty fragments without splitting a "
                         "module: use fewer fragments or an explicit assignment")
    sizes = [sum(specs[x].nbytes for x in b) for b in blocks]
    members: list[list[str]] = [[] for _ in range(n)]
    i, left = 0, sum(sizes)
    for f in range(n):
        frags_left = n - f
        target = left / frags_left
        load, taken = 0, 0
        # At least one module; then take the next while it brings us closer to the target
        # and leaves one module for every later fragment (the last fragment takes the rest).
        while i < len(blocks) and (
            taken == 0 or frags_left == 1
            or (len(blocks) - i > frags_left - 1 and abs(load + sizes[i] - target) < abs(load - target))
        ):
            members[f].extend(blocks[i])
            load += sizes[i]
            i += 1
            taken += 1
        left -= load
    return members


def layout_fingerprint(plan: FragmentPlan) -> str:
    """Hex SHA-256 over the plan version, the rule, the fragment cut, names, global shapes and
    dtype (fp32): islands whose cuts differ in any way get different fingerprints."""
    body = {
        "plan_version": PLAN_VERSION,
        "rule": plan.rule,
        "dtype": "float32",
        "fragments": [[[n, list(plan.specs[n].shape)] for n in names] for names in plan.fragments],
    }
    return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()
