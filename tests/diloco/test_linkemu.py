"""The link emulator of the test support (tests/support/linkemu.py): bytes, order, faults.

Rate and delay are checked loosely and only here, as properties of the emulator itself
(lower bounds: a link may be slower than asked on a busy machine, never faster).
"""

from __future__ import annotations

import hashlib
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import linkemu  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class _Echo:
    """A TCP server that echoes each connection's bytes back (and counts connections)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.received = 0
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(1 << 16):
                    self.received += len(data)
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def _roundtrip(port: int, payload: bytes, timeout: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        got = bytearray()
        sender = threading.Thread(target=c.sendall, args=(payload,), daemon=True)
        sender.start()
        while len(got) < len(payload):
            data = c.recv(1 << 16)
            if not data:
                break
            got += data
        sender.join(timeout)
        return bytes(got)


def test_bytes_arrive_intact_in_order_and_are_counted() -> None:
    echo = _Echo()
    payload = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4, every offset distinguishable
    with linkemu.LinkEmulator(("127.0.0.1", echo.port), linkemu.LinkSpec(jitter_s=0.002, delay_s=0.001)) as emu:
        got = _roundtrip(emu.port, payload)
        assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
        deadline = time.monotonic() + 5
        while emu.carried(linkemu.DOWN) < len(payload) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert emu.carried(linkemu.UP) == len(payload) == emu.carried(linkemu.DOWN)
        assert emu.connections() == 1 and echo.accepted == 1
    echo.close()


def test_rate_and_delay_are_lower_bounds() -> None:
    echo = _Echo()
    rate, delay, n = 2_000_000.0, 0.05, 400_000
    spec = linkemu.LinkSpec(up_bytes_s=rate, down_bytes_s=rate, delay_s=delay)
    with linkemu.LinkEmulator(("127.0.0.1", echo.port), spec) as emu:
        t0 = time.monotonic()
        assert _roundtrip(emu.port, b"x") == b"x"
        assert time.monotonic() - t0 >= 2 * delay  # one byte still pays the delay both ways
        t0 = time.monotonic()
        assert len(_roundtrip(emu.port, b"y" * n)) == n
        assert time.monotonic() - t0 >= 0.8 * n / rate  # the pipe never runs faster than its rate
        assert emu.connections() == 2
    echo.close()


def test_armed_reset_cuts_the_connection_once() -> None:
    echo = _Echo()
    with linkemu.LinkEmulator(("127.0.0.1", echo.port), linkemu.LinkSpec()) as emu:
        emu.arm_reset(linkemu.UP, 100_000)
        with pytest.raises(OSError):
            with socket.create_connection(("127.0.0.1", emu.port), timeout=10) as c:
                for _ in range(1000):  # 1 MB: the reset comes long before
                    c.sendall(b"z" * 1000)
                    c.recv(1 << 16)
                c.recv(1)
                raise AssertionError("no reset")  # pragma: no cover
        assert emu.stats.resets == 1
        assert echo.received <= 100_000
        # The rule fired once: the next connection carries everything.
        assert _roundtrip(emu.port, b"w" * 200_000) == b"w" * 200_000
        assert emu.connections() == 2
    echo.close()


def test_an_outage_refuses_connections_until_the_link_comes_back() -> None:
    echo = _Echo()
    outage = 1.0
    with linkemu.LinkEmulator(("127.0.0.1", echo.port), linkemu.LinkSpec()) as emu:
        emu.arm_reset(linkemu.UP, 1000, outage_s=outage)
        with pytest.raises(OSError):
            _roundtrip(emu.port, b"v" * 100_000, timeout=5)
            raise ConnectionResetError("a short echo")  # the reset may also end the echo short
        t_reset = time.monotonic()
        with pytest.raises(OSError):  # during the outage: reset at once, the server never sees it
            with socket.create_connection(("127.0.0.1", emu.port), timeout=5) as c:
                c.sendall(b"u")
                if not c.recv(1):
                    raise ConnectionResetError("closed")
        assert emu.stats.refused >= 1 and echo.accepted == 1 and emu.connections() == 1
        time.sleep(max(0.0, t_reset + outage + 0.1 - time.monotonic()))
        assert _roundtrip(emu.port, b"t" * 1000) == b"t" * 1000  # the link is back
        assert emu.connections() == 2 and emu.stats.resets == 1
    echo.close()


def test_reset_all_on_command() -> None:
    echo = _Echo()
    with linkemu.LinkEmulator(("127.0.0.1", echo.port), linkemu.LinkSpec(delay_s=0.01)) as emu:
        c = socket.create_connection(("127.0.0.1", emu.port), timeout=10)
        c.sendall(b"a")
        assert c.recv(1) == b"a"
        assert emu.reset_all() == 1
        with pytest.raises(OSError):
            c.sendall(b"b" * 100_000)
            if not c.recv(1):
                raise ConnectionResetError("closed")
        c.close()
    echo.close()


def test_spec_is_validated() -> None:
    with pytest.raises(ValueError, match="delay_s"):
        linkemu.LinkSpec(delay_s=-1)
