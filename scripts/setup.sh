#!/usr/bin/env bash
# Installs gradsync and its test dependencies into the current Python environment.
# The CPU build of torch goes in first: a bare "torch" requirement would pull the
# multi-gigabyte CUDA build. (Outside this project's machines, add
# --index-url https://download.pytorch.org/whl/cpu to get the CPU build.)
set -euo pipefail
cd "$(dirname "$0")/.."
# Open MPI, the peer of `gradsync bench allreduce --compare mpi` (and of its test), comes from
# the system's packages; mpi4py (a test and bench extra) calls it.
if ! command -v mpirun >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q openmpi-bin libopenmpi-dev >/dev/null; }
fi
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
