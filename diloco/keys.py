"""The shared HMAC key file, read the same way by islands and the syncer.

One reader so that both sides agree on what a key file means (its bytes, surrounding
whitespace stripped) and refuse the same mistakes (unreadable, empty) — a key that one
side trims and the other does not would make every message fail authentication.
"""

from __future__ import annotations


def read_key_file(path: str) -> bytes:
    """The key in ``path``; raises ValueError with a one-line reason (the caller names its flag)."""
    try:
        with open(path, "rb") as fh:
            key = fh.read().strip()
    except OSError as exc:
        raise ValueError(f"{path!r} cannot be read: {exc.strerror or exc}") from exc
    if not key:
        raise ValueError(f"{path!r} is empty")
    return key
