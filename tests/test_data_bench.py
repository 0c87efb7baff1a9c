"""``gradsync bench data`` end to end with tiny settings: the table's shape, the exactly-once
verification of both feeds, and the JSON row (the figures themselves are docs/benchmarks.md's)."""

import json

import os

import pytest

import harness

from gradsync.bench import data as bench_data

pytestmark = pytest.mark.multiprocess


def test_bench_data_compares_both_feeds_and_the_transport(tmp_path):
    rows_file = tmp_path / "row.json"
    # 2 producer processes on the one data server: the DataLoaders' 2 loading processes in all
    result = harness.bench("data", "-np", "2", "--data-servers", "1", "--data-workers", "2",
                           "--borrow", "--samples", "96",
                           "--batch-size", "8", "--shape", "2,3", "--cost-ms", "0.2",
                           "--repeats", "2", "--json", str(rows_file), timeout=120)
    out = result.stdout
    assert result.returncode == 0, out
    lines = out.splitlines()
    assert any(line.startswith("# data servers against each worker's own DataLoader, in the "
                               "same job: 2 worker(s), 1 data server(s), DataLoader "
                               "num_workers=1 (same cores); 2 producer(s) per data server, "
                               "batches borrowed") for line in lines), out
    feeds = {line.split()[0]: line.split() for line in lines
             if line.strip().startswith(("data servers", "DataLoader"))}
    assert feeds["data"][-1] == "0" and feeds["DataLoader"][-1] == "0", out  # #wrong
    row = json.loads(rows_file.read_text())
    assert (row["workers"], row["data_servers"], row["loader_workers"]) == (2, 1, 1)
    assert (row["data_workers"], row["copy"]) == (2, False)
    assert row["wrong"] == 0 and row["dataloader_wrong"] == 0
    assert row["takes"] == row["sent"] == 0  # polled: no take (the counts of the whole run)
    assert not any(line.startswith("# takes:") for line in lines), out
    for feed in ("servers_samples_s", "dataloader_samples_s"):
        assert 0 < row[feed]["low"] <= row[feed]["median"] <= row[feed]["high"]
    assert row["throughput_ratio"] == pytest.approx(
        row["servers_samples_s"]["median"] / row["dataloader_samples_s"]["median"])
    per_worker = row["per_worker_transfer"]
    # 96 samples in batches of 8, one server: 12 batches dealt to 2 workers.
    assert [t["batches"] for t in per_worker] == [6, 6]
    for t in per_worker:
        assert t["road"] == "shm"  # one host: the slots are mapped
        assert t["ask"] == "poll"  # and the slot table polled, with no take
        assert t["bytes"] == 8 * (6 * 4 + 8)  # the float32 samples and the int64 labels
        assert t["ask_us"]["median"] > 0 and t["copy_us"]["median"] > 0
        assert t["ratio"] == pytest.approx(t["total_us"]["median"] / t["copy_us"]["median"])


def test_bench_data_rejects_a_bad_shape():
    result = harness.bench("data", "--shape", "3,x", timeout=60)
    assert result.returncode != 0 and "--shape '3,x'" in result.stdout, result.stdout


def test_bench_data_pins_the_data_servers_apart_and_spins_the_training_step(tmp_path):
    rows_file = tmp_path / "row.json"
    mine = sorted(os.sched_getaffinity(0))
    assert len(mine) >= 2, f"CI has 2 cores; this process may use {mine}"
    result = harness.bench("data", "-np", "2", "--data-servers", "1", "--samples", "48",
                           "--batch-size", "8", "--shape", "2", "--cost-ms", "0",
                           "--step-ms", "20", "--server-cpus", str(mine[-1]),
                           "--repeats", "1", "--json", str(rows_file), timeout=120)
    out = result.stdout
    assert result.returncode == 0, out
    assert f"data servers pinned to CPUs [{mine[-1]}], the workers and their DataLoaders to " \
           "the others" in out and "training step 20 ms CPU/batch" in out, out
    row = json.loads(rows_file.read_text())
    assert (row["step_ms"], row["server_cpus"]) == (20.0, [mine[-1]])
    assert row["per_worker_cpus"] == [mine[:-1], mine[:-1]]
    assert row["wrong"] == 0 and row["dataloader_wrong"] == 0
    # 48 samples an epoch, 3 batches of 8 per worker, each spinning 20 ms of the worker's
    # CPU: an epoch takes at least 60 ms, so neither feed passes 800 samples/s (without the
    # step, an epoch of these tiny batches takes a few milliseconds).
    for feed in ("servers_samples_s", "dataloader_samples_s"):
        assert row[feed]["high"] <= 48 / (3 * 20e-3)


def test_pin_puts_data_servers_on_their_cpus_and_workers_on_the_others(monkeypatch):
    from gradsync.cluster import launch_env

    pinned = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append(set(cpus)))
    for data_server, expected in ((True, {2, 3}), (False, {0, 1})):
        monkeypatch.setattr(launch_env, "detect", lambda data_server=False, on=data_server:
                            type("Env", (), {"is_data_server": on})())
        bench_data._pin({2, 3})
        assert pinned.pop() == expected
    bench_data._pin(None)
    assert pinned == []


def test_server_cpus_must_name_some_not_all_of_the_cpus(monkeypatch):
    import argparse

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert bench_data._cpus("1") == {1}
    assert bench_data._cpus("0,2-3") == {0, 2, 3}
    for bad in ("0-3", "4", "x", "1-", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--server-cpus"):
            bench_data._cpus(bad)
