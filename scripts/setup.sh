#!/usr/bin/env bash
# Installs gradsync and its test dependencies into the current Python environment.
# The CPU build of torch goes in first: a bare "torch" requirement would pull the
# multi-gigabyte CUDA build. (Outside this project's machines, add
# --index-url https://download.pytorch.org/whl/cpu to get the CPU build.)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
