#!/usr/bin/env bash
# Sets up, then runs a 4-rank demo job: every collective once, with timings.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
gradsync run -np "${NP:-4}" python3 examples/hello_collectives.py
