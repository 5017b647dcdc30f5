"""Step log: one JSON line per training step, written by an island's sync rank 0.

The step log is how an operator sees what synchronisation costs a run: how long
each step boundary took and where that time went (export, apply, waiting), how
many bytes moved, which rounds were pushed and applied, and how stale the
applied values were. ``diloco.steplog_report`` (console script
``yeto-steplog``) turns one log per island into a table and plots.

Format: UTF-8 JSON Lines, one object per step boundary (plus one for start-up and
one per finishing boundary, told apart by ``phase``), with exactly the fields of
:class:`StepRecord` (the schema is the contract between the step boundary, which
fills it, and the report). Bytes are exact and belong to the event that moved them:
a push's payload on its push event, an apply's on its apply event; what belongs to
no event (headers, heartbeats) is counted as control bytes per record. Extra keys are ignored by the reader so the
schema may grow; missing or mistyped keys make a line malformed. ``loss`` may be
``NaN`` (Python's JSON extension) when training diverged: that is information,
not an error.

Failure semantics: the log is an observer. A write error (disk full, file
removed) is logged once and disables the log; it never raises into the training
loop, because stopping one island over a diagnostic file would be worse than
losing the diagnostic. A killed job leaves at most one truncated last line;
:func:`read_steplog` drops it, and a restarted job appending to the same file
starts on a fresh line so its first record is not glued to the fragment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import IO, Any, Protocol

logger = logging.getLogger(__name__)


PHASES = ("start", "train", "finish")
"""Where a record was written: in :meth:`Island.start`, at a training step boundary, or in
:meth:`Island.finish` (start-up and finish records do not stand for a training step)."""


@dataclass(frozen=True)
class BoundaryRecord:
    """What one island boundary did: returned by ``Island.step_end`` (and written, with the
    timing and diagnostics of :class:`StepRecord`, as one line of the step log).

    Identical on every rank of the island except the byte counts, which are what *this
    process* moved to or from the syncer (so 0 on ranks other than the sync rank).
    """

    step: int
    """The last training step finished (0 during start-up; the last step during finish)."""
    phase: str
    """``"start"``, ``"train"`` or ``"finish"`` (see :data:`PHASES`)."""
    pushed: tuple[int, ...]
    """Fragments whose delta was pushed in this boundary (answering the syncer's pulls)."""
    applied: tuple[int, ...]
    """Fragments whose committed merge was applied in this boundary."""
    installed: tuple[int, ...]
    """Fragments overwritten by a cut (initial cut, rejoin) or the final cut in this boundary."""
    versions: tuple[int, ...]
    """Per fragment, the version held after this boundary (-1: none yet)."""
    blocked_s: float
    """Seconds the training loop was blocked in this boundary (export + apply + wait + other)."""
    data_bytes_sent: int
    """Tensor payload bytes this process queued for the syncer here: the sum of the
    ``data_bytes`` of this record's push and init events."""
    data_bytes_recv: int
    """Tensor payload bytes received from the syncer and installed here: the sum of the
    ``data_bytes`` of this record's apply, cut and final events."""
    pushes: int
    """Pushes exported so far (cumulative; one the send queue dropped counts, its event says so)."""
    applies: int
    """Committed merges applied so far (cumulative; cut installs excluded)."""


@dataclass(frozen=True)
class StepRecord(BoundaryRecord):
    """One line of the step log: a :class:`BoundaryRecord` plus timing and diagnostics.

    Times are seconds (floats), sizes bytes. Counters named "cumulative" count
    from the start of this process; the others cover this record only.
    """

    time: float
    """Unix time (s) when the boundary ended."""
    step_s: float
    """Wall time (s) from the end of the previous boundary to the start of this
    one, i.e. the training step itself (0 outside the train phase)."""
    export_s: float
    """Time (s) gathering fragments for pushes (and INIT) to the sync rank."""
    apply_s: float
    """Time (s) scattering and writing received fragments into the model."""
    wait_s: float
    """Time (s) waiting on the syncer, the client thread or island collectives."""
    control_bytes_sent: int
    """Non-payload bytes (MACs, headers, heartbeats, acks) the client sent since the previous
    record; they belong to no event."""
    control_bytes_recv: int
    """Non-payload bytes (MACs, headers, pulls, heartbeats) received since the previous record."""
    round: int
    """Latest round number seen in a pull (0: none yet)."""
    attempt: int
    """Attempt of that latest pull (-1: none yet)."""
    events: list[dict[str, Any]]
    """What happened in this boundary, in order. Known types, each with the payload bytes it
    moved as ``data_bytes`` (numel x wire itemsize):
    ``{"type": "push", "fragment", "round", "attempt", "base_version", "local_steps",
    "data_bytes", "dropped"}`` (``dropped``: the send queue was full, nothing moved, the
    syncer re-pulls); ``{"type": "apply", "fragment", "version", "round", "data_bytes",
    "lag_steps"}`` where ``lag_steps`` is the number of steps between this island's push for
    that round and applying its commit; ``{"type": "init", "fragment", "data_bytes"}``,
    ``{"type": "cut", "fragment", "version", "data_bytes"}`` (a cut fragment installed) and
    ``{"type": "final", "versions", "data_bytes"}``. A push runs in the background after its
    boundary: its event says what the client will send; when the send queue refused it, a
    later record carries ``{"type": "push_dropped", "fragment", "round", "attempt",
    "local_steps", "data_bytes"}`` with the bytes that did not move (the syncer re-pulls).
    ``{"type": "refused", "count", "data_bytes": 0}``: messages from the syncer this island
    refused (failed validation) since the previous record. ``{"type": "link", "up_bytes_s",
    "down_bytes_s", "rtt_s", "queue", "data_bytes": 0}``: the link to the syncer as the client
    measures it (smoothed), in records that pushed or applied. An ``apply`` also carries
    ``commit_s``, the syncer's commit time of that version, and ``arrived_at``, the wall time
    its last part arrived (so its push record's ``time`` → ``arrived_at`` is the round's latency
    as this island saw it: push up, the syncer's wait and commit, broadcast down). A round value
    staged in the background also carries ``staged_from`` (wall time its staging began on this
    rank) and ``stage_s`` (how long staging took): it is installed at the first boundary after.
    Readers ignore types they do not know."""
    loss: float | None
    """Training loss of this step, when the loop reports one."""
    island: int
    """Island id (0-based) that wrote the log."""

    def boundary(self) -> BoundaryRecord:
        """The :class:`BoundaryRecord` part (what ``step_end`` returned for this line)."""
        return BoundaryRecord(**{f.name: getattr(self, f.name) for f in _BOUNDARY_FIELDS})


_BOUNDARY_FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(BoundaryRecord)
_FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(StepRecord)
_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in _FIELDS)
_INT_FIELDS = frozenset({"step", "data_bytes_sent", "data_bytes_recv", "control_bytes_sent", "control_bytes_recv",
                         "pushes", "applies", "round", "attempt", "island"})
