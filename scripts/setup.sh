#!/usr/bin/env bash
# Installs gradsync and its test dependencies into the current Python environment (use a
# virtual environment where the system Python refuses pip, PEP 668). SETUP_EXTRAS names the
# extras (default `test`; CI adds `ecosystem`: Ray Train for the slow tier). Not a GRADSYNC_*
# name: those are gradsync's settings, and init() refuses one it does not know.
#
# The CPU build of torch goes in first, and stays: a bare "torch" requirement would pull the
# multi-gigabyte CUDA build, so every later install runs under a constraint that keeps
# torch==2.13.0 (Ray's or Lightning's requirements cannot upgrade it). Outside this project's
# machines, add --index-url https://download.pytorch.org/whl/cpu to the first install to get
# the CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${GRADSYNC_TORCH:-torch==2.13.0}
extras=${SETUP_EXTRAS:-test}
# Open MPI, the peer of `gradsync bench allreduce --compare mpi` (and of its test), comes from
# the system's packages; mpi4py (a binary wheel that loads the runtime libmpi.so.40) calls it.
# Only the runtime: no libopenmpi-dev, which would pull a Fortran compiler and autotools.
# 19 packages, 6 MB: about 5 s to download, 20-27 s to install here.
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
# An environment that this script has set up from these same files, and that still holds the
# install, is left alone: scripts/setup_current.py says when (a stamp in site-packages, and
# every requirement checked). Otherwise, and always on a fresh machine, pip runs.
if python3 scripts/setup_current.py check "$extras" "$TORCH" 2>/dev/null; then
    echo "setup: already installed here, unchanged (scripts/setup_current.py): pip skipped"
    exit 0
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" >"$constraints"
python3 -m pip install -q "$TORCH"
python3 -m pip install -q -c "$constraints" -e ".[$extras]"
# mpi4py only where Open MPI is: without libmpi its import raises, and Lightning's environment
# detection imports it whenever it is installed ("RuntimeError: cannot load MPI library").
if command -v mpirun >/dev/null; then
    python3 -m pip install -q -c "$constraints" "mpi4py>=4.0"
fi
python3 scripts/setup_current.py write "$extras" "$TORCH"
