"""The per-file time budgets (tests/budgets.py): the budgets file, the machine factor and the
verdicts on given numbers; then pytest itself on a small project whose tests' durations are
set by its conftest, so that a whole run's table, its exit status and the time charged to a
shared job are checked without waiting for any of it."""

import subprocess
import sys
from pathlib import Path

import pytest

import budgets
from budgets import judge, read_budgets

HERE = Path(__file__).parent


def test_the_budgets_file_reads_both_tiers_and_names_a_bad_line(tmp_path):
    path = tmp_path / "budgets.txt"
    path.write_text("# file  default  slow\n"
                    "test_a.py  12  -    # only in the default tier\n"
                    "\n"
                    "test_b.py  -   300\n"
                    "test_c.py  2.5 40\n")
    assert read_budgets(path) == {"default": {"test_a.py": 12.0, "test_c.py": 2.5},
                                  "slow": {"test_b.py": 300.0, "test_c.py": 40.0},
                                  "both": {"test_a.py": 12.0, "test_b.py": 300.0,
                                           "test_c.py": 42.5}}
    path.write_text("test_a.py 12\n")
    with pytest.raises(ValueError, match=r"budgets.txt:1: want 'FILE DEFAULT SLOW'"):
        read_budgets(path)


def test_the_project_budgets_name_files_that_exist():
    for tier in read_budgets().values():
        for name in tier:
            assert name == "small_jobs.py" or (HERE / name).exists(), name


def _files(seconds: dict, budget: float = 10.0):
    """Eight files on budget, plus ``seconds`` (name: time) each of ``budget``."""
    spent = {f"test_{i}.py": budget for i in range(8)}
    spent.update(seconds)
    return spent, {name: budget for name in spent}


def _verdicts(spent, budgets_):
    factor, rows = judge(spent, budgets_)
    return factor, {name: verdict for name, _, _, verdict in rows}


def test_a_file_far_over_its_budget_fails_and_one_a_little_over_is_listed():
    factor, got = _verdicts(*_files({"grew.py": 25.0, "a_bit.py": 14.0, "fine.py": 9.0}))
    assert factor == 1.0
    assert got["grew.py"] == "FAIL"  # 2.5 times its budget, 15 s more
    assert got["a_bit.py"] == "over"  # 1.4 times: listed, fails nothing
    assert got["fine.py"] == "ok" and got["test_0.py"] == "ok"


def test_the_margin_is_twice_the_budget_and_10_s_more():
    # 12 s against 5: twice, but not 10 s more; 41 s against 30: 11 s more, not twice
    spent, budgets_ = _files({"small.py": 12.0, "large.py": 41.0})
    budgets_.update({"small.py": 5.0, "large.py": 30.0})
    assert _verdicts(spent, budgets_)[1]["small.py"] == "over"
    assert _verdicts(spent, budgets_)[1]["large.py"] == "over"
    spent["small.py"], spent["large.py"] = 15.1, 60.1  # past both
    got = _verdicts(spent, budgets_)[1]
    assert got["small.py"] == "FAIL" and got["large.py"] == "FAIL", got


def test_a_slower_machine_scales_every_budget_and_still_finds_the_file_that_grew():
    spent, budgets_ = _files({"grew.py": 25.0})
    slow = {name: 3 * seconds for name, seconds in spent.items()}  # 3 times slower, all
    factor, got = _verdicts(slow, budgets_)
    assert factor == pytest.approx(3.0)
    assert got["grew.py"] == "FAIL" and got["test_0.py"] == "ok"
    slow["grew.py"] = 3 * 14.0  # a little over on the slow machine too: listed only
    assert _verdicts(slow, budgets_)[1]["grew.py"] == "over"


def test_on_several_workers_a_file_fails_only_past_three_times_its_scaled_budget():
    spent, budgets_ = _files({"beside.py": 25.0})  # 2.5x: what ran beside it, not growth
    assert _verdicts(spent, budgets_)[1]["beside.py"] == "FAIL"  # one worker: it grew
    assert judge(spent, budgets_, budgets.WIDE_WORKERS)[1][0][3] == "over"
    spent["beside.py"] = 31.0
    assert judge(spent, budgets_, budgets.WIDE_WORKERS)[1][0][3] == "FAIL"


def test_a_faster_machine_does_not_tighten_the_budgets():
    spent, budgets_ = _files({"same.py": 10.0})
    fast = {name: seconds / 4 for name, seconds in spent.items()}
    fast["same.py"] = 10.0  # four times the others' pace, but within its own budget
    factor, got = _verdicts(fast, budgets_)
    assert factor == 1.0 and got["same.py"] == "ok"


