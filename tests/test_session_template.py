"""Jobs forked from the test session's template (tests/harness.py, "One import of torch for
every job"): the same job as exec'd, and nothing of it outlives its deadline.

A launcher forked from the session template gets a template of its own handed down
(tests/ranks/handed_launcher.py; gradsync/run/forkserver.py, "A template handed down"): its
ranks must see what a rank of an exec'd launcher's template sees, but for the environment the
session template was exec'd with.
"""

import json
import os
import re
import sys
import time

import pytest

import harness
from harness import RANKS, run_job

pytestmark = pytest.mark.multiprocess

VIEW = str(RANKS / "forked_view.py")


def _env(**more: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    env.update({"OMP_NUM_THREADS": "1", "GS_TEST_MARKER": "from the launcher", **more})
    return env


def test_a_forked_launchers_ranks_see_what_an_exec_d_launchers_ranks_see(tmp_path):
    if os.environ.get("GS_TEST_FORK_JOBS") == "0":
        pytest.skip("GS_TEST_FORK_JOBS=0: every job is exec'd")
    cmd = [sys.executable, "-m", "gradsync", "run", "-np", "2", "--bind-to", "core",
           sys.executable, VIEW, "--n", "3"]
    # A template handed down, whatever GS_TEST_START_METHOD says.
    result = run_job(cmd, timeout=60, env=_env(GRADSYNC_START_METHOD="forkserver"), cwd=tmp_path)
    assert result.returncode == 0, result
    assert harness._session, "the job was not forked from the session template"
    views = {v["rank"]: v for v in map(json.loads, re.findall(r"VIEW (\{.*\})", result.output))}
    assert sorted(views) == [0, 1], result
    for view in views.values():
        assert view["argv"] == [VIEW, "--n", "3"] and view["name"] == "__main__"
        assert view["cwd"] == str(tmp_path) and view["marker"] == "from the launcher"
        # Reparented to the launcher (a subreaper) from the template it was handed.
        assert view["parent_is_launcher"] and view["leads_its_group"] and view["session_leader"]
        assert view["torch_loaded_before_us"] and view["launcher_has_torch"]
        assert view["stdin_empty"]
    assert views[0]["cores"] != views[1]["cores"]
    assert views[0]["numpy_draw"] != views[1]["numpy_draw"]
    end = time.monotonic() + 10  # the job's template and store keeper end with it
    while harness.session_forks() and time.monotonic() < end:
        time.sleep(0.05)
    assert harness.session_forks() == []


def test_a_forked_job_past_its_deadline_leaves_no_process(tmp_path):
    if os.environ.get("GS_TEST_FORK_JOBS") == "0":
        pytest.skip("GS_TEST_FORK_JOBS=0: every job is exec'd")
    # Ranks that ignore SIGTERM and outlive their parent, which SIGTERM ends: they are
    # reparented to this process (a subreaper), where only the session's mark finds them.
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print('up', flush=True)\ntime.sleep(120)\n")
    cmd = [sys.executable, str(RANKS / "forked.py"), "2", "2", str(tmp_path), str(script)]
    with pytest.raises(AssertionError, match="deadline"):
        run_job(cmd, timeout=4, grace=1, env=_env(GS_TEST_DEADLINE="120", GS_TEST_FORK_LEAN="1"))
    assert harness._session, "the job was not forked from the session template"
    assert (tmp_path / "0.log").read_text() == "up\n"  # the ranks ran
    end = time.monotonic() + 5
    while harness.session_forks() and time.monotonic() < end:
        time.sleep(0.05)
    assert harness.session_forks() == []


def test_a_job_whose_caller_looks_for_its_mark_is_exec_d(tmp_path):
    mark = harness.new_mark()
    cmd = [sys.executable, "-m", "gradsync", "run", "-np", "2", sys.executable, VIEW]
    result = run_job(cmd, timeout=60, env=_env(), mark=mark)
    assert result.returncode == 0, result
    views = [json.loads(v) for v in re.findall(r"VIEW (\{.*\})", result.output)]
    assert len(views) == 2, result
    for view in views:
        assert not view["launcher_has_torch"]  # exec'd: a keeper holds the store
