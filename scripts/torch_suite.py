"""Runs torch's own backend-generic distributed suite on gloo or on gradsync, and counts.

torch ships the tests it runs on every backend in its wheel
(``torch/testing/_internal/distributed/distributed_test.py``); upstream drives them with
``test/distributed/test_distributed_spawn.py``: environment variables BACKEND, WORLD_SIZE and
TEMP_DIR, then one test class, ``TestDistBackend`` + ``DistributedTest._DistTestBase``, whose
every test spawns WORLD_SIZE processes that call ``init_process_group(BACKEND)``. This runner
does the same, outside the package, as upstream runs gloo on CPU (world size 3):

    python3 scripts/torch_suite.py --backend gloo|gradsync [-k PATTERN ...] [--world-size 3]

The suite gates many tests on the literal name "gloo" (at import, in decorators such as
``skip_but_pass_in_sandcastle_if(BACKEND != "gloo", ...)``), so a backend of another name is
offered a different, smaller set. To offer gradsync exactly gloo's tests, the suite is always
imported with BACKEND=gloo, and the tests read "gloo" while they run too (their bodies branch
on it: ``if BACKEND == "gloo": ...``). With ``--backend gradsync`` every process group that
torch is asked for on gloo (``init_process_group``, ``new_group``, ``"cpu:gloo"`` forms) is
created on gradsync instead, in torch's ``_new_process_group_helper``, the one place every
group is made; the group reports its own name ("gradsync"), so the two tests that check that
name against BACKEND (``_NAME_TESTS``) read "gradsync". Nothing else changes: the tests, their
checks and their timeouts are torch's.

The spawned ranks import this file again (as ``__mp_main__``), so what selects the backend
travels in the environment (``TORCH_SUITE_BACKEND``), set before any rank starts.
At the end it prints one line of counts: ``gradsync: 87 run, 87 passed, 0 failed, ...``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import unittest

_BACKEND = os.environ.get("TORCH_SUITE_BACKEND", "gradsync")
# Before the suite's import, which reads them: gloo's name for the gating (see above).
os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", "3")
if "TEMP_DIR" not in os.environ:  # the ranks inherit the parent's
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="torch-suite-")

import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402

if _BACKEND == "gradsync":
    if "GRADSYNC" not in dist.Backend._plugins:  # torch's entry point registers it, if installed
        import gradsync  # noqa: F401  (registers the backend)

    _make_group = c10d._new_process_group_helper

    def _on_gradsync(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        # "gloo", Backend("gloo"), "cpu:gloo,cuda:nccl": every gloo in the spec becomes gradsync.
        spec = str(backend)
        if "gloo" in spec:
            backend = dist.Backend(spec.replace("gloo", "gradsync"))
        return _make_group(group_size, group_rank, global_ranks_in_group, backend,
                           *args, **kwargs)

    c10d._new_process_group_helper = _on_gradsync
elif _BACKEND != "gloo":
    raise SystemExit(f"TORCH_SUITE_BACKEND={_BACKEND!r}: gloo or gradsync")

import torch.testing._internal.distributed.distributed_test as suite  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest, TestDistBackend)

# The tests that check the name the group reports (dist.get_backend() == BACKEND): on
# gradsync they see the name of the backend under test. Every other test reads "gloo" while it
# runs, as the gating did: test bodies branch on it (``if BACKEND == "gloo": ...``).
_NAME_TESTS = {"test_get_backend", "test_Backend_enum_class"}


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """upstream's test_distributed_spawn.py class, as it runs for gloo."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        # In each rank's process, before its init_process_group(BACKEND).
        if _BACKEND == "gradsync" and test_name in _NAME_TESTS:
            suite.BACKEND = "gradsync"
        super()._run(rank, test_name, file_name, pipe, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["gloo", "gradsync"], default="gradsync")
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("-k", action="append", default=[], metavar="PATTERN",
                        help="run the tests whose name contains PATTERN (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the tests' names and stop")
    args = parser.parse_args()
    if args.backend != _BACKEND or str(args.world_size) != os.environ["WORLD_SIZE"]:
        # The choice must be in the environment before this module is imported (by the ranks
        # too): run again with it set.
        env = dict(os.environ, TORCH_SUITE_BACKEND=args.backend,
                   WORLD_SIZE=str(args.world_size))
        os.execvpe(sys.executable, [sys.executable, *sys.argv], env)

    loader = unittest.TestLoader()
    if args.k:
        loader.testNamePatterns = [f"*{k}*" for k in args.k]
    suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    if args.list:
        for test in suite:
            print(test.id().rsplit(".", 1)[-1])
        return 0
    start = time.monotonic()
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    passed = result.testsRun - failed - len(result.skipped) - len(result.expectedFailures)
    print(f"{args.backend}: {result.testsRun} run, {passed} passed, {failed} failed, "
          f"{len(result.skipped)} skipped, {len(result.expectedFailures)} expected failures "
          f"(world size {args.world_size}, {time.monotonic() - start:.0f} s)")
    for test, _ in result.failures + result.errors:
        print(f"FAILED {test.id().rsplit('.', 1)[-1]}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
