"""``python -m swift_plugin``: print the absolute path of the plugin file for ``--external_plugins``.

Used as ``megatron pt ... --external_plugins "$(python -m swift_plugin)" --callbacks yeto``;
the output is the path and nothing else, so it can be substituted into a command line.
``--help`` prints the usage instead; any other argument is an error (exit 2), so a typo is
never mistaken for a path.
"""

import argparse
import sys

from swift_plugin import PLUGIN_PATH


def main(argv: list[str] | None = None) -> int:
    """Print the plugin path (or the usage with ``--help``); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m swift_plugin",
        description="Print the absolute path of the yeto ms-swift plugin, for "
                    '--external_plugins "$(python -m swift_plugin)" --callbacks yeto (see docs/SWIFT.md).')
    parser.parse_args(argv)
    print(PLUGIN_PATH)
    return 0


if __name__ == "__main__":
    sys.exit(main())
