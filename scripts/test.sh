#!/usr/bin/env bash
# The README's test command: installs what the suite needs (CPU torch from the local wheel), then runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e ".[test]"
python3 -m pytest -q "$@"
