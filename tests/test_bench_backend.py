"""``gradsync bench backend``: the torch.distributed backend "gradsync" beside gloo, collective
by collective, results checked against the closed form."""

import json
import subprocess
import sys

import pytest

from harness import bench

pytestmark = pytest.mark.multiprocess  # (the last test starts nothing)


def test_bench_backend_checks_every_collective_beside_gloo_at_3_ranks(tmp_path):
    out = tmp_path / "rows.json"
    # 3 ranks: the sizes are cut to a multiple of 3 elements, so the blocks are 341 and
    # 5461 floats; 64K passes several chunks of 4K bytes.
    proc = bench("backend", "-np", "3", "--sizes", "4K:64K", "--factor", "16", "--seconds",
                 "0.02", "--json", str(out), timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = json.loads(out.read_text())
    assert [(r["collective"], r["size"]) for r in rows] == [
        (c, s) for c in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")
        for s in (1023 * 4, 16383 * 4)]
    for r in rows:
        assert r["ranks"] == 3
        for peer in ("gradsync", "gloo"):
            assert r[peer]["wrong"] == 0 and r[peer]["time_us"] > 0 and r[peer]["iters"] >= 5
        assert r["ratio"] == pytest.approx(r["gloo"]["time_us"] / r["gradsync"]["time_us"])
    table = [line for line in proc.stdout.splitlines() if line.startswith("[0]<stdout>:  ")]
    assert len(table) == 1 + len(rows), proc.stdout[-3000:]  # the column header, then the rows


def test_bench_backend_refuses_an_unknown_collective_before_starting_ranks():
    proc = subprocess.run([sys.executable, "-m", "gradsync", "bench", "backend",
                           "--collectives", "all_reduce,broadcast"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown collective(s) broadcast; choose from all_reduce" in proc.stderr
