"""Transport security: CurveZMQ key pairs, the syncer's ZAP handler, and the client's side.

Why Curve in *both* authenticated modes: zmq holds every frame of an incomplete
multipart message (its pipe high-water mark counts complete messages only, and
``MAXMSGSIZE`` bounds one frame), so a peer that is allowed to send at all can make a
ROUTER buffer without bound before the application sees a byte.  The only place to stop
an unknown peer is the handshake.  So:

* **Curve mode** (``--curve-secret-file`` + ``--curve-clients-dir``): the syncer has a
  long-term key pair, each island its own; the ZAP handler admits only the island public
  keys found in the certificates directory.
* **HMAC mode** (a shared key, no Curve files), for closed networks: the handshake is
  ZMTP's PLAIN mechanism with a password *derived* from the shared key (an HMAC of a
  label), checked by the ZAP handler, so a stranger without the key is dropped in the
  handshake before anything of it is buffered, and the data path pays no encryption (on
  the 16-core GPU host a 1 GiB round took 3.8x the bare-zmq time over key-derived Curve,
  1.3x over PLAIN).  The price, documented in docs/SECURITY.md: the derived password
  travels in clear, so an on-path eavesdropper who captured it can open connections (and
  hold unfinished messages, the memory attack) though never forge a message (the MAC).
  Use Curve mode on links you do not own.
* **Insecure** (``--insecure``): plain TCP, for tests and laptops.

Curve encrypts and authenticates every frame (Poly1305), so in both authenticated modes a
flipped bit in transit is caught by the transport and the chunk digests (xxh3) only guard
against bugs; see docs/SECURITY.md for the figures (keyed BLAKE2b digests would cost ~60x
xxh3 for no gain under Curve).
"""

from __future__ import annotations

import hashlib
import hmac
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

_PLAIN_LABEL = b"yeto-diloco zap plain v1"
PLAIN_USER = "yeto-island"
ZAP_DOMAIN = "yeto"


def derive_password(shared_key: bytes) -> bytes:
    """The PLAIN handshake password of HMAC mode: HMAC-SHA256(key, label), hex (not the key)."""
    return hmac.new(shared_key, _PLAIN_LABEL, hashlib.sha256).hexdigest().encode()


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

    ``clients_dir`` set: Curve mode (reloadable); ``plain_password`` set: HMAC mode's PLAIN
    handshake with the key-derived password."""

    public: bytes
    secret: bytes = field(repr=False)
    clients_dir: str | None = None
    allowed: frozenset[bytes] = field(default_factory=frozenset)
    plain_password: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_files(cls, secret_file: str, clients_dir: str) -> ServerCurve:
        public, secret = load_secret(secret_file)
        allowed = load_client_keys(clients_dir)
        return cls(public, secret, clients_dir, allowed)

    @classmethod
    def from_shared_key(cls, key: bytes) -> ServerCurve:
        return cls(b"", b"", None, frozenset(), derive_password(key))


@dataclass(frozen=True)
class ClientCurve:
    """An island's transport security: the syncer's public key and the island's own pair."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)
    plain_password: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_shared_key(cls, key: bytes) -> ClientCurve:
        return cls(b"", b"", b"", derive_password(key))


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
        if curve.plain_password is not None:
            self._auth.configure_plain(ZAP_DOMAIN, {PLAIN_USER: curve.plain_password.decode()})
        else:
            self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.admitted)

    def secure(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a Curve (or, in HMAC mode, PLAIN) server in our ZAP domain (before ``bind``)."""
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        if self.curve.plain_password is not None:
            sock.plain_server = True
            return
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
    """Make a DEALER a Curve (HMAC mode: PLAIN) client of the syncer (before ``connect``)."""
    if curve.plain_password is not None:
        sock.plain_username = PLAIN_USER.encode()
        sock.plain_password = curve.plain_password
        return
    sock.curve_serverkey = curve.server_public
    sock.curve_publickey = curve.public
    sock.curve_secretkey = curve.secret