_FLOAT_FIELDS = frozenset({"time", "step_s", "blocked_s", "export_s", "apply_s", "wait_s"})
_INT_TUPLE_FIELDS = ("pushed", "applied", "installed", "versions")
_BYTE_FIELDS = ("data_bytes_sent", "data_bytes_recv", "control_bytes_sent", "control_bytes_recv")


class RecordView(Protocol):
    """What :class:`StepLog` hands every record to (``diloco.steplog_scalars.ScalarView`` is one).

    ``enabled`` is read once, at construction (a disabled view is not kept); ``add`` gets every
    record, with or without a file; ``flush`` is called once, at :meth:`StepLog.close`.
    """

    @property
    def enabled(self) -> bool: ...

    def add(self, rec: StepRecord) -> None: ...

    def flush(self) -> None: ...


class StepLog:
    """Appends :class:`StepRecord` lines to a file; a no-op when ``path`` is None.

    Use one per island, on sync rank 0 only (other ranks pass ``None`` or do not
    create one), from the training thread: it is not thread-safe and need not
    be. The file is opened in append mode, line-buffered, so every record is on
    disk (in the OS cache) when :meth:`record` returns, at the cost of one
    ``write`` per step; a crash loses at most the line being written.

    Args:
        path: file to append to (parent directories are created), or ``None``
            to disable logging (``YETO_DILOCO_STEP_LOG`` unset).
        scalars: a view that writes sync scalars from every record to the job's
            TensorBoard / wandb writers (``diloco.steplog_scalars``); it gets every
            record, with or without a file.
    """

    def __init__(self, path: str | None, scalars: RecordView | None = None) -> None:
        self.path = path
        self.scalars = scalars if scalars is not None and scalars.enabled else None
        self._file: IO[str] | None = None
        if path is None:
            return
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        # A previous run killed mid-write left a line without its newline;
        # start on a fresh line so that fragment stays one (skipped) bad line
        # instead of swallowing our first record.
        if self._file.tell() > 0 and not _ends_with_newline(path):
            self._file.write("\n")

    @property
    def enabled(self) -> bool:
        """True while records are being written (a path was given, not closed, no write error)."""
        return self._file is not None

    def record(self, entry: StepRecord) -> None:
        """Append one record as a JSON line; never raises on I/O errors (see module doc)."""
        if self.scalars is not None:
            self.scalars.add(entry)
        if self._file is None:
            return
        # Build the dict by hand: dataclasses.asdict deep-copies every event,
        # which is wasted work on a path that runs at every step.
        line = json.dumps({name: getattr(entry, name) for name in _FIELD_NAMES}, separators=(",", ":"))
        # (tuples are written as JSON lists; parse_record turns them back into tuples)
        try:
            self._file.write(line + "\n")
        except (OSError, ValueError) as exc:
            logger.warning("step log %s: write failed (%s); step logging disabled", self.path, exc)
            self._close_quietly()

    def close(self) -> None:
        """Flush and close the file (and flush the scalar writers); further records are dropped. Idempotent."""
        if self.scalars is not None:
            self.scalars.flush()
            self.scalars = None
        if self._file is None:
            return
        try:
            self._file.close()
        except OSError as exc:
            logger.warning("step log %s: close failed (%s)", self.path, exc)
        self._file = None

    def _close_quietly(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


@dataclass(frozen=True)
class StepLogContents:
    """Result of reading a step log, with what had to be skipped."""

    records: list[StepRecord]
    """Valid records in file order."""
    malformed: int
    """Lines skipped because they were not a valid record (truncated tail excluded)."""
    truncated_tail: bool
    """True if the last line had no newline and did not parse (a killed writer)."""


def read_steplog_contents(path: str) -> StepLogContents:
    """Read a step log, skipping bad lines and counting them.

    A last line without a trailing newline that does not parse is the mark of
    a killed job and is dropped silently (``truncated_tail``); any other line
    that is not a valid record is counted in ``malformed`` and reported in one
    warning. Blank lines are ignored.
    """
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        text = f.read()
    lines = text.split("\n")
    # split() leaves "" after a final newline; otherwise the last item is a
    # line the writer never finished.
    tail_unterminated = lines[-1] != ""
    records: list[StepRecord] = []
    malformed = 0
    truncated_tail = False
    first_bad: tuple[int, str] | None = None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(parse_record(line))
        except ValueError as exc:
            if tail_unterminated and lineno == len(lines):
                truncated_tail = True
                continue
            malformed += 1
            if first_bad is None:
                first_bad = (lineno, str(exc))
    if first_bad is not None:
        logger.warning(
            "step log %s: skipped %d malformed line(s); first at line %d: %s",
            path, malformed, first_bad[0], first_bad[1],
        )
    if truncated_tail:
        logger.info("step log %s: ignored a truncated last line (writer was killed)", path)
    return StepLogContents(records=records, malformed=malformed, truncated_tail=truncated_tail)


def read_steplog(path: str) -> list[StepRecord]:
    """Return the valid records of a step log (see :func:`read_steplog_contents`)."""
    return read_steplog_contents(path).records


def parse_record(line: str) -> StepRecord:
    """Parse and type-check one JSON line; raise ``ValueError`` saying what is wrong.

    Checks are strict where the report computes with the value (ints are ints,
    not bools or floats; times are finite and non-negative) so one corrupt line
    cannot skew a summary; unknown extra keys are ignored.
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    missing = [name for name in _FIELD_NAMES if name not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    for name in _INT_FIELDS:
        if not _is_int(obj[name]):
            raise ValueError(f"field {name} is not an integer")
    for name in _FLOAT_FIELDS:
        value = obj[name]
        if not _is_number(value) or not math.isfinite(value) or (name != "time" and value < 0):
            raise ValueError(f"field {name} is not a finite non-negative number")
    if any(obj[name] < 0 for name in _BYTE_FIELDS):
        raise ValueError("negative byte count")
    if obj["phase"] not in PHASES:
        raise ValueError(f"field phase is not one of {', '.join(PHASES)}")
    for name in _INT_TUPLE_FIELDS:
        value = obj[name]
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise ValueError(f"field {name} is not a list of integers")
    events = obj["events"]
    if not isinstance(events, list) or not all(isinstance(e, dict) and isinstance(e.get("type"), str) for e in events):
        raise ValueError("field events is not a list of objects with a string 'type'")
    loss = obj["loss"]
    if loss is not None and not _is_number(loss):
        raise ValueError("field loss is neither a number nor null")
    values = {name: obj[name] for name in _FIELD_NAMES}
    for name in _INT_TUPLE_FIELDS:
        values[name] = tuple(values[name])
    for name in _FLOAT_FIELDS:
        values[name] = float(values[name])
    if loss is not None:
        values["loss"] = float(loss)
    return StepRecord(**values)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
