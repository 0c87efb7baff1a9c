"""What a rank sees of its start (tests/test_forkserver.py): one ``VIEW <json>`` line; with
``--fail``, rank 0 then raises from a function of this script, so the traceback can be read."""

import atexit
import json
import os
import sys

import numpy as np


def main() -> None:
    view = {
        "rank": int(os.environ["GRADSYNC_RANK"]),
        "argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": __file__,
        "main_is_us": sys.modules["__main__"].__dict__ is globals(),
        "cwd": os.getcwd(), "marker": os.environ.get("GS_TEST_MARKER"),
        "parent_is_launcher": os.getppid() == int(os.environ["GRADSYNC_LAUNCHER_PID"]),
        "leads_its_group": os.getpgid(0) == os.getpid(),
        "session_leader": os.getsid(0) == os.getpid(),
        "cores": sorted(os.sched_getaffinity(0)),
        "stdout_write_through": sys.stdout.write_through,
        "stderr_line_buffering": sys.stderr.line_buffering,
        "stdin_empty": sys.stdin.read() == "",
        "numpy_draw": int(np.random.randint(0, 2**62)),
        "torch_loaded_before_us": "torch" in sys.modules,
        # The launcher maps torch's library only where it hosts the store itself (an elastic
        # job), not where a keeper holds it (run/keeper.py).
        "launcher_has_torch": "libtorch" in open(
            f"/proc/{os.environ['GRADSYNC_LAUNCHER_PID']}/maps").read(),
        # glibc read its malloc settings from the environment this process was exec'd with:
        # the template's, for a forked rank.
        "malloc_kept_at_exec": any(v.startswith(b"MALLOC_MMAP_THRESHOLD_=") for v in
                                   open("/proc/self/environ", "rb").read().split(b"\0")),
    }
    print("VIEW " + json.dumps(view), flush=True)
    if "--fail" in sys.argv and view["rank"] == 0:
        atexit.register(lambda: print("AT EXIT last_value:", repr(getattr(sys, "last_value",
                                                                         None)), flush=True))
        deep_in_the_script()
    if "--exit" in sys.argv:
        sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))


def deep_in_the_script() -> None:
    raise RuntimeError("the script failed here")


if __name__ == "__main__":
    main()
