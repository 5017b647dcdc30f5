"""A scripted stand-in for the syncer, for island tests that need to choose exactly what the
island is sent and when (a real ``yeto-syncer`` decides that itself).

A ROUTER socket on a free port, run on a thread; subclasses write ``_script``. Whatever it
raises is kept in ``error`` for the test to check (a failing thread must not pass silently).
Messages go out with the session's nonce and an increasing sequence number, as a real syncer
sends them (docs/SECURITY.md); fragments are small, so each travels as one part of flat segments.
"""

from __future__ import annotations

import threading

import zmq

from diloco import wire


class FakeSyncer(threading.Thread):
    """The socket, the error capture and the sealed send; ``_script`` is the test's."""

    def __init__(self, rcvbuf: int = 0) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvbuf:
            self.sock.setsockopt(zmq.RCVBUF, rcvbuf)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.nonce, self.seq = 0, 0  # the session WELCOME opens (docs/SECURITY.md)

    def run(self) -> None:
        try:
            self._script()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the test
            self.error = exc
        finally:
            self.sock.close()
            self.ctx.term()

    def _script(self) -> None:
        raise NotImplementedError

    def _send(self, peer: bytes, header: wire.Header, tensors: list | None = None) -> None:
        flat = [(n, t.reshape(-1)) for n, t in tensors or []]
        self.seq += 1
        self.sock.send_multipart([peer, *wire.encode(header, flat, nonce=self.nonce, seq=self.seq)], copy=False)
