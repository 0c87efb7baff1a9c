"""``gradsync bench ps`` end to end, with tiny settings: the throughput table beside gRPC (its
shape, the verification, the JSON rows) and the straggler experiment in all four modes."""

import json
import re
import subprocess

import grpc  # noqa: F401  (the test extra installs it; missing, the run must fail)
import pytest

import harness

pytestmark = pytest.mark.multiprocess

TIMEOUT = 120


def bench(*args: str) -> subprocess.CompletedProcess:
    return harness.bench("ps", *args, timeout=TIMEOUT)


@pytest.mark.slow  # over 15 s on 2 cores: the slow tier (docs/testing.md)
def test_throughput_table_beside_grpc_is_verified(tmp_path):
    rows_file = tmp_path / "rows.json"
    result = bench("-np", "2", "--servers", "1", "--sizes", "1K:64K", "--factor", "64",
                   "--seconds", "0.05", "--warmup", "1", "--json", str(rows_file))
    out = result.stdout
    assert result.returncode == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("# parameter server, 2 workers, 1 server(s), data path: shared "
                               "memory"), out
    table = [line.split() for line in lines if line and not line.startswith("#")]
    assert [int(row[0]) for row in table] == [1024, 65536], out
    header = next(line for line in lines if line.startswith("#") and "size(B)" in line)
    assert len(header[1:].split()) == len(table[0]), out  # one column name per column
    for row in table:
        assert re.fullmatch(r"\d+\.\dx", row[-1]), out  # the speed-up, last
        assert row[5] == "0" and row[10] == "0", out    # #wrong of gradsync and of gRPC
    rows = json.loads(rows_file.read_text())
    assert [(r["size"], r["count"], r["transport"]) for r in rows] == [
        (1024, 256, "shm"), (65536, 16384, "shm")]
    for r in rows:
        assert r["verified"] and r["workers"] == 2 and r["servers"] == 1
        for peer in ("gradsync", "grpc"):
            # Every push of both workers (warm-up, probe, timed) was applied, none lost.
            assert r[peer]["pushes"] == r[peer]["expected_pushes"] == 2 * (
                1 + 2 + r[peer]["iters"])
            assert r[peer]["wrong"] == 0 and r[peer]["time_us"] > 0
        assert r["speedup"] == pytest.approx(r["grpc"]["time_us"] / r["gradsync"]["time_us"])


@pytest.mark.slow  # over 15 s on 2 cores: the slow tier (docs/testing.md)
def test_straggler_reports_every_mode(tmp_path):
    rows_file = tmp_path / "rows.json"
    result = bench("--straggler", "-np", "2", "--servers", "1", "--hidden", "32",
                   "--batch-size", "16", "--target", "0.5", "--eval-every", "1",
                   "--train-seconds", "20", "--json", str(rows_file))
    out = result.stdout
    assert result.returncode == 0, out
    table = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert [row[0] for row in table] == ["sync", "backup", "async", "ssp"], out
    assert [row[1] for row in table] == ["-", "k=1", "-", "s=3"], out
    rows = json.loads(rows_file.read_text())
    for r in rows:
        assert r["reached"] and r["accuracy"] >= 0.5 and r["slow"] == 1, r
        # Counters at worker 0's result: every pushed gradient was applied or dropped.
        assert r["applied"] + r["dropped"] <= sum(r["clocks"]), r
        assert r["clocks"][0] == r["steps"], r
        assert set(r["phases_ms"]) == {"0", "1"}, r
    sync = rows[0]
    assert sync["dropped"] == 0 and sync["max_staleness"] == 0 and sync["vs_sync"] == 1.0
    assert sync["applied"] == 2 * sync["version"]  # a round applies both workers' gradients
    assert rows[2]["version"] == rows[2]["applied"]  # async: one update per gradient
    assert table[0][-1] == "1.0x" and all(re.fullmatch(r"\d+\.\dx", row[-1]) for row in table)


def test_bad_options_fail_before_any_job_starts():
    result = bench("-np", "2", "--transport", "rdma")
    assert result.returncode == 2 and "invalid choice: 'rdma'" in result.stdout
    result = bench("-np", "2", "--servers", "0")
    assert result.returncode == 2 and "--servers must be at least 1" in result.stdout
