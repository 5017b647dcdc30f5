"""Read TensorBoard event files back (tests): ``{tag: [(step, value), ...]}`` per run directory."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``logdir`` (not recursive), by tag, in step order."""
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
