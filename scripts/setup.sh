#!/usr/bin/env bash
# Installs gradsync and its test dependencies into the current Python environment.
# The CPU build of torch goes in first: a bare "torch" requirement would pull the
# multi-gigabyte CUDA build. (Outside this project's machines, add
# --index-url https://download.pytorch.org/whl/cpu to get the CPU build.)
set -euo pipefail
cd "$(dirname "$0")/.."
# Open MPI, the peer of `gradsync bench allreduce --compare mpi` (and of its test), comes from
# the system's packages; mpi4py (a test and bench extra, a binary wheel that loads the runtime
# libmpi.so.40) calls it. Only the runtime: no libopenmpi-dev, which would pull a Fortran
# compiler and autotools. 19 packages, 6 MB: about 5 s to download, 20-27 s to install here.
if ! command -v mpirun >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    mpi="apt-get install -y -q --no-install-recommends openmpi-bin"
    $mpi >/dev/null || { apt-get update -q >/dev/null && $mpi >/dev/null; } ||
        echo "setup: Open MPI not installed; the --compare mpi test will fail with: $mpi" >&2
fi
# A C compiler and Python's headers build the compiled small shared-memory allreduce on first
# use (gradsync/_native.py; tests/test_shm_fast.py fails without them). gradsync itself runs
# without them: it takes its Python path and says so once.
headers=$(python3 -c 'import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))')
if { ! command -v cc >/dev/null || [ "$headers" != True ]; } && command -v apt-get >/dev/null &&
        [ "$(id -u)" = 0 ]; then
    cc_pkgs="apt-get install -y -q --no-install-recommends gcc libc6-dev"
    [ "$headers" = True ] || cc_pkgs="$cc_pkgs python3-dev"
    $cc_pkgs >/dev/null || { apt-get update -q >/dev/null && $cc_pkgs >/dev/null; } ||
        echo "setup: no C compiler or Python headers; small shm allreduces stay in Python: $cc_pkgs" >&2
fi
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
