#!/usr/bin/env bash
# Sets up (scripts/setup.sh), lints (ruff, with the rules of pyproject.toml: seconds), checks
# the types of the public modules, the runtime and the launcher (mypy, 152 files: those of
# pyproject.toml's [tool.mypy], with its settings; about 16 s of CPU on a fresh clone, under a
# second with its cache, .mypy_cache) and runs the default test tier: everything except the
# tests marked `slow` (docs/testing.md says which those are).
# A lint error stops it before the tests. The type check runs beside the tests, its report
# printed after theirs; a type error fails the run as a failed test does. Extra arguments go
# to pytest, so `bash scripts/test.sh -m slow` runs the slow tier instead and `-m ""` runs both.
# Multi-process tests start real ranks; each has a deadline that dumps stacks and kills them.
# The tests run on GS_TEST_WORKERS pytest workers at once (pytest-xdist; tests/parallel.py
# keeps the tests that share a job in one worker and hands the largest groups out first): most
# of a tier's time is ranks waiting, which other tests' ranks fill (docs/testing.md, "Several
# workers"). GS_TEST_WORKERS=0 runs everything in one process, one test after the other.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is cached (the ignored __pycache__ folders) even where the environment says not to:
# the tiers start thousands of interpreters and pytest workers that would otherwise compile the
# same sources and rewrite the same tests' asserts each time. From a fresh state (every
# __pycache__ removed) on the 2-core machine, the default tier took 318 s of pytest and 597 s
# of CPU with PYTHONDONTWRITEBYTECODE=1, 286 s and 538 s without it (docs/testing.md).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
python3 -m ruff check .
types=$(mktemp)
trap 'rm -f "$types"' EXIT
python3 -m mypy >"$types" 2>&1 &
mypy_pid=$!
status=0
python3 -m pytest -q -p no:cacheprovider -n "${GS_TEST_WORKERS:-3}" --dist loadgroup \
    -m "not slow" "$@" || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat "$types"
if [ "$mypy_status" -ne 0 ]; then
    echo "test.sh: the type check failed (mypy, above)" >&2
    [ "$status" -ne 0 ] || status=$mypy_status
fi
exit "$status"
