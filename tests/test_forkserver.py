"""``gradsync run --start-method forkserver`` (gradsync/run/forkserver.py): which commands a
template forks, the launcher's hold on a forked rank (exit status, signal, deadline), and
launches whose ranks report what they see of their start, against what ``python script.py``
gives a rank the launcher execs."""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from harness import RANKS, marked, new_mark, run_job

from gradsync.run import forkserver
from gradsync.run.forkserver import Forked, Plan, plan

SCRIPT = str(RANKS / "forked_view.py")
DEADLINE = 60.0


# ---------------------------------------------------------------------- which commands


def test_a_template_runs_this_interpreters_scripts_and_modules_only(tmp_path):
    python = sys.executable
    assert plan([python, "train.py", "--n", "3"]) == Plan("train.py", ("--n", "3"), False, False)
    assert plan([python, "-u", "train.py"]) == Plan("train.py", (), False, True)
    assert plan([python, "-u", "-m", "pkg.train", "-x"]) == Plan("pkg.train", ("-x",), True, True)
    # What only a new interpreter can do: it is exec'd.
    for other in ([python, "-c", "print(1)"], [python, "-O", "train.py"], [python],
                  [python, "-m"], ["sh", "-c", "true"], ["no-such-program-gs", "x.py"], []):
        assert plan(other) is None, other
    # The same file reached from another directory is another interpreter (a virtual
    # environment's bin/python links to its base's, with other packages).
    (tmp_path / "bin").mkdir()
    link = tmp_path / "bin" / "python"
    link.symlink_to(os.path.realpath(python))
    assert plan([str(link), "train.py"]) is None


def test_a_name_on_path_is_the_interpreter_it_resolves_to(monkeypatch):
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    assert plan([os.path.basename(sys.executable), "t.py"]) == Plan("t.py", (), False, False)


# ---------------------------------------------------------------------- the launcher's hold


def _child(body) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            body()
        finally:
            os._exit(0)
    return pid


