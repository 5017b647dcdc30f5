"""Transport security: CurveZMQ key pairs, the syncer's ZAP handler, and the client's side.

Why Curve in *both* authenticated modes: zmq holds every frame of an incomplete
multipart message (its pipe high-water mark counts complete messages only, and
``MAXMSGSIZE`` bounds one frame), so a peer that is allowed to send at all can make a
ROUTER buffer without bound before the application sees a byte.  The only place to stop
an unknown peer is the handshake.  So:

* **Curve mode** (``--curve-secret-file`` + ``--curve-clients-dir``): the syncer has a
  long-term key pair, each island its own; the ZAP handler admits only the island public
  keys found in the certificates directory.
* **HMAC mode** (a shared key, no Curve files): both key pairs are *derived* from the
  shared key (SHA-256 of a label and the key), and the ZAP handler admits only the
  derived island key.  Anyone without the key fails the handshake, so it costs nothing;
  anyone with it could also forge MACs, so this adds no trust, only the pre-buffer check.
* **Insecure** (``--insecure``): plain TCP, for tests and laptops.

Curve encrypts and authenticates every frame (Poly1305), so in both authenticated modes a
flipped bit in transit is caught by the transport and the chunk digests (xxh3) only guard
against bugs; see docs/SECURITY.md for the figures (keyed BLAKE2b digests would cost ~60x
xxh3 for no gain under Curve).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

_LABEL = b"yeto-diloco curve v1 "
ZAP_DOMAIN = "yeto"


def derive_keypair(shared_key: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 Curve keys derived from the shared HMAC key for ``role``
    (``"syncer"`` or ``"island"``): every holder of the key derives the same pairs."""
    if role not in ("syncer", "island"):
        raise ValueError(f"role must be 'syncer' or 'island', got {role!r}")
    secret = z85.encode(hashlib.sha256(_LABEL + role.encode() + b"\0" + shared_key).digest())
    return zmq.curve_public(secret), secret


def load_secret(path: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ``zmq.auth`` secret certificate; ValueError names the problem."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path!r} is not a readable zmq certificate: {exc}") from exc
    if secret is None:
        raise ValueError(f"{path!r} holds no secret key (pass the .key_secret file)")
    return public, secret


def load_public(value: str) -> bytes:
    """A Z85 public key given as the 40-character key itself or as a certificate file."""
    text = value.strip()
    if len(text) == 40:
        try:
            if len(z85.decode(text.encode())) == 32:
                return text.encode()
        except (ValueError, KeyError, IndexError):
            pass
    if os.path.isfile(text):
        try:
            public, _ = zmq.auth.load_certificate(text)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{text!r} is not a readable zmq certificate: {exc}") from exc
        return public
    raise ValueError(f"{text[:60]!r} is neither a 40-character Z85 public key nor a certificate file")


def load_client_keys(directory: str) -> frozenset[bytes]:
    """Every public key (Z85) of the ``*.key`` / ``*.key_secret`` certificates in ``directory``."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{directory!r} is not a directory")
    keys = set()
    for cert in sorted(path.iterdir()):
        if cert.suffix in (".key", ".key_secret") and cert.is_file():
            try:
                public, _ = zmq.auth.load_certificate(str(cert))
            except (OSError, ValueError) as exc:
                raise ValueError(f"{str(cert)!r} is not a readable zmq certificate: {exc}") from exc
            keys.add(public)
    return frozenset(keys)


@dataclass(frozen=True)
class ServerCurve:
    """The syncer's transport security: its key pair and where the admitted island keys come from.

    ``clients_dir`` set: Curve mode (reloadable); else ``allowed`` is the derived island key."""

    public: bytes
    secret: bytes = field(repr=False)
    clients_dir: str | None = None
    allowed: frozenset[bytes] = field(default_factory=frozenset)

    @classmethod
    def from_files(cls, secret_file: str, clients_dir: str) -> ServerCurve:
        public, secret = load_secret(secret_file)
        allowed = load_client_keys(clients_dir)
        return cls(public, secret, clients_dir, allowed)

    @classmethod
    def from_shared_key(cls, key: bytes) -> ServerCurve:
        public, secret = derive_keypair(key, "syncer")
        return cls(public, secret, None, frozenset({derive_keypair(key, "island")[0]}))


@dataclass(frozen=True)
class ClientCurve:
    """An island's transport security: the syncer's public key and the island's own pair."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def from_shared_key(cls, key: bytes) -> ClientCurve:
        public, secret = derive_keypair(key, "island")
        return cls(derive_keypair(key, "syncer")[0], public, secret)


class _Admitted:
    """ZAP credentials provider: the set of admitted island keys, swappable at run time."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys
        self.denied = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.keys
        if not ok:
            with self._lock:
                self.denied += 1
                first = self.denied <= 5 or self.denied % 1000 == 0
            if first:  # one line per refusal would let a stranger fill the log
                log.warning("ZAP: refused a Curve handshake from an unlisted key %s (%d refused so far)",
                            key.decode(errors="replace")[:40], self.denied)
        return ok


class ServerAuth:
    """The ZAP handler of one ROUTER socket (a pyzmq ``ThreadAuthenticator``)."""

    def __init__(self, ctx: zmq.Context[Any], curve: ServerCurve) -> None:
        self.curve = curve
        self.admitted = _Admitted(curve.allowed)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("diloco.security.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.admitted)

    def secure(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a Curve server in our ZAP domain (before ``bind``)."""
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.curve_secretkey = self.curve.secret
        sock.curve_publickey = self.curve.public
        sock.curve_server = True

    def reload(self) -> int:
        """Re-read the certificates directory (key rotation without a restart); returns the key count."""
        if self.curve.clients_dir is None:
            return len(self.admitted.keys)
        self.admitted.keys = load_client_keys(self.curve.clients_dir)
        log.info("ZAP: %d island keys admitted from %s", len(self.admitted.keys), self.curve.clients_dir)
        return len(self.admitted.keys)

    def stop(self) -> None:
        self._auth.stop()


def secure_client(sock: zmq.Socket[Any], curve: ClientCurve) -> None:
    """Make a DEALER a Curve client of the syncer (before ``connect``)."""
    sock.curve_serverkey = curve.server_public
    sock.curve_publickey = curve.public
    sock.curve_secretkey = curve.secret
