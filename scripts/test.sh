#!/usr/bin/env bash
# The README's test command: installs what the suite needs (CPU torch from the local wheel), then runs
# EVERYTHING: the fast set and the integ tests (`-m ""` lifts pyproject's default `-m 'not integ'`).
# Extra arguments go to pytest (a later `-m` wins).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e ".[test]"
python3 -m pytest -q -m "" "$@"