def test_a_forked_rank_gives_its_exit_status_its_signal_and_a_deadline():
    devnull = open(os.devnull, "rb")
    exits = Forked(_child(lambda: os._exit(3)), ["x"], devnull, devnull)
    assert exits.wait(timeout=DEADLINE) == 3 and exits.poll() == 3 and exits.returncode == 3

    sleeper = Forked(_child(lambda: time.sleep(DEADLINE)), ["x"], devnull, devnull)
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.05)
    os.kill(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait() == -signal.SIGKILL  # negative: the signal, as Popen's
    assert sleeper.poll() == -signal.SIGKILL  # reaped once; asked again, the same answer
    devnull.close()


def test_a_handed_template_is_taken_once_and_only_when_it_is_one(monkeypatch):
    monkeypatch.setenv(forkserver.HANDED, "garbage")
    assert forkserver.take_handed() is None and forkserver.HANDED not in os.environ
    read, write = os.pipe()  # a descriptor that is no socket: inherited by mistake
    try:
        monkeypatch.setenv(forkserver.HANDED, f"{read}:1")
        assert forkserver.take_handed() is None
        os.fstat(read)  # not closed: not ours
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.parametrize("preload", [["json"], ["gs_no_such_module"]])
def test_a_handed_template_imports_the_jobs_preload_then_forks_its_ranks(preload, tmp_path,
                                                                         monkeypatch):
    import socket

    script = tmp_path / "rank.py"
    script.write_text("import os, sys\nprint('rank', os.environ['GS_WHO'], 'json' in sys.modules,"
                      " flush=True)\n")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    template = _child(lambda: (ours.close(), forkserver.main([str(theirs.detach())])))
    theirs.close()
    monkeypatch.setenv(forkserver.HANDED, f"{ours.detach()}:{template}")
    handed = forkserver.take_handed()
    assert handed is not None and forkserver.HANDED not in os.environ
    forks = forkserver.Forkserver(preload, handed=handed)
    try:
        forks.begin(dict(os.environ))
        if preload == ["gs_no_such_module"]:  # as in a template of the launcher's own
            with pytest.raises(OSError, match="--preload gs_no_such_module: ModuleNotFoundError"):
                forks.start([sys.executable, str(script)], {**os.environ, "GS_WHO": "0"})
            return
        rank = forks.start([sys.executable, str(script)], {**os.environ, "GS_WHO": "7"},
                           merge_stderr=True)
        assert rank is not None and rank.proc.stderr is None
        assert rank.proc.wait(timeout=DEADLINE) == 0
        assert rank.proc.stdout.read() == b"rank 7 True\n"  # its preload, done before it
    finally:
        forks.close()  # the template ends with its socket, reaped here
    assert handed[1].returncode == 0


# ---------------------------------------------------------------------- launches


def _launch(*words: str, np_: int = 2, env: dict | None = None, cwd=None, mark=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    full_env.update({"OMP_NUM_THREADS": "1"})
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "gradsync", "run", "-np", str(np_), *words]
    # Exec'd, never forked from the session template (tests/harness.py): these tests look at
    # what the launcher and its template are.
    return run_job(cmd, timeout=DEADLINE, env=full_env, cwd=cwd, mark=mark, fork=False)


def _views(output: str) -> dict[int, dict]:
    views = [json.loads(line) for line in re.findall(r"VIEW (\{.*\})", output)]
    return {view["rank"]: view for view in views}


def test_forked_ranks_see_what_python_script_gives_them_and_the_template_leaves(tmp_path):
    mark = new_mark()
    env = {"GS_TEST_MARKER": "from the launcher"}
    result = _launch("--start-method", "forkserver", "--bind-to", "core", "-x",
                     "PYTHONUNBUFFERED=", sys.executable, SCRIPT, "--n", "3",
                     env=env, cwd=tmp_path, mark=mark)
    assert result.returncode == 0, result
    views = _views(result.stdout)
    assert sorted(views) == [0, 1], result
    for view in views.values():
        assert view["argv"] == [SCRIPT, "--n", "3"]  # the script's options are its own
        assert view["path0"] == os.path.dirname(os.path.realpath(SCRIPT))
        assert view["name"] == "__main__" and view["file"] == SCRIPT and view["main_is_us"]
        assert view["cwd"] == str(tmp_path) and view["marker"] == "from the launcher"
        assert view["parent_is_launcher"] and view["leads_its_group"] and view["session_leader"]
        assert view["stdin_empty"] and view["stderr_line_buffering"]
        assert not view["stdout_write_through"]  # a pipe: buffered, as python's (no -u)
        assert view["torch_loaded_before_us"]  # forked from the template, not exec'd
        assert not view["launcher_has_torch"]  # the template's keeper holds the store
        assert view["malloc_kept_at_exec"]  # the template was exec'd with the ranks' settings
    assert len(views[0]["cores"]) == len(views[1]["cores"]) == 1 and \
        views[0]["cores"] != views[1]["cores"]  # bound before the script's first line
    assert views[0]["numpy_draw"] != views[1]["numpy_draw"]  # not the template's state
    # The template ended with the job: no process of it is left.
    end = time.monotonic() + 10
    while marked(mark) and time.monotonic() < end:
        time.sleep(0.05)
    assert marked(mark) == []

    # The same script exec'd: the same view but for what the template imported, and -u.
    result = _launch("--start-method", "exec", sys.executable, "-u", SCRIPT, "--n", "3",
                     env=env, cwd=tmp_path)
    assert result.returncode == 0, result
    for view in _views(result.stdout).values():
        assert not view["torch_loaded_before_us"] and view["stdout_write_through"]
        assert not view["launcher_has_torch"]  # an exec'd keeper holds the store (keeper.py)
        assert view["path0"] == os.path.dirname(os.path.realpath(SCRIPT))


def _become(tmp_path, target: str, *args: str, module: bool = False,
            cwd: str | None = None) -> tuple[int, str, str]:
    """Runs ``forkserver.become`` in a fork of this process, as a template's rank would run
    (its pipes, environment, working directory); its exit status, stdout and stderr."""
    out, err = tmp_path / "out", tmp_path / "err"
    request = {"target": target, "args": list(args), "module": module, "unbuffered": False,
               "env": {**os.environ, "GRADSYNC_RANK": "0",
                       "GRADSYNC_LAUNCHER_PID": str(os.getpid())},
               "cwd": cwd or str(tmp_path), "cores": None}
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the rank
            code = 1
            atexit._clear()  # the exit handlers of the rank's script only, as at its exit
            sys.excepthook = sys.__excepthook__  # a template's: other tests may have set one
            try:
                forkserver.become({**request, "fds": [os.dup(stdout.fileno()),
                                                      os.dup(stderr.fileno())]})
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            finally:
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.read_text(), err.read_text()


def test_a_failing_script_shows_its_own_traceback_and_exits_1(tmp_path):
    code, stdout, stderr = _become(tmp_path, SCRIPT, "--fail")
    assert code == 1 and _views(stdout)[0]["argv"] == [SCRIPT, "--fail"], stderr
    lines = stderr.splitlines()
    start = lines.index("Traceback (most recent call last):")
    assert "forked_view.py" in lines[start + 1], lines  # the script's frame first, not ours
    assert not any("forkserver.py" in line for line in lines), lines
    assert lines[-1] == "RuntimeError: the script failed here"
    # Kept for the exit's handlers, as the interpreter keeps it (the Horovod API's handler
    # tells the other ranks that this one left on an error).
    assert "AT EXIT last_value: RuntimeError('the script failed here')" in stdout


def test_a_module_a_missing_script_and_a_missing_module_start_as_python_would(tmp_path):
    # -m: argv[0] the module's file, the working directory first on sys.path.
    code, stdout, stderr = _become(tmp_path, "forked_view", "--exit", "4", module=True,
                                   cwd=str(RANKS))
    assert code == 4, stderr
    view = _views(stdout)[0]
    assert view["argv"] == [SCRIPT, "--exit", "4"] and view["path0"] == str(RANKS)
    assert view["name"] == "__main__"

    missing = str(tmp_path / "missing.py")
    code, _, stderr = _become(tmp_path, missing)
    assert code == 2 and \
        f"can't open file '{missing}': [Errno 2] No such file or directory" in stderr

    code, _, stderr = _become(tmp_path, "no_such_gs_mod", module=True)
    assert code == 1 and "No module named no_such_gs_mod" in stderr


def test_a_command_a_template_cannot_run_is_execd_in_a_forkserver_job():
    result = _launch("--start-method", "forkserver", sys.executable, "-c",
                     "import sys; print('ran', 'torch' in sys.modules)", np_=1)
    assert result.returncode == 0 and "ran False" in result.stdout, result


def test_a_preload_that_fails_stops_the_job_at_its_start_with_the_import_error():
    result = _launch("--start-method", "forkserver", "--preload", "no_such_gs_module",
                     sys.executable, SCRIPT, np_=1)
    assert result.returncode == 126, result
    assert "cannot start rank 0 on host localhost: the forkserver could not start" in \
        result.stdout
    assert "--preload no_such_gs_module: ModuleNotFoundError" in result.stdout


def test_a_module_marked_optional_is_imported_where_installed_and_else_passed_over():
    """``?MODULE`` (forkserver.ELASTIC_PRELOAD's ``?torch._dynamo``): a template on a machine
    without it starts all the same; an unmarked module that is missing stops the job, as
    above; a marked one that is there is imported."""
    sys.modules.pop("colorsys", None)
    assert forkserver._preload(["?no_such_gs_module", "?colorsys"]) is None
    assert "colorsys" in sys.modules
    assert forkserver._preload(["no_such_gs_module"]) == \
        "--preload no_such_gs_module: ModuleNotFoundError: No module named 'no_such_gs_module'"


def test_the_module_names_what_it_runs():
    assert forkserver.MODULE == forkserver.__name__
