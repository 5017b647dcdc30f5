"""gloo bridge: run process groups that span nodes on gloo, device tensors staged through host memory.

Why: nodes without RDMA/RoCE cannot run NCCL/HCCL across nodes. With the
bridge installed (the ms-swift plugin does it when ``YETO_CROSS_NODE_GLOO=1``),
every group whose ranks span more than one node is created with gloo, and the
``torch.distributed`` calls on it copy device tensors to (pinned) host
buffers, run on gloo and copy back; groups inside a node keep the job's
backend. Torch only: nothing else from the project is imported here.

Public API: ``install``, ``uninstall``, ``is_bridged``, ``is_installed``,
``bridge_stats`` and the ``device`` helper module.
"""

from gloo_bridge import device
from gloo_bridge.patching import BridgeConfig, bridge_stats, install, is_bridged, is_installed, uninstall
from gloo_bridge.ops import UnsupportedBridgedOp

__all__ = [
    "BridgeConfig",
    "UnsupportedBridgedOp",
    "bridge_stats",
    "device",
    "install",
    "is_bridged",
    "is_installed",
    "uninstall",
]
