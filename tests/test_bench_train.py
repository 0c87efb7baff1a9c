"""``gradsync bench train`` end to end at 2 ranks, with a few steps: the table's shape, the
DDP comparison, the profile, the JSON rows and the identical-parameters check."""

import json
import re
import subprocess

import pytest

import harness

pytestmark = pytest.mark.multiprocess

TIMEOUT = 120


def bench(*args: str) -> subprocess.CompletedProcess:
    return harness.bench("train", *args, timeout=TIMEOUT)


def _rank0_lines(out: str) -> list[str]:
    """What rank 0 printed, without the launcher's prefix."""
    return [line.split(":", 1)[1] for line in out.splitlines() if line.startswith("[0]<stdout>:")]


def _header(lines: list[str]) -> int:
    """The index of the table's column header."""
    return next(i for i, line in enumerate(lines) if line.split()[:2] == ["model", "params"])


def test_table_ddp_comparison_profile_and_identical_parameters(tmp_path):
    rows_file = tmp_path / "rows.json"
    result = bench("-np", "2", "--compare", "ddp", "--steps", "2", "--windows", "2",
                   "--warmup", "1", "--profile", "--json", str(rows_file))
    out = result.stdout
    assert result.returncode == 0, out
    lines = _rank0_lines(out)
    assert "[1]<stdout>:" not in out, out  # only rank 0 prints
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
    rows = json.loads(rows_file.read_text())
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


def test_fsdp_comparison_over_gloo_and_the_backend_and_the_cost_of_observing(tmp_path):
    """With ``--overhead`` too (in this run, so as to start no job of its own): gradsync with
    the flight recorder and the straggler watch off, window for window beside it on."""
    rows_file = tmp_path / "rows.json"
    result = bench("-np", "2", "--compare", "fsdp", "--model", "mlp", "--steps", "2",
                   "--windows", "3", "--warmup", "1", "--overhead", "--json", str(rows_file))
    out = result.stdout
    assert result.returncode == 0, out
    lines = _rank0_lines(out)
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
    [row] = json.loads(rows_file.read_text())
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


def test_bad_option_fails_before_any_rank_starts():
    result = bench("-np", "2", "--model", "resnet")
    assert result.returncode == 2
    assert "invalid choice: 'resnet'" in result.stdout


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
