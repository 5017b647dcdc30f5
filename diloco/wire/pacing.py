"""Paced streams: send a fragment's parts a few at a time, control messages never behind them.

zmq hands a message to its I/O thread at once and queues it whole; a socket
given a 1 GiB broadcast queues 1 GiB and delivers a heartbeat sent after it
only when all of it has gone.  So a sender keeps at most ``window`` parts of
each destination in zmq's hands (watched with zmq's ``MessageTracker``: a part
is out of our hands once zmq released its zero-copy frames), sends control
messages straight away, and tops up the window each time it looks.  A slow
link then costs a heartbeat at most ``window`` parts of wait, and memory held
for a slow peer is bounded by the window, not by the fragment.

This is the sender half of the zguide's "credit-based flow control" with the
credit granted by the local zmq queue instead of a message from the receiver:
TCP's own window throttles zmq, and zmq's tracker throttles us.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

log = logging.getLogger(__name__)

PartSource = Callable[[int], "list[Any] | None"]
"""Frames of part ``k`` (header sealed), or None while the payload is not ready yet."""


@dataclass
class Stream:
    """One parted message sequence to one destination (a fragment's BCAST, PUSH, ...).

    Attributes:
        n_parts: number of part messages (0 is allowed: nothing to send).
        frames_of: builds the sealed frames of part ``k`` (None: not ready, ask again later).
        label: for logs.
        done: set once every part left our hands (zmq released its frames), or the stream
            was abandoned; ``ok`` says which.
        data_bytes: payload bytes of every part, counted as each is handed to zmq.
    """

    n_parts: int
    frames_of: PartSource
    label: str = ""
    next_part: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    data_bytes: int = 0
    control_bytes: int = 0
    then: list[list[Any] | Callable[[], list[Any]]] = field(default_factory=list)
    """Control messages that must follow this stream (sent right after its last part): frames,
    or a callable sealing them at that moment (so sequence numbers follow the send order)."""
    on_handed: Callable[[int, Any], None] | None = None
    """Called with ``(k, tracker)`` once part ``k`` was handed to zmq: the sender of a part built
    in a reused buffer learns when zmq lets go of it (``tracker.done``)."""


def send_tracked(sock: zmq.Socket, frames: list[Any], flags: int = 0, track: bool = True) -> zmq.MessageTracker | None:
    """Send one multipart message without copying; with ``track``, a tracker that is done only
    once zmq released **every** frame.

    ``Socket.send_multipart(..., track=True)`` returns the last frame's tracker alone, which is
    done at once when that frame is below ``copy_threshold`` (copied) even though larger frames
    before it are still queued: a buffer reused on that signal would be overwritten under zmq.
    Raises ``zmq.Again`` (nothing sent) like ``send_multipart`` with ``NOBLOCK``: zmq accepts a
    multipart message whole or not at all."""
    trackers = []
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        tracker = sock.send(frame, flags | (zmq.SNDMORE if i < last else 0), copy=False, track=track)
        if track and tracker is not None and not tracker.done:
            trackers.append(tracker)
    return zmq.MessageTracker(*trackers) if track else None


class Pacer:
    """Per-destination windows of parts in flight.  Not thread-safe: one owner thread.

    Args:
        window: parts of one destination that zmq may hold at once.
        send: ``send(dest, frames, track) -> MessageTracker | None``; raises ``zmq.Again``
            when the destination's queue is full (the part is retried later) or another
            ``zmq.ZMQError`` when it is gone (its streams are abandoned).
    """

    def __init__(self, window: int, send: Callable[[bytes, list[Any], bool], Any]) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._send = send
        self._streams: dict[bytes, collections.deque[Stream]] = {}
        self._inflight: dict[bytes, list[tuple[zmq.MessageTracker, Stream, bool]]] = {}

    def add(self, dest: bytes, stream: Stream) -> None:
        if stream.n_parts == 0:
            stream.ok = True
            stream.done.set()
            return
        self._streams.setdefault(dest, collections.deque()).append(stream)

    def last_stream(self, dest: bytes) -> Stream | None:
        """The newest stream to ``dest`` whose last part is not handed to zmq yet, if any."""
        queue = self._streams.get(dest)
        return queue[-1] if queue else None

    def pending(self, dest: bytes | None = None) -> int:
        """Streams not yet fully handed to zmq (for one destination, or all)."""
        if dest is not None:
            return len(self._streams.get(dest, ())) + len(self._inflight.get(dest, ()))
        return sum(len(q) for q in self._streams.values()) + sum(len(v) for v in self._inflight.values())

    def drop(self, dest: bytes, why: str) -> int:
        """Abandon every stream to ``dest`` (it is gone); returns how many."""
        streams = list(self._streams.pop(dest, ()))
        streams += [s for _t, s, _last in self._inflight.pop(dest, [])]
        seen = set()
        for s in streams:
            if id(s) not in seen:
                seen.add(id(s))
                if not s.done.is_set():
                    log.warning("abandoned %s to %s: %s", s.label, dest.hex() if dest else "syncer", why)
                    s.ok = False
                    s.done.set()
        return len(seen)

    def pump(self) -> None:
        """Retire released parts and top up every destination's window (never blocks)."""
        for dest in list(self._inflight):
            still = []
            for tracker, stream, last in self._inflight[dest]:
                if tracker.done:
                    if last:
                        stream.ok = True
                        stream.done.set()
                else:
                    still.append((tracker, stream, last))
            if still:
                self._inflight[dest] = still
            else:
                del self._inflight[dest]
        for dest in list(self._streams):
            queue = self._streams[dest]
            inflight = self._inflight.setdefault(dest, [])
            while queue and len(inflight) < self.window:
                stream = queue[0]
                frames = stream.frames_of(stream.next_part)
                if frames is None:
                    break  # payload not encoded yet
                try:
                    tracker = self._send(dest, frames, True)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    self.drop(dest, f"send failed: {exc}")
                    break
                if stream.on_handed is not None:
                    stream.on_handed(stream.next_part, tracker)
                stream.control_bytes += len(memoryview(frames[0])) + len(memoryview(frames[1]))
                stream.data_bytes += sum(len(memoryview(f)) for f in frames[2:])
                stream.next_part += 1
                last = stream.next_part >= stream.n_parts
                inflight.append((tracker, stream, last))
                if last:
                    queue.popleft()
                    for msg in stream.then:  # zmq keeps order: they follow the last part
                        try:
                            self._send(dest, msg() if callable(msg) else msg, False)
                        except zmq.ZMQError as exc:
                            log.warning("dropped a message after %s: %s", stream.label, exc)
                    stream.then.clear()
            if not queue:
                self._streams.pop(dest, None)
            if not inflight:
                self._inflight.pop(dest, None)

