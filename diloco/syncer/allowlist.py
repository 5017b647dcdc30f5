"""The ``--island-keys`` allow-list file: which Curve public key owns which island id.

Read once at start-up by ``cli.py``; the bindings it returns are handed to the core's
:class:`diloco.syncer.core.gate.Gate`, which applies them to every HELLO.
"""

from __future__ import annotations

from pathlib import Path

from zmq.utils import z85


def read_allow_list(path: str, islands: int) -> dict[int, str]:
    """``ID = KEY`` lines of ``--island-keys`` (``#`` comments); ValueError naming the line."""
    out: dict[int, str] = {}
    owners: dict[str, int] = {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--island-keys: cannot read {path!r}: {exc}") from exc
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        ident, sep, key = (s.strip() for s in line.partition("="))
        if not sep or not ident.isdigit() or not 0 <= int(ident) < islands:
            raise ValueError(f"--island-keys {path}:{n}: expected 'ID = KEY' with ID in [0, {islands}), got {raw!r}")
        try:
            ok = len(key) == 40 and len(z85.decode(key.encode())) == 32
        except (ValueError, KeyError, IndexError):
            ok = False
        if not ok:
            raise ValueError(f"--island-keys {path}:{n}: {key[:48]!r} is not a 40-character Z85 public key")
        i = int(ident)
        if i in out or key in owners:
            raise ValueError(f"--island-keys {path}:{n}: island {i} or its key is listed twice")
        out[i], owners[key] = key, i
    return out
