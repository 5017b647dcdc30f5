"""The demo's training text, shipped inside the package.

The demo trains a small character-level GPT on CPU and must work on a machine
with no network, so the corpus (public-domain Shakespeare, see
``diloco/data/NOTICE.txt``) is package data read through
:mod:`importlib.resources`: it resolves the same way from a source checkout,
an installed wheel or a zip import, without assuming a file-system path.
"""

from __future__ import annotations

from importlib import resources

CORPUS_RESOURCE = "data/corpus.txt"
"""Path of the corpus inside the ``diloco`` package (declared as package data)."""


def load_corpus() -> str:
    """Return the whole demo corpus as one string (UTF-8, ``\\n`` line ends).

    Read on every call (a few hundred KB, once per process in practice) rather
    than cached, so callers may mutate nothing shared.
    """
    return resources.files("diloco").joinpath(CORPUS_RESOURCE).read_text(encoding="utf-8")
