"""``gradsync bench train`` at 2 ranks, with a few steps: the table's shape, the DDP and FSDP
comparisons, the profile, the cost of observing, the JSON rows and the identical-parameters
check.

The two runs were a job of their own each (``gradsync bench train -np 2``: the command,
``gradsync run`` and two ranks, each importing torch and building the models), whose time was
mostly those start-ups. Now one job of two ranks, forked from one process that imported torch
once (tests/forked_jobs.py), runs the benchmark's module twice, each run a fresh job with its
own arguments (tests/ranks/bench_runs.py), and each test reads its own run's output and rows.
The command line that starts the ranks, which the shared job does not run, has tests of its
own that start nothing."""

import json
import re

import pytest

import forked_jobs

pytestmark = pytest.mark.multiprocess  # (the tests of the command line start nothing)

MODULE = "gradsync.bench.train"
# A check of the benchmark's logic and output, not of its timing: few steps of small batches.
SHORT = ["--steps", "2", "--warmup", "1", "--batch-size", "8"]
RUNS = [
    {"name": "ddp", "args": ["--compare", "ddp", "--windows", "2", "--profile", *SHORT]},
    # --overhead too (in this run, so as to start no job of its own)
    {"name": "fsdp", "args": ["--compare", "fsdp", "--model", "mlp", "--windows", "3",
                              "--overhead", *SHORT]},
]
"""The runs of the shared job, in order, each with ``--json NAME.json``."""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The shared job of ``RUNS`` at 2 ranks. Timeout: each run had a job of 120 s; together,
    forked, they took 48 s on the 2-core machine at a load of 15, where their two jobs had
    taken 105 s at a load of 14 (2026-11-29)."""
    folder = tmp_path_factory.mktemp("bench-train")
    runs = [{**run, "module": MODULE, "args": [*run["args"], "--json",
                                                str(folder / f"{run['name']}.json")]}
            for run in RUNS]
    return forked_jobs.bench_runs(2, runs, folder, timeout=240)


def _run(job, name: str) -> tuple[list[str], list]:
    """What run ``name`` printed on rank 0, line by line, and its JSON rows; fails its test
    unless the run returned on both ranks (the module's exit status 0: the parameters were
    identical)."""
    assert job.ran(name), job
    return job.stdout(name).splitlines(), json.loads((job.folder / f"{name}.json").read_text())


def _header(lines: list[str]) -> int:
    """The index of the table's column header."""
    return next(i for i, line in enumerate(lines) if line.split()[:2] == ["model", "params"])


def test_table_ddp_comparison_profile_and_identical_parameters(job):
    lines, rows = _run(job, "ddp")
    out = "\n".join(lines)
    assert job.stdout("ddp", 1) == "", job  # only rank 0 prints
    header = _header(lines)
    names = lines[header].split()
    assert names == ["model", "params", "batch", "|", "single", "local", "|", "gradsync", "iqr%",
                     "eff", "comm", "|", "ddp", "iqr%", "eff", "comm", "|", "ddp-gs", "iqr%",
                     "eff", "comm", "|", "gs/ddp", "dgs/ddp", "dgs/gs"], out
    table = [line.split() for line in lines[header + 1:header + 3]]
    assert [row[0] for row in table] == ["mlp", "cnn"], out
    for row in table:
        assert len(row) == len(names), out
        rates = [float(row[i]) for i, name in enumerate(names)
                 if name in ("single", "local", "gradsync", "ddp", "ddp-gs")]
        assert all(rate > 0 for rate in rates), out
    for model in ("mlp", "cnn"):
        assert re.search(rf"# {model}: parameters identical on all 2 ranks after training: "
                         r"gradsync yes \(crc32 [0-9a-f]{8}\), ddp yes \(crc32 [0-9a-f]{8}\), "
                         r"ddp_gs yes \(crc32 [0-9a-f]{8}\)",
                         out), out
    profile = [line.split() for line in lines
               if re.match(r"\s*(mlp|cnn)\s+(local|gradsync|ddp|ddp_gs)\s", line)]
    assert sorted((p[0], p[1]) for p in profile) == sorted(
        (m, mode) for m in ("mlp", "cnn") for mode in ("local", "gradsync", "ddp", "ddp_gs")), out
    assert [row["model"] for row in rows] == ["mlp", "cnn"]
    for row in rows:
        assert row["identical"] is True
        assert row["ratio"] == pytest.approx(row["gradsync"]["samples_per_s"]
                                             / row["ddp"]["samples_per_s"])
        assert row["ratio_ddp_gs"] == pytest.approx(row["ddp_gs"]["samples_per_s"]
                                                    / row["ddp"]["samples_per_s"])
        assert len(row["checksums"]["gradsync"]) == 2
        for mode, phases in row["profile_ms"].items():
            # Per step the slowest rank's compute is at least rank 0's, so their medians too.
            assert phases["compute_slowest"] >= phases["compute"] > 0, (mode, phases)


