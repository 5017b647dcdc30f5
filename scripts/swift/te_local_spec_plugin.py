"""``--external_plugins`` helper for machines WITHOUT transformer_engine (the device test only).

The swift GPU kit's ``te_shim`` (on ``PYTHONPATH`` with ``SWIFT_TE_SHIM=1``) stubs
transformer_engine so that mcore-bridge imports; this plugin then switches mcore-bridge to
megatron-core local layer specs (``local_spec_patch.apply``). Real deployments have
transformer_engine and must not load this file. Pass it before the yeto plugin.
"""

import logging
import sys

import swift.megatron.callbacks  # noqa: F401  (imports mcore_bridge: the shim installs its stub here)

if getattr(sys.modules.get("transformer_engine"), "__version__", None) == "0.0.0":  # the shim's stub
    import local_spec_patch

    local_spec_patch.apply()
    logging.getLogger("swift_plugin").warning("te_local_spec_plugin: transformer_engine is stubbed; "
                                              "mcore-bridge builds megatron-core local layer specs")
