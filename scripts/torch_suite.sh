#!/usr/bin/env bash
# Runs torch's own backend-generic distributed suite (torch/testing/_internal/distributed/
# distributed_test.py, shipped in torch's wheel) on gloo and on gradsync, as upstream's
# test/distributed/test_distributed_spawn.py runs gloo on CPU: world size 3, one process per
# rank per test; both backends are offered exactly gloo's tests (scripts/torch_suite.py says
# how). Prints each backend's counts and the tests that failed; nothing is copied from torch.
#
#   bash scripts/torch_suite.sh [gloo|gradsync|both] [-k PATTERN ...]
#
# torch's test utilities import `expecttest` (a test-only dependency of torch's, not in its
# wheel's requirements): `pip install expecttest` first. The whole suite spawns 3 processes
# for each of its ~285 tests: about an hour per backend on 2 cores; narrow it with -k.
# On a machine busier than its cores, gradsync's heartbeat (2 s by default) can declare a
# starved rank lost: GRADSYNC_HEARTBEAT_TIMEOUT=30 is passed through to the ranks.
set -uo pipefail
which=${1:-both}
shift || true
here=$(cd "$(dirname "$0")" && pwd)
python3 -c "import expecttest" 2>/dev/null || {
    echo "torch's test utilities need expecttest: pip install expecttest" >&2; exit 2; }
case $which in
    both) backends="gloo gradsync" ;;
    gloo|gradsync) backends=$which ;;
    *) echo "usage: torch_suite.sh [gloo|gradsync|both] [-k PATTERN ...]" >&2; exit 2 ;;
esac
status=0
summary=""
for backend in $backends; do
    log=$(mktemp "/tmp/torch-suite-$backend.XXXXXX.log")
    echo "== $backend (log: $log)"
    temp=$(mktemp -d)
    TEMP_DIR=$temp TORCH_SUITE_BACKEND=$backend WORLD_SIZE=3 \
        python3 "$here/torch_suite.py" --backend "$backend" --world-size 3 "$@" >"$log" 2>&1
    rc=$?
    rm -rf "$temp"
    [ $rc -eq 0 ] || status=1
    grep -E "^(gloo|gradsync): .* run, |^FAILED " "$log"
    summary+=$(grep -E "^(gloo|gradsync): .* run, " "$log")$'\n'
done
echo "== counts"
printf '%s' "$summary"
exit $status
