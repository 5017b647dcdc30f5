"""Unauthenticated peers against a live syncer, in HMAC and Curve mode: what a stranger may cost.

* Big handshake frames: 32 raw TCP connections speak a ZMTP greeting with the syncer's own
  mechanism, then declare a 60 MiB (then a 4 MiB) command frame and stream its bytes.  libzmq
  buffers handshake frames up to ``ZMQ_MAXMSGSIZE`` before any mechanism runs, so the syncer
  must keep that limit small: its RSS grows < 64 MiB, and a real island still joins.
* Idle connections: 1,500 TCP connections from another source address (127.0.0.2), with
  the syncer started under a soft open-file limit of 1,024: the syncer raises its limit,
  caps connections per address, and a real island still completes HELLO and its initial cut
  within 10 s, while the syncer's CPU stays < 25 % of a core.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from diloco.wire import Bcast, Welcome
from security_setup import P, hello, rss, start

RSS_BOUND = 64 << 20


def greeting(mechanism: str) -> bytes:
    """A ZMTP 3.0 greeting as a client with ``mechanism``."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.encode().ljust(20, b"\x00") + b"\x00" * 32


def big_frame_attack(port: int, mechanism: str, declared: int, conns: int, held: list[socket.socket]) -> int:
    """Open ``conns`` connections that each declare a ``declared``-byte command frame and send
    its bytes (until the syncer cuts them off); returns the bytes the syncer accepted."""
    sent = 0
    blob = b"\x00" * (1 << 20)

    def one() -> None:
        nonlocal sent
        s = socket.socket()
        s.settimeout(2.0)
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(greeting(mechanism))
            s.sendall(b"\x06" + struct.pack(">Q", declared))  # command frame, 8-byte length
            left = declared - 1  # never complete: hold the frame open
            while left > 0:
                n = s.send(blob[: min(len(blob), left)])
                sent += n
                left -= n
        except OSError:
            pass
        held.append(s)

    threads = [threading.Thread(target=one) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return sent


class PeakRss:
    """The syncer's peak RSS, sampled every 10 ms on a thread while the attack runs."""

    def __init__(self, syncer) -> None:
        self.syncer, self.peak, self._stop = syncer, rss(syncer), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.peak = max(self.peak, rss(self.syncer))
            except (OSError, AttributeError):
                return

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def join_new_island(s, island: int, name: str) -> float:
    """A fresh island says HELLO and receives WELCOME and its whole cut; seconds it took."""
    t0 = time.monotonic()
    isl = s.island(island, name)
    try:
        isl.send(hello(isl))
        assert not isl.expect(Welcome, timeout_s=10).header.need_init
        assert [isl.expect(Bcast, timeout_s=10).header.cut for _ in range(P)] == [True] * P
        return time.monotonic() - t0
    finally:
        isl.close()


@pytest.mark.integ
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["curve", "hmac"])
def test_big_handshake_frames_cost_the_syncer_little(tmp_path: Path, mode: str) -> None:
    s = start(tmp_path, mode, extra=["--islands", "3", "--quorum", "2"])
    try:
        port = int(s.syncer.endpoint.rsplit(":", 1)[1])
        time.sleep(0.5)
        rss0 = rss(s.syncer)
        mech = "CURVE" if mode == "curve" else "PLAIN"
        held: list[socket.socket] = []
        peak = PeakRss(s.syncer)
        accepted = big_frame_attack(port, mech, 60 << 20, 32, held)
        accepted += big_frame_attack(port, mech, 4 << 20, 32, held)
        time.sleep(0.5)
        grown = peak.stop() - rss0
        print(f"BIGFRAME mode={mode} bytes_accepted={accepted} peak_rss_growth_mib={grown / 2**20:.2f}")
        assert grown < RSS_BOUND, f"RSS grew by {grown / 2**20:.1f} MiB"
        took = join_new_island(s, 2, "evil")
        assert took < 10.0
        for sock in held:
            sock.close()
    finally:
        s.close()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, clock ticks of 10 ms


@pytest.mark.integ
@pytest.mark.timeout(240)
def test_idle_connection_flood_under_low_fd_limit(tmp_path: Path) -> None:
    s = start(tmp_path, "hmac", extra=["--islands", "3", "--quorum", "2"], soft_nofile=1024)
    held: list[socket.socket] = []
    try:
        port = int(s.syncer.endpoint.rsplit(":", 1)[1])
        assert "open-file limit: soft 1024 ->" in s.syncer.log()
        for _ in range(1500):
            c = socket.socket()
            c.setblocking(False)
            c.bind(("127.0.0.2", 0))
            try:
                c.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            held.append(c)
        time.sleep(1.0)
        cpu0, t0 = _cpu_s(s.syncer.proc.pid), time.monotonic()
        took = join_new_island(s, 2, "evil")
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        cpu = (_cpu_s(s.syncer.proc.pid) - cpu0) / (time.monotonic() - t0)
        print(f"IDLEFLOOD join_s={took:.2f} syncer_cpu={cpu:.2f}")
        assert took < 10.0
        assert cpu < 0.25, f"syncer CPU {cpu:.0%} under 1,500 idle connections"
        assert "connection from 127.0.0.2 refused" in s.syncer.log()
    finally:
        for c in held:
            c.close()
        s.close()
