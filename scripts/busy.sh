#!/usr/bin/env bash
# Runs the README's test command (scripts/test.sh) beside CPU burners: the default tier as
# it runs on a busy developer machine or a shared CI host (issue 36). BURNERS (default 2)
# processes spin on the cores for the whole run and are stopped when it ends, however it ends.
# Extra arguments go to pytest, as with scripts/test.sh; the exit status is the tests'.
#
#   bash scripts/busy.sh                  # the default tier beside two burners
#   BURNERS=4 bash scripts/busy.sh -x tests/test_connections.py
set -euo pipefail
cd "$(dirname "$0")/.."
burners=()
stop_burners() { ((${#burners[@]})) && kill "${burners[@]}" 2>/dev/null; wait 2>/dev/null || true; }
trap stop_burners EXIT
for _ in $(seq "${BURNERS:-2}"); do
    python3 -c 'while True: pass' &
    burners+=("$!")
done
echo "busy: ${#burners[@]} CPU burners running (pids ${burners[*]}) beside the tests"
start=$SECONDS
rc=0
bash scripts/test.sh "$@" || rc=$?
echo "busy: tests exit $rc after $(( SECONDS - start ))s beside ${#burners[@]} burners"
exit "$rc"