def test_fsdp_comparison_over_gloo_and_the_backend_and_the_cost_of_observing(job):
    """With ``--overhead`` too: gradsync with the flight recorder and the straggler watch off,
    window for window beside it on."""
    lines, [row] = _run(job, "fsdp")
    out = "\n".join(lines)
    header = _header(lines)
    assert lines[header].split()[11:] == [
        "|", "gs-off", "iqr%", "on/off",
        "|", "fsdp", "iqr%", "eff", "comm", "|", "fsdp-gs", "iqr%", "eff", "comm", "|",
        "gs/fsdp", "fgs/fsdp", "fgs/gs"], out
    # FSDP's shards are gathered for the checksum: the whole parameters, the same on every
    # rank and the same as DistributedOptimizer's after the same steps.
    assert re.search(r"# mlp: parameters identical on all 2 ranks after training: gradsync yes "
                     r"\(crc32 ([0-9a-f]{8})\), fsdp yes \(crc32 \1\), fsdp_gs yes \(crc32 \1\); "
                     r"gradsync and fsdp agree; fsdp_gs and fsdp agree", out), out
    assert row["identical"] is True and "ddp" not in row
    ratios = row["observed_ratios"]
    assert len(ratios) == 3 and row["observed_ratio"] == sorted(ratios)[1]
    assert row["gradsync_off"]["samples_per_s"] > 0
    # Off: no record kept, no step measured; on: both (the job's defaults), 3 windows x 2.
    assert row["observed"]["off"] == {"records": 0, "steps": 0}, row["observed"]
    assert row["observed"]["on"]["records"] > 0 and row["observed"]["on"]["steps"] == 6, row
    assert row["ratio_fsdp_gs"] == pytest.approx(row["fsdp_gs"]["samples_per_s"]
                                                 / row["fsdp"]["samples_per_s"])
    assert row["ratio"] == pytest.approx(row["gradsync"]["samples_per_s"]
                                         / row["fsdp"]["samples_per_s"])


def test_the_command_starts_the_ranks_through_gradsync_run(monkeypatch):
    """The part of ``gradsync bench train -np 2 ARGS`` that the shared job does not run: it
    starts ``gradsync run -np 2 python -m gradsync.bench.train ARGS``."""
    import sys

    from gradsync.bench import cli
    from gradsync.run.cli import main

    started = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: started.append(cmd) or 0)
    args = ["--compare", "fsdp", "--model", "mlp", "--overhead"]
    assert main(["bench", "train", "-np", "2", *args]) == 0
    assert started == [[sys.executable, "-m", "gradsync", "run", "-np", "2",
                        sys.executable, "-m", MODULE, *args]]


def test_bad_option_fails_before_any_rank_starts(monkeypatch, capsys):
    from gradsync.bench import cli
    from gradsync.run.cli import main

    started = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: started.append(cmd) or 0)
    with pytest.raises(SystemExit) as error:
        main(["bench", "train", "-np", "2", "--model", "resnet"])
    assert error.value.code == 2 and started == []
    assert "invalid choice: 'resnet'" in capsys.readouterr().err


class _Recorder:
    def __init__(self):
        self.size, self.kept = 8, []

    def resize(self, size):
        self.size = size

    def records(self):
        return self.kept


class _Meter:
    def __init__(self):
        self.on, self.step = True, 0

    def pause(self, on):
        self.on = on


class _Publisher:
    paused = False


@pytest.mark.parametrize("control", [False, True])
def test_overhead_turns_the_observers_off_for_gs_off_and_the_control_does_not(control):
    """``--overhead`` turns the recorder, the meter and the publisher off in gs-off's windows
    and back on after; ``--overhead-control`` leaves them on, so that its on/off reads only
    the two trainers' difference."""
    from gradsync.bench.train import _Observers

    recorder, meter, publisher = _Recorder(), _Meter(), _Publisher()
    observers = _Observers(recorder, meter, publisher, control=control)
    with observers.window("gradsync_off"):
        assert (recorder.size, meter.on, publisher.paused) == \
            ((8, True, False) if control else (0, False, True))
    assert (recorder.size, meter.on, publisher.paused) == (8, True, False)
    with observers.window("gradsync"):
        assert (recorder.size, meter.on, publisher.paused) == (8, True, False)
