#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite. Multi-process tests start real
# ranks through `gradsync run`; each has a deadline that dumps stacks and kills its ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest -q -p no:cacheprovider "$@"
