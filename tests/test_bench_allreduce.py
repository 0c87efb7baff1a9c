"""``gradsync bench allreduce`` end to end: the table, the JSON rows, the gloo peer."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess


def test_bench_allreduce_checks_results_and_measures_gloo_beside(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync", "bench", "allreduce", "-np", "2", "--sizes", "4K:64K",
         "--factor", "16", "--seconds", "0.05", "--algorithm", "ring,auto", "--compare", "gloo",
         "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["size"], r["requested"]) for r in rows] == [
        (4096, "ring"), (4096, "auto"), (65536, "ring"), (65536, "auto")]
    for r in rows:
        assert r["gradsync"]["wrong"] == 0 and r["gloo"]["wrong"] == 0
        assert r["gradsync"]["time_us"] > 0 and r["ratio"] > 0
        assert r["algorithm"] == ("ring" if r["requested"] == "ring" else "shm")
    table = [line for line in proc.stdout.splitlines() if line.startswith("[0]<stdout>:  ")]
    assert len(table) == 1 + len(rows)  # the column header, then a line per row
