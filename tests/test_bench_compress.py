"""``gradsync bench compress``: the corpus split, the floor and the ratios, the tables and the
command line (no processes, but for one hash check), and a short run on two emulated hosts
(slow tier, root only)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from gradsync.bench import cli, compress
from gradsync.bench import compress_report as cr
from gradsync.bench import compress_tasks as ct
from gradsync.bench.compress_rank import tx_bytes


# ---------------------------------------------------------------- the corpus
def _tree(root, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_split_puts_every_file_in_exactly_one_part_the_same_every_time():
    names = [f"pkg{i % 7}/mod{i}.py" for i in range(500)]
    train, val = ct.split_files(reversed(names), 10)
    assert set(train) | set(val) == set(names) and not set(train) & set(val)
    assert (train, val) == ct.split_files(names + names[:3], 10)  # order and repeats: no matter
    assert 30 <= len(val) <= 70  # about 10%
    # A file is validation at 10% iff at any larger share: growing the share only moves files
    # out of training, so a validation file of a short run is never trained on in a longer one.
    assert set(val) <= set(ct.split_files(names, 20)[1])


def test_the_split_does_not_depend_on_the_process(tmp_path):
    # str's hash() is salted per process: a split built on it would differ between ranks,
    # machines and runs. Two interpreters with different salts must agree.
    script = ("import json, sys; from gradsync.bench.compress_tasks import split_files; "
              "print(json.dumps(split_files([f'm{i}.py' for i in range(200)], 25)))")
    outs = set()
    for salt in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": salt}
        outs.add(subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                capture_output=True, text=True).stdout)
    assert len(outs) == 1
    train, val = json.loads(outs.pop())
    assert (train, val) == ct.split_files([f"m{i}.py" for i in range(200)], 25)


def test_the_lm_corpus_keeps_validation_files_out_of_training(tmp_path):
    root, out = tmp_path / "Lib", tmp_path / "out"
    out.mkdir()
    files = {f"pkg/m{i}.py": f"MARK{i:03d}\n" for i in range(60)}
    files["site-packages/torch/x.py"] = "INSTALLED\n"
    files["pkg/__pycache__/m0.py"] = "CACHE\n"
    files["pkg/notes.txt"] = "NOTPY\n"
    _tree(root, files)
    meta = ct.prepare("lm", str(out), val_percent=20, root=str(root))
    train_text = (out / "lm.train.bin").read_text()
    val_text = (out / "lm.val.bin").read_text()
    train, val = ct.split_files([f"pkg/m{i}.py" for i in range(60)], 20)
    assert meta["train_files"] == len(train) and meta["val_files"] == len(val) and val
    for name in train:
        assert files[name] in train_text and files[name] not in val_text
    for name in val:
        assert files[name] in val_text and files[name] not in train_text
    for other in ("INSTALLED", "CACHE", "NOTPY"):
        assert other not in train_text + val_text
    assert meta["train_bytes"] == len(train_text.encode())


def test_the_stdlib_corpus_is_this_pythons_lib_without_installed_packages():
    names = ct.stdlib_files()
    assert "os.py" in names and "json/__init__.py" in names
    assert not [n for n in names if "site-packages" in n or "__pycache__" in n]


# ---------------------------------------------------------------- floor and ratios
def _row(mode, rate="100mbit", **kw):
    row = {"mode": mode, "rate": rate, "steps": 120, "seconds": 150.0, "reached": True,
           "steps_to_target": 120, "time_to_target": 150.0, "bytes_per_step": 1e6,
           "final": {"loss": 2.3, "accuracy": 0.5}, "stop": "reached", "choice": "x"}
    return {**row, **kw}


def _floor(step_s=0.5, steps=24, rate="100mbit"):
    return _row("floor", rate=rate, steps=steps, seconds=step_s * steps, reached=False,
                steps_to_target=None, time_to_target=None, final={}, stop="max steps",
                bytes_per_step=10.0)


def test_the_floor_is_compute_time_per_step_times_fp32s_steps_to_target():
    assert cr.floor_seconds(0.5, 120) == 60.0
    assert cr.floor_seconds(None, 120) is None and cr.floor_seconds(0.5, None) is None
    with pytest.raises(ValueError):
        cr.floor_seconds(0.0, 120)
    out = cr.rate_report([_floor(), _row("gloo-fp32"),
                          _row("gs-int8", steps_to_target=128, time_to_target=66.0)])
    assert out["floor_step_s"] == 0.5 and out["floor_s"] == 60.0
    assert out["floor_reference"] == "gloo-fp32"
    ratios = {r["mode"]: r["x_floor"] for r in out["rows"]}
    assert ratios == {"floor": 1.0, "gloo-fp32": 2.5, "gs-int8": 1.1}
    floor = out["rows"][0]
    assert floor["time_to_target"] == 60.0 and floor["steps_to_target"] == 120


def test_a_mode_short_of_the_target_or_failed_gets_no_ratio():
    out = cr.rate_report([_floor(), _row("gloo-fp32"),
                          _row("gloo-bf16", reached=False, steps_to_target=None,
                               time_to_target=None, stop="max steps"),
                          {"mode": "gs-powersgd", "rate": "100mbit", "failed": "rank 1 exit 1"}])
    ratios = {r["mode"]: r["x_floor"] for r in out["rows"]}
    assert ratios == {"floor": 1.0, "gloo-fp32": 2.5, "gloo-bf16": None, "gs-powersgd": None}


def test_the_floor_falls_back_to_gradsyncs_fp32_and_otherwise_is_absent():
    short = {"reached": False, "steps_to_target": None, "time_to_target": None}
    out = cr.rate_report([_floor(), _row("gloo-fp32", **short),
                          _row("gs-fp32", steps_to_target=80, time_to_target=90.0)])
    assert out["floor_reference"] == "gs-fp32" and out["floor_s"] == 40.0
    assert [r["x_floor"] for r in out["rows"]] == [1.0, None, 2.25]
    none = cr.rate_report([_floor(), _row("gloo-fp32", **short), _row("gs-int8")])
    assert none["floor_s"] is None and [r["x_floor"] for r in none["rows"]] == [None] * 3
    no_floor = cr.rate_report([_row("gloo-fp32"), _row("gs-int8")])
    assert no_floor["floor_s"] is None and no_floor["rows"][1]["x_floor"] is None


def test_a_rate_whose_fp32_runs_fell_short_takes_their_steps_from_another_rate():
    short = {"reached": False, "steps_to_target": None, "time_to_target": None,
             "stop": "time budget"}
    rows = [_floor(step_s=0.6, rate="25mbit"), _row("gloo-fp32", rate="25mbit", **short),
            _row("gs-fp32", rate="25mbit", **short),
            _row("gs-int8", rate="25mbit", time_to_target=96.0),
            _floor(rate="100mbit"), _row("gloo-fp32", rate="100mbit", steps_to_target=96,
                                         time_to_target=75.0)]
    data = cr.report(rows, _settings())
    slow, fast = data["rates"]
    assert slow["floor_reference"] == "gloo-fp32@100mbit" and fast["floor_reference"] == \
        "gloo-fp32"
    assert slow["floor_s"] == pytest.approx(0.6 * 96) and fast["floor_s"] == 0.5 * 96
    assert [r["x_floor"] for r in slow["rows"]] == [1.0, None, None,
                                                    pytest.approx(96.0 / (0.6 * 96))]
    assert "25mbit: floor 57.6 s = 0.600 s/step x gloo-fp32@100mbit's steps to target" in \
        cr.format_text(data)
    # No fp32 run reached the target anywhere: no floor at either rate.
    none = cr.report([r for r in rows if r["rate"] == "25mbit"], _settings())
    assert none["rates"][0]["floor_s"] is None


def _settings(task="lm"):
    return {"task": task, "hosts": 4, "ranks_per_host": 1, "seed": 0, "params": 1000,
            "target_loss": 2.4, "target_accuracy": 0.95}


def test_the_report_keeps_the_rates_in_order_and_prints_every_row():
    rows = [_floor(rate="25mbit"), _row("gloo-fp32", rate="25mbit"),
            _floor(rate="unshaped"), _row("gloo-fp32", rate="unshaped", time_to_target=75.0),
            {"mode": "gs-int8", "rate": "unshaped", "failed": "rank 1 exited 1: boom"},
            _row("gs-auto", rate="unshaped", choice="int8 x2 (5.6 MB)",
                 decision="tier host: int8 for 2 buckets | calibrated: 98 Mbit/s")]
    data = cr.report(rows, _settings())
    assert [r["rate"] for r in data["rates"]] == ["25mbit", "unshaped"]
    assert data["rates"][1]["rows"][1]["x_floor"] == 1.25
    text, md = cr.format_text(data), cr.format_markdown(data)
    for out in (text, md):
        assert "not built" not in out and "validation loss <= 2.4" in out
        assert "rank 1 exited 1: boom" in out
        assert out.count("gloo-fp32") >= 2
        # auto's choice in its row, and the numbers behind it under the table.
        assert "int8 x2 (5.6 MB)" in out
        assert "unshaped: gs-auto chose tier host: int8 for 2 buckets | calibrated" in out
    assert "| unshaped | gloo-fp32 | yes | 120 | 75.0 | 1.25 |" in md
    # The floor's line: the fp32 run's steps to the target, not the 24 it timed.
    assert "| unshaped | floor | - | 120 | 60.0 | 1.00 | 0.500 |" in md
    assert md.count("\n| ") == 2 + 6  # the header, its rule, one line per row


# ---------------------------------------------------------------- command line
def test_modes_keep_the_benchs_order_and_auto_is_a_mode():
    assert compress.parse_modes("gs-diloco,gloo-powersgd,floor,gs-fp32") == \
        ["floor", "gloo-powersgd", "gs-fp32", "gs-diloco"]
    assert compress.parse_modes("gs-diloco,auto,gs-int8") == ["gs-int8", "gs-auto", "gs-diloco"]
    with pytest.raises(Exception, match="unknown mode"):
        compress.parse_modes("int4")
    assert compress.parse_rates("25mbit, unshaped") == ["25mbit", "unshaped"]
    with pytest.raises(Exception):
        compress.parse_rates("fast")


def test_settings_fill_each_tasks_defaults_and_refuse_the_other_tasks_target():
    p = compress.parser()
    s = compress.settings_of(p.parse_args([]), 4, "/d")
    assert (s["task"], s["target_loss"], s["target_accuracy"]) == ("lm", 2.4, None)
    s = compress.settings_of(p.parse_args(["--task", "cnn"]), 4, "/d")
    assert (s["target_loss"], s["target_accuracy"], s["batch"]) == (None, 0.95, 32)
    with pytest.raises(ValueError, match="target-accuracy"):
        compress.settings_of(p.parse_args(["--task", "cnn", "--target-loss", "1"]), 4, "/d")
    with pytest.raises(ValueError, match="target-loss"):
        compress.settings_of(p.parse_args(["--target-accuracy", "0.5"]), 4, "/d")


def test_the_command_line_names_its_hosts_and_takes_no_np(capsys, monkeypatch):
    def drive(hosts, options):  # a command line let through must not start a benchmark
        raise AssertionError(f"the bench would run on {hosts} hosts")

    monkeypatch.setattr(compress, "drive", drive)
    assert cli.main(["compress", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gradsync bench compress")
    for option in ("--rates", "--modes", "--target-loss", "--max-steps", "--minutes",
                   "--markdown", "--json [FILE]", "--ranks-per-host"):
        assert option in out, option
    with pytest.raises(SystemExit):
        cli.main(["compress", "-np", "4"])
    with pytest.raises(SystemExit):
        cli.main(["compress", "--hosts", "1"])


def test_bytes_are_read_from_the_namespaces_interface_table(tmp_path):
    table = tmp_path / "dev"
    table.write_text(
        "Inter-|   Receive                                                |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets\n"
        "    lo:     100       1    0    0    0     0          0         0      100       1"
        "    0    0    0     0       0          0\n"
        "  eth0: 5000000    4000    0    0    0     0          0         0  7340032    6000"
        "    0    0    0     0       0          0\n")
    assert tx_bytes("eth0", str(table)) == 7340032
    with pytest.raises(RuntimeError, match="eth1"):
        tx_bytes("eth1", str(table))


# ---------------------------------------------------------------- a short run (slow, root)
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_short_run_on_two_emulated_hosts_reports_every_mode_honestly(tmp_path, capsys):
    from netns import require_netns

    require_netns()
    out = tmp_path / "report.json"
    target = 4.2
    options = compress.parser().parse_args([
        "--rates", "unshaped", "--modes",
        "floor,gloo-fp32,gs-int8,gs-auto,gs-auto-local,gs-int8-lag", "--local-sgd", "4",
        "--lm-dim", "32",
        "--lm-layers", "1", "--lm-heads", "2", "--lm-context", "32", "--val-items", "32",
        "--max-steps", "24", "--eval-every", "4", "--floor-steps", "8", "--minutes", "2",
        "--target-loss", str(target), "--markdown", "--json", str(out)])
    assert compress.drive(2, options) == 0, capsys.readouterr().out
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [r["rate"] for r in data["rates"]] == ["unshaped"]
    rate = data["rates"][0]
    rows = {r["mode"]: r for r in rate["rows"]}
    assert list(rows) == ["floor", "gloo-fp32", "gs-int8", "gs-auto", "gs-auto-local",
                          "gs-int8-lag"]
    params = rows["gloo-fp32"]["params"]
    assert rows["gs-int8-lag"]["choice"] == "int8(block=1024), gradient lag 1"
    for mode in ("gloo-fp32", "gs-int8", "gs-auto", "gs-auto-local", "gs-int8-lag"):
        row = rows[mode]
        assert not row.get("failed") and row["final"] == row["evals"][-1]
        # Honest: reached iff an evaluation met the target, at the first one that did.
        hits = [e for e in row["evals"] if e["loss"] <= target]
        assert row["reached"] == bool(hits) == (row["stop"] == "reached"), row
        if hits:
            assert row["steps_to_target"] == hits[0]["step"] == row["steps"]
            assert math.isclose(row["time_to_target"], hits[0]["seconds"], rel_tol=1e-3)
        else:
            assert row["stop"] in ("max steps", "time budget", "diverged") and \
                row["time_to_target"] is None
        assert [e["step"] for e in row["evals"]] == list(range(4, row["steps"] + 1, 4))
        assert f"| unshaped | {mode} |" in printed
    # Bytes counted on the wire: with 2 hosts, a float32 ring sends the whole gradient per
    # host per step; int8 sends about a quarter; the floor sends next to nothing.
    assert rows["gloo-fp32"]["bytes_per_step"] >= 0.95 * 4 * params
    assert rows["gs-int8"]["bytes_per_step"] <= 0.5 * rows["gloo-fp32"]["bytes_per_step"]
    assert rows["floor"]["bytes_per_step"] < 0.01 * 4 * params
    assert rows["floor"]["steps"] == 8
    # The target is one the fp32 run reaches in a few steps (which steps is arithmetic, not
    # timing: the same weights and batches on any machine), so the floor is always there.
    assert rows["gloo-fp32"]["reached"], rows["gloo-fp32"]["evals"]
    step_s = rows["floor"]["seconds"] / 8
    assert math.isclose(rate["floor_s"], step_s * rows["gloo-fp32"]["steps_to_target"])
    assert math.isclose(rows["gloo-fp32"]["x_floor"],
                        rows["gloo-fp32"]["time_to_target"] / rate["floor_s"])
    # auto decides at its step 5, after the probe step (2) and two float32 steps, or at its
    # step 3 where the probe read a slow link (a loaded machine's loopback may read so);
    # DDP's first two steps may count as one (its buckets are rebuilt after the first), so
    # by step 8 it has decided, and then says what it chose.
    auto = rows["gs-auto"]
    first = ("step 3 (calibrated)", "step 5 (calibrated)")
    if auto["steps"] >= 8:
        assert auto["decisions"][0].startswith(first), auto
        assert auto["choice"] != "auto (not decided yet)"
        assert "unshaped: gs-auto chose" in printed
    else:
        assert auto["choice"] == "auto (not decided yet)" and "decisions" not in auto
    # With local SGD allowed (its parameters attached, after_step after each step) auto
    # decides at the same step, H with its choices (the rule for H has its own tests in
    # test_compress_auto.py; evaluated mid-window, the ranks' average is what is read).
    local = rows["gs-auto-local"]
    if local["steps"] >= 8:
        assert local["decisions"][0].startswith(first), local
        assert "unshaped: gs-auto-local chose" in printed


def test_bucket_cap_and_overlap_reach_ddp_and_the_hook_but_not_torchs_powersgd(tmp_path):
    # One rank in this process (gloo's default group; the gradsync modes make their own).
    import torch
    import torch.distributed as dist

    from gradsync.bench import compress_rank

    p = compress.parser()
    s = compress.settings_of(p.parse_args([]), 4, "/d")
    assert (s["bucket_cap_mb"], s["overlap"]) == (None, True)
    s = compress.settings_of(p.parse_args(["--bucket-cap-mb", "1", "--no-overlap"]), 4, "/d")
    assert (s["bucket_cap_mb"], s["overlap"]) == (1.0, False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        caps = {}
        for mode in ("gloo-fp32", "gloo-powersgd", "gs-int8"):
            trainer = compress_rank._Trainer(mode, torch.nn.Linear(4, 2), None, s)
            caps[mode] = trainer.net.bucket_bytes_cap
            if mode == "gs-int8":
                (_, state), = trainer.net._comm_hooks
                assert state.overlap is False
        assert caps == {"gloo-fp32": 1 << 20, "gloo-powersgd": (1 << 12) << 20,
                        "gs-int8": 1 << 20}
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_streaming_is_evaluated_where_each_sync_has_landed(tmp_path, capsys):
    """gs-diloco syncs at once, evaluated at whole windows (4, 8, ...); gs-streaming's syncs
    land a step after they start, so its first segment is a step longer and each ends
    where one has landed (5, 9, ...). Both report their settings as their choice."""
    from netns import require_netns

    require_netns()
    out = tmp_path / "report.json"
    options = compress.parser().parse_args([
        "--rates", "unshaped", "--modes", "gs-diloco,gs-streaming", "--diloco-h", "4",
        "--diloco-sync", "int4", "--streaming-delay", "1", "--outer-lr", "1",
        "--outer-momentum", "0", "--lm-dim", "32", "--lm-layers", "1", "--lm-heads", "2",
        "--lm-context", "32", "--val-items", "32", "--max-steps", "12", "--eval-every", "4",
        "--minutes", "2", "--target-loss", "0.1", "--json", str(out)])
    assert compress.drive(2, options) == 0, capsys.readouterr().out
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rates"][0]["rows"]}
    assert [e["step"] for e in rows["gs-diloco"]["evals"]] == [4, 8, 12]
    assert [e["step"] for e in rows["gs-streaming"]["evals"]] == [5, 9, 13]
    assert rows["gs-diloco"]["choice"] == "H=4, outer lr 1.0 momentum 0.0, int4"
    assert rows["gs-streaming"]["choice"] == \
        "H=4, outer lr 1.0 momentum 0.0, int4, each landing 1 steps later"
    for row in rows.values():
        assert not row.get("failed") and not row["reached"] and row["stop"] == "max steps"


def test_streaming_options_are_checked_before_anything_runs(capsys):
    p = compress.parser()
    for bad in (["--streaming-delay", "4"], ["--streaming-fragments", "2",
                                             "--streaming-delay", "2"]):
        options = p.parse_args(["--modes", "gs-streaming", "--diloco-h", "4", *bad])
        assert compress.drive(2, options) == 2
        assert "gs-streaming needs" in capsys.readouterr().err
    assert compress.drive(2, p.parse_args(["--local-overlap", "-1"])) == 2
    assert "--local-overlap must be 0 or more" in capsys.readouterr().err
    s = compress.settings_of(p.parse_args(["--local-overlap", "2", "--streaming-overwrite",
                                           "--diloco-fp32"]), 4, "/d")
    assert (s["local_overlap"], s["streaming_carry"], s["diloco_sync"]) == (2, False, "fp32")
