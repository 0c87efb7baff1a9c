"""The harness's report of a failed job: the reason a rank failed is never cut away.

A test asserts with the job's result as its message (``assert r.returncode == 0, r``); pytest
cut such a message to 240 characters in its middle, and a CI failure showed "worker 0 exited
1" without the traceback that said why (``harness.report``). These run pytest on such an
assertion and read what it prints.
"""

import re
import subprocess
import sys
import pytest

import harness

REASON = "AssertionError: worker 0's counter is 11, expected 12"


def _job_output(after: int) -> str:
    """A failed job's output: some start-up lines, rank 0's traceback, then ``after`` lines
    of the other ranks being stopped."""
    lines = [f"[{r}]<stdout>:rank {r} starts step {s}" for s in range(20) for r in range(3)]
    lines += ["[0]<stderr>:Traceback (most recent call last):",
              '[0]<stderr>:  File "tests/ranks/ps_check.py", line 120, in main',
              "[0]<stderr>:    check(counters)", f"[0]<stderr>:{REASON}"]
    lines += [f"[{1 + i % 2}]<stderr>:stopped while waiting for rank 0 ({i})"
              for i in range(after)]
    lines.append("gradsync run: rank 0 on host localhost exited with status 1; stopped 2 "
                 "other ranks")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """What pytest prints for ``assert r.returncode == 0, r``, ``r`` a failed job's
    ``harness.Result``: by output, a short one (``short``) and one of about 100 KB
    (``long``). One pytest run for both."""
    where = tmp_path_factory.mktemp("failures")
    tests = ["import sys", f"sys.path.insert(0, {str(harness.RANKS.parent)!r})",
             "import harness"]
    for name, after in (("short", 40), ("long", 2000)):
        (where / f"{name}.txt").write_text(_job_output(after))
        tests += [f"def test_{name}():",
                  f"    r = harness.Result(1, open({str(where / name)!r} + '.txt').read())",
                  "    assert r.returncode == 0, r"]
    (where / "test_jobs.py").write_text("\n".join(tests) + "\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_jobs.py"], capture_output=True, text=True, timeout=120,
                          cwd=where)
    assert done.returncode == 1, done.stdout + done.stderr
    # pytest's report: a section per failed test, headed "___ test_<name> ___".
    parts = re.split(r"_{3,} test_(short|long) _{3,}", done.stdout)
    return dict(zip(parts[1::2], parts[2::2]))


def test_a_failed_jobs_message_shows_its_whole_output_with_the_reason(failures):
    shown = failures["short"]
    assert REASON in shown
    assert "rank 0 on host localhost exited with status 1; stopped 2 other ranks" in shown
    assert "rank 2 starts step 19" in shown  # nothing cut: the output fits the report
    assert "[..." not in harness.Result(1, _job_output(after=40))


def test_a_long_failed_jobs_message_keeps_the_first_traceback_and_the_tail(failures):
    output = _job_output(after=2000)
    assert len(output) > 3 * harness.REPORT_CHARS  # past the report's bound
    shown = failures["long"]
    assert "[0]<stderr>:Traceback (most recent call last):" in shown
    assert REASON in shown
    assert "stopped while waiting for rank 0 (1999)" in shown
    assert "exited with status 1; stopped 2 other ranks" in shown
    report = harness.Result(1, output)
    assert len(report) <= harness.REPORT_CHARS + 200
    assert report.startswith("exit 1\n") and report.output == output == report.stdout


def test_a_long_report_keeps_the_first_stack_dump_of_a_rank_at_its_deadline():
    # All ranks hung: each dumps its stacks at its deadline (faulthandler), the first one
    # far from the end of a long output.
    dump = ["[0]<stderr>:Timeout (0:02:22)!",
            "[0]<stderr>:Thread 0x00007f59381d3b80 (most recent call first):",
            '[0]<stderr>:  File "gradsync/data/loader.py", line 271 in _adopt']
    later = [f"[{1 + i % 3}]<stderr>:  File \"threading.py\", line {i} in wait"
             for i in range(3000)]
    report = harness.Result(1, "\n".join(["[0]<stdout>:start"] * 50 + dump + later) + "\n")
    assert "\n".join(dump) in report and later[-1] in report
    assert len(report) <= harness.REPORT_CHARS + 200


def test_a_spawned_ranks_report_names_the_rank():
    rank = harness.Rank(2, 3, _job_output(after=5))
    assert rank.startswith("rank 2 exit 3\n") and REASON in rank
    assert (rank.rank, rank.returncode) == (2, 3)
