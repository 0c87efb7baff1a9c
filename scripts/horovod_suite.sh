#!/usr/bin/env bash
# Runs Horovod's own test/parallel/test_torch.py against gradsync.torch, the way horovodrun runs
# it, and prints pytest's counts per rank. Horovod's file is never copied into this repository:
# give a checkout of horovod/horovod, and this script builds, in a temporary folder, a shim that
# makes `horovod.torch` resolve to `gradsync.torch` plus stand-ins for the three helpers of
# Horovod's test/utils/common.py that test_torch.py imports (our own code, written here).
#
#   bash scripts/horovod_suite.sh /path/to/horovod [NP] [pytest -k filter]
#
# Nothing is set by hand for the ranks: `gradsync run` exports horovodrun's HOROVOD_* identity.
set -euo pipefail
src=${1:?usage: horovod_suite.sh HOROVOD_CHECKOUT [NP] [K]}
np=${2:-2}
filter=${3:-}
test_file="$src/test/parallel/test_torch.py"
[ -f "$test_file" ] || { echo "no $test_file: give a checkout of horovod/horovod" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/horovod/torch" "$work/test/parallel" "$work/test/utils"
: > "$work/horovod/__init__.py"
cat > "$work/horovod/torch/__init__.py" <<'PY'
# The shim: horovod.torch is gradsync.torch.
import gradsync.torch as _gradsync_torch

globals().update({name: getattr(_gradsync_torch, name) for name in dir(_gradsync_torch)
                  if not name.startswith("__")})
PY
cat > "$work/test/utils/common.py" <<'PY'
# Stand-ins for the helpers test_torch.py imports from Horovod's test/utils/common.py.
import contextlib
import os
import shutil
import tempfile


def mpi_env_rank_and_size():
    for rank, size in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    test.skipTest(message)


@contextlib.contextmanager
def temppath():
    folder = tempfile.mkdtemp()
    try:
        yield os.path.join(folder, "temp_test_file")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
PY
cp "$test_file" "$work/test/parallel/"
cd "$work/test/parallel"
PYTHONPATH="$work:$work/test:${PYTHONPATH:-}" python3 -m gradsync run -np "$np" \
    python3 -m pytest -q -p no:cacheprovider ${filter:+-k "$filter"} test_torch.py 2>&1 |
    grep -E "^\[[0-9]+\]<stdout>:(=+ )?[0-9]+ (passed|failed)|FAILED" || true
