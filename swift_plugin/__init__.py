"""ms-swift glue: the ``yeto`` Megatron callback that makes an ms-swift job one DiLoCo island.

``plugin.py`` is the file for ``--external_plugins`` (``python -m swift_plugin`` prints its
path); it is the only module that imports ms-swift. The callback's logic is
:class:`swift_plugin.island_callback.YetoIslandHooks`. Importing this package has no side
effect. See ``docs/SWIFT.md``.
"""

import os

PLUGIN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugin.py")
"""Absolute path of the file to pass to ``--external_plugins``."""
