#!/usr/bin/env bash
# Sets up (scripts/setup.sh), lints (ruff, with the rules of pyproject.toml: seconds) and runs
# the default test tier: everything except the tests marked `slow` (docs/testing.md says which
# those are). Extra arguments go to pytest, so
# `bash scripts/test.sh -m slow` runs the slow tier instead and `-m ""` runs both.
# Multi-process tests start real ranks; each has a deadline that dumps stacks and kills them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check .
python3 -m pytest -q -p no:cacheprovider -m "not slow" "$@"
