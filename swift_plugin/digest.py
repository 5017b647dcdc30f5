"""The plugin's optional final digest file (``YETO_DILOCO_DIGEST_FILE``).

After :meth:`diloco.island.boundary.Island.finish` every island holds the syncer's fp32 final
cut. Exporting every fragment again (the same gather the sync core uses for INIT) and hashing
the global fp32 tensors gives one hex string per fragment that must be identical across
islands, whatever their TP / PP / DP layout: a cheap, layout-independent end-to-end check of
export, apply and the final cut on a real run (ms-swift on a GPU, where no test harness can
look inside the ranks).

The export is collective over the island's group: every rank must call :func:`fragment_digests`
at the same point, and only the sync rank gets the result.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from diloco.digest import combined_digest, fragment_digests, tensor_digest

__all__ = ["fragment_digests", "tensor_digest", "write_digest_file"]

log = logging.getLogger(__name__)


def write_digest_file(path: str, island_id: int, versions: Sequence[int], digests: Sequence[str]) -> None:
    """Write the digests as one JSON object, atomically (temporary file, then rename)."""
    total = combined_digest(digests)
    doc = {"island": island_id, "versions": list(versions), "fragments": list(digests), "digest": total}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
        fh.write("\n")
    os.replace(tmp, path)
    log.info("island %d: final digest %s (versions %s) written to %s", island_id, total[:16], list(versions), path)
