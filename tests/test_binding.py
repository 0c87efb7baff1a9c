"""``gradsync run --bind-to``: which cores each local rank gets (gradsync/run/binding.py).

The plan against a fake sysfs (hardware threads grouped by core, restricted affinity, too
many ranks), then the launcher binding real ranks on this machine.
"""

import os
import subprocess
import sys

import pytest

from gradsync.run import binding


def _sysfs(tmp_path, monkeypatch, core_of: dict[int, int]):
    for cpu, core in core_of.items():
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text("0\n")
    (tmp_path / "online").write_text(f"0-{max(core_of)}\n")
    monkeypatch.setattr(binding, "_SYS", str(tmp_path))


def test_hardware_threads_of_a_core_go_together(tmp_path, monkeypatch):
    _sysfs(tmp_path, monkeypatch, {0: 0, 1: 1, 2: 0, 3: 1})  # CPUs 0,2 and 1,3 are siblings
    assert binding.cores({0, 1, 2, 3}) == [[0, 2], [1, 3]]
    assert binding.plan("auto", 2, {0, 1, 2, 3}) == [[0, 2], [1, 3]]
    assert binding.plan("core", 1, {0, 1, 2, 3}) == [[0, 2, 1, 3]]  # one rank: every core
    assert binding.online_cpus() == 4


def test_auto_binds_only_what_fits_and_was_not_restricted(tmp_path, monkeypatch):
    _sysfs(tmp_path, monkeypatch, {0: 0, 1: 1, 2: 2, 3: 3})
    assert binding.plan("auto", 4, {0, 1, 2, 3}) == [[0], [1], [2], [3]]
    assert binding.plan("auto", 3, {0, 1, 2, 3}) == [[0], [1], [2]]  # core 3 left over
    assert binding.plan("auto", 2, {0, 1, 2, 3}) == [[0, 1], [2, 3]]  # a share of 2 cores
    assert binding.plan("auto", 5, {0, 1, 2, 3}) is None  # more ranks than cores
    assert binding.plan("auto", 2, {2, 3}) is None  # taskset -c 2,3: that choice stands
    assert binding.plan("core", 2, {2, 3}) == [[2], [3]]  # asked for: within the affinity
    assert binding.plan("none", 2, {0, 1, 2, 3}) is None


def test_core_refuses_more_ranks_than_cores_and_bad_modes(tmp_path, monkeypatch):
    _sysfs(tmp_path, monkeypatch, {0: 0, 1: 0})  # one core, two threads
    with pytest.raises(ValueError, match="2 ranks on this host but only 1 usable cores"):
        binding.plan("core", 2, {0, 1})
    with pytest.raises(ValueError, match="must be one of auto, core, none, got 'socket'"):
        binding.plan("socket", 2, {0, 1})


def test_cpus_without_topology_are_cores_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(binding, "_SYS", str(tmp_path / "missing"))
    assert binding.cores({3, 1}) == [[1], [3]]
    assert binding.online_cpus() == (os.cpu_count() or 1)


_SHOW = "import os; print('cpus', sorted(os.sched_getaffinity(0)))"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["core", "none", "auto under taskset"])
def test_launcher_binds_its_local_ranks(mode):
    usable = sorted(os.sched_getaffinity(0))
    if len(binding.cores(set(usable))) < 2:
        pytest.fail(f"this test needs 2 usable cores, the launcher has CPUs {usable}")
    restrict = None
    if mode == "auto under taskset":  # as `taskset -c <first CPU> gradsync run ...`
        restrict = lambda: os.sched_setaffinity(0, {usable[0]})  # noqa: E731
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    out = subprocess.run([sys.executable, "-m", "gradsync", "run", "-np", "2", "--bind-to",
                          mode.split()[0], sys.executable, "-c", _SHOW], capture_output=True,
                         text=True, timeout=60, env=env, start_new_session=True,
                         preexec_fn=restrict)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = sorted(line.split("cpus ", 1)[1] for line in out.stdout.splitlines() if "cpus" in line)
    if mode == "core":
        want = sorted(str(sorted(c)) for c in binding.plan("core", 2))
    elif mode == "none":
        want = [str(usable)] * 2
    else:  # the user's affinity stands, unchanged
        want = [str([usable[0]])] * 2
    assert seen == want, out.stdout