def test_too_few_files_give_no_factor_and_no_failure():
    spent = {"test_a.py": 100.0, "test_b.py": 1.0}
    factor, got = _verdicts(spent, {"test_a.py": 10.0, "test_b.py": 10.0})
    assert factor is None
    assert got == {"test_a.py": "over", "test_b.py": "ok"}
    # files of budgets under 5 s do not set the factor: many of them still give none
    small = {f"test_{i}.py": 1.0 for i in range(20)}
    assert judge(small, {name: 1.0 for name in small})[0] is None
    assert _verdicts({"new.py": 3.0}, {})[1] == {"new.py": "no budget"}


# --- pytest on a small project ----------------------------------------------------------------

CONFTEST = """\
import sys, time
sys.path.insert(0, {tests!r})
import pytest
from budgets import (pytest_addoption, pytest_runtest_logreport, pytest_runtest_makereport,
                     pytest_sessionfinish, pytest_terminal_summary)

SECONDS = {seconds!r}  # a test's call phase takes this long, by its file's name

class Durations:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        if call.when == "call":
            report.duration = SECONDS.get(item.path.name, 0.0)

def pytest_configure(config):
    config.pluginmanager.register(Durations())
"""

SHARED = """\
import budgets

def test_pays_for_a_shared_job(monkeypatch):
    times = iter([100.0, 160.0])  # the job's start and end, on the plugin's clock
    monkeypatch.setattr(budgets, "clock", lambda: next(times))
    with budgets.charged_to("shared_job.py"):
        pass
"""


def _project(tmp_path, grown: float) -> Path:
    """Nine test files of 10 s budgets: eight take 10 s, ``test_grew.py`` ``grown`` s; and
    ``test_shared.py``, whose test pays 60 s for a job charged to ``shared_job.py``."""
    tmp_path.mkdir(exist_ok=True)
    seconds = {f"test_{i}.py": 10.0 for i in range(8)}
    seconds["test_grew.py"] = grown
    seconds["test_shared.py"] = 61.0
    for name in seconds:
        (tmp_path / name).write_text(SHARED if name == "test_shared.py" else
                                     "def test_one():\n    pass\n")
    (tmp_path / "conftest.py").write_text(CONFTEST.format(tests=str(HERE), seconds=seconds))
    (tmp_path / "budgets.txt").write_text(
        "".join(f"{name} 10 -\n" for name in seconds if name != "test_shared.py")
        + "test_shared.py 2 -\nshared_job.py 60 -\n")
    return tmp_path


def _pytest(project: Path, *args: str):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "not slow", "--budgets-file", str(project / "budgets.txt"),
                           *args], cwd=project, capture_output=True, text=True, timeout=120)


def test_a_run_prints_each_file_against_its_budget_and_charges_a_shared_job(tmp_path):
    run = _pytest(_project(tmp_path, grown=25.0))
    assert run.returncode == 0, run.stdout + run.stderr  # report only: it fails nothing
    out = run.stdout
    assert "time per test file against its budget" in out, out
    assert "machine factor 1.00" in out, out
    lines = {line.split()[-1]: line for line in out.splitlines() if " budget " in line}
    assert "FAIL" in lines["test_grew.py"] and "25.0 s" in lines["test_grew.py"], out
    assert "would fail with --budgets=enforce" in out, out
    # the 60 s of the shared job are its own, not those of the test that ran it
    assert "60.0 s" in lines["shared_job.py"] and "ok" in lines["shared_job.py"], out
    assert " 1.0 s" in lines["test_shared.py"] and "ok" in lines["test_shared.py"], out


def test_a_job_charged_in_a_worker_is_charged_in_the_run_on_several_workers(tmp_path):
    # pytest-xdist: the charge is made in a worker and the controller adds up the run
    run = _pytest(_project(tmp_path, grown=10.0), "-n", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = {line.split()[-1]: line for line in run.stdout.splitlines() if " budget " in line}
    assert "60.0 s" in lines["shared_job.py"], run.stdout
    assert " 1.0 s" in lines["test_shared.py"], run.stdout


def test_enforce_fails_a_run_for_a_file_far_over_its_budget(tmp_path):
    # (a file a little over its budget fails nothing: the verdicts above)
    grew = _pytest(_project(tmp_path, grown=25.0), "--budgets=enforce")
    assert grew.returncode == 1, grew.stdout
    assert "10 passed" in grew.stdout and "fails the run" in grew.stdout, grew.stdout


def test_the_module_names_its_margin():
    # docs/testing.md states these numbers; a change to them changes the docs
    assert (budgets.WIDE, budgets.WIDE_S, budgets.WIDE_WORKERS) == (2.0, 10.0, 3.0)
    assert (budgets.FACTOR_FLOOR_S, budgets.FACTOR_FILES) == (5.0, 8)
