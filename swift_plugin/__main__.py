"""``python -m swift_plugin``: print the absolute path of the plugin file for ``--external_plugins``.

Used as ``megatron pt ... --external_plugins "$(python -m swift_plugin)" --callbacks yeto``;
the output is the path and nothing else, so it can be substituted into a command line.
"""

from swift_plugin import PLUGIN_PATH

if __name__ == "__main__":
    print(PLUGIN_PATH)
