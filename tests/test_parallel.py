"""tests/parallel.py: on several workers, the tests that share a job meet in one worker."""

import subprocess
import sys
import types
from pathlib import Path

from parallel import SHARED, _uses, costs, groups, longest_first

HERE = Path(__file__).parent


def test_files_that_read_one_shared_job_are_one_group_and_the_rest_their_own():
    got = groups({"a.py": {"small_jobs"}, "b.py": {"small_jobs"}, "c.py": set(),
                  "d.py": {"data_jobs"}, "e.py": {"data_jobs", "scale_jobs"},
                  "f.py": {"scale_jobs"}})
    assert got["a.py"] == got["b.py"] == "small_jobs"
    assert got["c.py"] == "c.py"
    # e.py reads two shared jobs: it joins theirs, and f.py comes with scale_jobs
    assert got["d.py"] == got["e.py"] == got["f.py"]
    assert got["a.py"] != got["d.py"]


def test_a_module_uses_what_it_imported_or_imported_names_from():
    small = types.ModuleType("small_jobs")

    def output():
        pass
    output.__module__ = "data_jobs"
    module = types.ModuleType("test_x")
    module.small_jobs, module.output, module.os = small, output, sys
    assert _uses(module) == {"small_jobs", "data_jobs"}
    assert set(SHARED) >= _uses(module)


def test_every_shared_job_module_exists():
    for name in SHARED:
        assert (HERE / f"{name}.py").exists(), name


def test_a_run_on_two_workers_keeps_each_group_on_one_worker(tmp_path):
    # two files read one shared job, two read none: the first two must meet in one worker
    # (each of their tests fails, naming its worker; the other files' tests pass)
    (tmp_path / "small_jobs.py").write_text("")
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
        "from parallel import pytest_collection_modifyitems\n")
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text(
            "import os, small_jobs\n" + "".join(
                f"def test_{i}():\n    assert 0, os.environ['PYTEST_XDIST_WORKER']\n"
                for i in range(4)))
    for name in ("c", "d"):
        (tmp_path / f"test_{name}.py").write_text("".join(
            f"def test_{i}():\n    pass\n" for i in range(4)))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "2", "--dist", "loadgroup", "-rf"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    workers = {line.rsplit("AssertionError: ", 1)[-1].split()[0]
               for line in run.stdout.splitlines() if line.startswith("FAILED")}
    assert run.stdout.count("FAILED") == 8, run.stdout
    assert len(workers) == 1, run.stdout


class _Item:
    def __init__(self, nodeid):
        self.nodeid = nodeid


def test_groups_go_out_largest_budget_first_each_in_its_own_order():
    files = {"a.py": set(), "b.py": {"small_jobs"}, "c.py": set(), "d.py": {"small_jobs"}}
    group = groups(files)
    cost = costs(files, group, {"a.py": 5, "b.py": 1, "d.py": 2, "small_jobs.py": 10})
    assert cost == {"a.py": 5, "small_jobs": 13, "c.py": 0}  # the shared job's line once
    items = [_Item(n) for n in ("c.py::1", "a.py::1", "b.py::1", "a.py::2", "d.py::1")]
    got = [i.nodeid for i in longest_first(items, group, cost)]
    assert got == ["b.py::1", "d.py::1", "a.py::1", "a.py::2", "c.py::1"]


def test_a_run_on_workers_takes_the_groups_in_the_collected_order_not_xdists(tmp_path):
    # xdist's own order (--loadscope-reorder) would run test_b's three tests first; neither
    # file has a budget, so the collected order stands: test_a first
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
        "from parallel import pytest_collection_modifyitems, pytest_configure\n")
    log = tmp_path / "ran"
    for name, count in (("a", 1), ("b", 3)):
        (tmp_path / f"test_{name}.py").write_text("".join(
            f"def test_{i}():\n    open({str(log)!r}, 'a').write('{name}')\n"
            for i in range(count)))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "1", "--dist", "loadgroup"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout
    assert log.read_text() == "abbb", run.stdout
