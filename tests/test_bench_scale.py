"""``gradsync bench scale``: the aggregation over ranks, the phase clock, the command line, the
summary the plots read, and the benchmark itself at 2 and 4 ranks over emulated host names."""

import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

import harness
from gradsync.bench import cli, scale, scale_rank
from gradsync.testbed import netns

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- aggregation (no processes)
def _report(rank, boot, imported, called, done, phases, requests=None, sockets=(0, 5, 7),
            rss=(200.0, 210.0, 212.0), first=(10.0, 30.0), steady=(1.0, 3.0)):
    return {"rank": rank, "host": f"h{rank}", "sockets_before": sockets[0],
            "rss_before_mib": rss[0], "anon_before_mib": rss[0] / 2,
            "anon_init_mib": rss[1] / 2, "anon_end_mib": rss[2] / 2, "phases_instrumented": ["store", "tcp connect", "barrier"],
            "requests_before": None if requests is None else {"get": 1},
            "marks": {"boot": boot, "imported": imported, "init_called": called,
                      "init_done": done},
            "phases": phases, "sockets_init": sockets[1], "rss_init_mib": rss[1],
            "requests_init": requests, "requests_end": None if requests is None else
            {op: n + 2 for op, n in requests.items()},
            "sockets_end": sockets[2], "rss_end_mib": rss[2],
            "allreduce": {"small": {"bytes": 16, "first_ms": first[0], "steady_ms": steady[0]},
                          "1MiB": {"bytes": 1 << 20, "first_ms": first[1],
                                   "steady_ms": steady[1]}}}


def _limit_report(rank, boot, imported, met, rss=190.0):
    return {"rank": rank, "host": f"h{rank}", "sockets_before": 0, "rss_before_mib": rss,
            "anon_before_mib": rss / 2,
            "sockets_met": 1, "marks": {"boot": boot, "imported": imported, "met": met}}


def _jobs(requests=({"get": 5, "set": 2}, {"get": 7, "set": 2}, {"get": 9, "set": 2})):
    runtime = (100.0, [
        _report(0, 101.0, 104.0, 104.0, 106.0, {"store": 0.5, "tcp connect": 1.0},
                requests[0], sockets=(0, 5, 7), rss=(200, 210, 212), first=(10, 30),
                steady=(1, 3)),
        _report(1, 102.0, 105.0, 105.0, 108.0, {"store": 0.25, "barrier": 2.0},
                requests[1], sockets=(0, 6, 9), rss=(202, 214, 220), first=(12, 20),
                steady=(2, 5)),
        _report(2, 101.5, 106.0, 106.0, 107.0, {"store": 0.75, "tcp connect": 0.1},
                requests[2], sockets=(1, 4, 8), rss=(204, 206, 207), first=(11, 40),
                steady=(4, 4))])
    limit = (200.0, [_limit_report(0, 201.0, 204.0, 205.0),
                     _limit_report(1, 201.0, 203.0, 208.0),
                     _limit_report(2, 202.0, 206.0, 206.5)])
    return runtime, limit


def test_aggregation_over_ranks():
    data = scale.aggregate(*_jobs())
    assert data["ranks"] == 3
    # The job's times run from its launch to its last rank: init() returned, met at the store.
    assert data["init_s"] == pytest.approx(8.0) and data["limit_s"] == pytest.approx(8.0)
    assert data["ratio"] == pytest.approx(1.0)
    p = data["phases"]
    assert p["start"]["gradsync"] == {"median": pytest.approx(1.5), "max": pytest.approx(2.0)}
    assert p["start"]["limit"] == {"median": pytest.approx(1.0), "max": pytest.approx(2.0)}
    assert p["import"]["limit"]["max"] == pytest.approx(4.0)
    assert p["meet"]["limit"] == {"median": pytest.approx(1.0), "max": pytest.approx(5.0)}
    assert p["meet"]["gradsync"] is None and p["init"]["limit"] is None
    assert p["init"]["gradsync"] == {"median": pytest.approx(2.0), "max": pytest.approx(3.0)}
    assert p["store"]["gradsync"] == {"median": pytest.approx(0.5), "max": pytest.approx(0.75)}
    # A rank that never entered a phase spent no time in it.
    assert p["barrier"]["gradsync"] == {"median": pytest.approx(0.0), "max": pytest.approx(2.0)}
    assert "heartbeat" not in p  # not instrumented: the table says n/a
    # other = init - the instrumented phases: 0.5, 0.75, 0.15
    assert p["other"]["gradsync"]["median"] == pytest.approx(0.5)
    assert p["other"]["gradsync"]["max"] == pytest.approx(0.75)
    assert list(p) == [name for name in scale.PHASES if name in p]
    assert data["sockets"]["init"] == {"median": 5, "max": 6}
    assert data["sockets"]["end"] == {"median": 8, "max": 9}
    assert data["sockets"]["before"]["max"] == 1 and data["sockets"]["limit"]["max"] == 1
    # Store requests: the job's, summed over ranks, less what each rank made before init().
    assert data["store_requests"]["init"] == {"total": 24, "by_op": {"get": 18, "set": 6}}
    assert data["store_requests"]["end"] == {"total": 36, "by_op": {"get": 24, "set": 12}}
    m = data["rss_mib"]
    assert (m["before"], m["init"], m["end"], m["limit"]) == (202, 210, 212, 190)
    assert m["growth_init"] == pytest.approx(10) and m["growth_end"] == pytest.approx(12)
    assert m["anon_end"] == 106 and m["anon_growth_end"] == pytest.approx(6)
    a = data["allreduce"]
    assert a["small"] == {"bytes": 16, "first_ms": 12, "steady_ms": 2}
    assert a["1MiB"] == {"bytes": 1 << 20, "first_ms": 40, "steady_ms": 4}


def test_store_requests_are_not_available_when_a_rank_cannot_count():
    data = scale.aggregate(*_jobs(requests=(None, None, None)))
    assert data["store_requests"] == {"init": None, "end": None}
    data.update(hosts=3, emulation="names", cores=2, iters=1)
    assert scale.summary_rows([data])[0]["store requests"] == "n/a"


def test_jobs_of_different_sizes_are_refused():
    runtime, limit = _jobs()
    with pytest.raises(ValueError, match="same ranks"):
        scale.aggregate(runtime, (limit[0], limit[1][:2]))


def test_summary_is_the_markdown_table_the_plots_read():
    data = scale.aggregate(*_jobs())
    data.update(hosts=3, emulation="names", cores=2, iters=1)
    text = scale.markdown([data, {**data, "ranks": 6}])
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import plot_benchmarks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    rows = plot_benchmarks.read_table("<!-- plot:scale -->\n" + text + "\n", "scale")
    assert [r["N"] for r in rows] == ["3", "6"]
    assert list(rows[0]) == list(scale.SUMMARY_COLUMNS)
    assert rows[0]["init ÷ limit"] == "1.00" and rows[0]["store requests"] == "24"
    assert rows[0]["machine"] == "2 cores" and rows[0]["sockets per rank"] == "9"


# ---------------------------------------------------------------- the phase clock
def test_phase_clock_counts_the_outermost_call_of_its_thread_while_active():
    clock = scale_rank.PhaseClock()

    def inner():
        time.sleep(0.02)

    inner = clock.wrap("inner", inner)

    def outer():
        time.sleep(0.02)
        inner()

    outer = clock.wrap("outer", outer)
    outer()  # not active: not counted
    assert clock.totals == {}
    clock.active = True
    outer()
    worker = threading.Thread(target=inner)  # another thread's calls are not counted
    worker.start()
    worker.join()
    clock.active = False
    assert set(clock.totals) == {"outer"}  # the nested call is the outer phase's time
    assert 0.035 < clock.totals["outer"] < 1.0


def test_instrument_wraps_what_exists_and_skips_the_rest(monkeypatch):
    module = types.ModuleType("fake_runtime")

    class Store:
        def get(self):
            time.sleep(0.01)

        def barrier(self):
            self.get()

    module.Store = Store
    module.connect = lambda: time.sleep(0.01)
    monkeypatch.setitem(sys.modules, "fake_runtime", module)
    clock = scale_rank.PhaseClock()
    phases = scale_rank.instrument(clock, (
        ("requests", "fake_runtime", "Store.*"), ("barrier", "fake_runtime", "Store.barrier"),
        ("tcp", "fake_runtime", "connect"), ("gone", "fake_runtime", "Listener.__init__"),
        ("gone too", "no_such_module_here", "connect")))
    assert phases == ["requests", "barrier", "tcp"]
    clock.active = True
    Store().barrier()
    Store().get()
    module.connect()
    assert set(clock.totals) == {"requests", "barrier", "tcp"}


def test_every_spec_names_a_phase_of_the_table():
    assert {phase for phase, _, _ in scale_rank.SPECS} <= set(scale.PHASES)


def test_sockets_are_counted():
    import socket
    before = scale_rank.sockets()
    with socket.socket() as one, socket.socket():
        assert scale_rank.sockets() == before + 2
        one.close()
        assert scale_rank.sockets() == before + 1
    assert scale_rank.rss_mib() > 1


# ---------------------------------------------------------------- the command line
def test_np_takes_a_list_for_scale_only(capsys):
    assert cli.parse_counts("16,64,128") == [16, 64, 128]
    for bad in ("0", "16,x", ""):
        with pytest.raises(ValueError):
            cli.parse_counts(bad)
    with pytest.raises(SystemExit):
        cli.main(["allreduce", "-np", "2,4"])
    assert "for the scale benchmark only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["scale", "-np", "2", "-H", "a:2"])
    assert "number of emulated hosts" in capsys.readouterr().err


def test_scale_gets_its_counts_hosts_and_options(monkeypatch):
    seen = []
    monkeypatch.setattr(scale, "drive", lambda counts, hosts, options: seen.append(
        (counts, hosts, options.emulate, options.iters)) or 0)
    assert cli.main(["scale", "-np", "16,64", "--hosts", "4", "--emulate", "names",
                     "--iters", "3"]) == 0
    assert seen == [([16, 64], 4, "names", 3)]


def test_a_failed_rank_is_reported_with_its_output(monkeypatch):
    def run(cluster, argv, **kwargs):
        ok = netns.RankResult(0, "h0", 0, scale_rank.PREFIX + "{}\n")
        bad = netns.RankResult(1, "h1", 3, "Traceback ...\nboom\n", ended=1.0)
        return [ok, bad]

    monkeypatch.setattr(netns, "run", run)
    cluster = scale.HostNames([("h0", 1), ("h1", 1)])
    options = types.SimpleNamespace(iters=1)
    with pytest.raises(RuntimeError, match=r"rank 1 exited with status 3(.|\n)*boom"):
        scale._job(cluster, "gradsync", 2, 1234, options)


def test_help_is_the_benchmarks_own(capsys):
    assert cli.main(["scale", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gradsync bench scale")
    assert "--emulate" in out and "--json [FILE]" in out and "-np NP" in out


def test_ranks_that_would_not_fit_in_memory_are_refused(monkeypatch):
    store = types.SimpleNamespace(proc=types.SimpleNamespace(pid=1234))
    sizes = {(1234, "RssAnon"): 150.0, (0, "MemAvailable"): 10_000.0}
    monkeypatch.setattr(scale, "_status_mib", lambda pid, field: sizes[pid, field])
    scale._check_memory(60, store)  # 9,000 MiB of 10,000: fits
    with pytest.raises(RuntimeError, match=r"64 ranks would hold about 9.4 GiB"):
        scale._check_memory(64, store)


def test_repeats_run_in_turn_and_report_the_pair_of_median_ratio(monkeypatch, capsys):
    runtime, limit = _jobs()
    # The last rank's init() returns 12, 10 and 9 s after the launch: against the limit's
    # 8 s, ratios 1.5, 1.25 and 1.125.
    ends = iter([112.0, 110.0, 109.0])
    order = []

    def job(cluster, mode, ranks, port, options):
        order.append(mode)
        if mode == "limit":
            return limit
        reports = [dict(r, marks=dict(r["marks"])) for r in runtime[1]]
        reports[0]["marks"]["init_done"] = next(ends)
        return runtime[0], reports

    monkeypatch.setattr(scale, "_job", job)
    monkeypatch.setattr(scale, "_start_store", lambda cluster, timeout: (None, 1))
    monkeypatch.setattr(scale, "_check_memory", lambda ranks, store: None)
    monkeypatch.setattr(scale, "stop", lambda processes: None)
    options = types.SimpleNamespace(iters=1, repeats=3)
    data = scale.measure(3, 3, "names", options)
    assert order == ["limit", "gradsync"] * 3
    assert [r["ratio"] for r in data["repeats"]] == pytest.approx([1.5, 1.25, 1.125])
    assert data["ratio"] == pytest.approx(1.25) and data["init_s"] == pytest.approx(10.0)


def test_deadline_grows_with_the_ranks():
    assert scale.deadline(256) > scale.deadline(16) >= 120


# ---------------------------------------------------------------- the benchmark, real ranks
_TABLE_LINES = ("# phase", "job: init", "sockets per rank:", "store requests, whole job, init",
                "RSS per rank", "allreduce 16 B: first", "allreduce 1048576 B: first")


def _check_point(point, ranks, hosts):
    assert point["ranks"] == ranks and point["hosts"] == hosts
    assert point["emulation"] == "names"
    assert point["init_s"] > 0 and point["limit_s"] > 0
    assert point["ratio"] == pytest.approx(point["init_s"] / point["limit_s"])
    for phase in ("start", "import", "init", "store", "store requests", "tcp connect",
                  "other"):
        assert point["phases"][phase]["gradsync"]["max"] >= 0, phase
    assert point["phases"]["meet"]["limit"]["max"] > 0
    # Each rank holds at least its store connection and a socket per TCP peer after init.
    assert point["sockets"]["init"]["max"] >= 1 + (hosts - 1 if ranks == hosts else 1)
    assert point["rss_mib"]["before"] > 50 and point["rss_mib"]["end"] >= 50
    for size in ("small", "1MiB"):
        assert point["allreduce"][size]["first_ms"] > 0
        assert point["allreduce"][size]["steady_ms"] > 0
    assert set(point["store_requests"]) == {"init", "end"}


@pytest.mark.slow  # three processes import torch one after another: over 20 s on 2 cores
@pytest.mark.multiprocess
def test_two_ranks_over_two_host_names(tmp_path):
    rows = tmp_path / "scale.json"
    result = harness.bench("scale", "-np", "2", "--emulate", "names", "--iters", "2",
                           "--json", str(rows), timeout=240)
    out = result.stdout
    assert result.returncode == 0, out
    for line in _TABLE_LINES:
        assert line in out, line
    for phase in scale.PHASES:
        assert any(row.split()[:1] == [phase.split()[0]] for row in out.splitlines()), phase
    header = next(line for line in out.splitlines() if line.startswith("machine"))
    assert header.split("  ") == [c for c in header.split("  ") if c]  # no empty columns
    for column in scale.SUMMARY_COLUMNS:
        assert column in header, column
    points = json.loads(rows.read_text())
    assert len(points) == 1
    _check_point(points[0], 2, 2)


@pytest.mark.slow  # two points, four jobs: over 20 s on 2 cores
@pytest.mark.multiprocess
def test_a_sweep_over_two_and_four_ranks_on_two_hosts():
    result = harness.bench("scale", "-np", "2,4", "--hosts", "2", "--emulate", "names",
                           "--iters", "2", "--markdown", "--json", timeout=400)
    out = result.stdout
    assert result.returncode == 0, out
    points = json.loads(out[out.index("\n[\n") + 1:])
    assert [p["ranks"] for p in points] == [2, 4]
    for point in points:
        _check_point(point, point["ranks"], 2)
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 4 and table[0].startswith("| machine | N | hosts")
    # 4 ranks on 2 hosts: a rank's host partner is over shared memory, so it holds fewer
    # sockets than in a full TCP mesh of 4.
    assert points[1]["phases"]["shm"]["gradsync"]["max"] > 0


def test_the_rank_module_is_importable_without_torch():
    # The bootstrap times the imports from its first line: scale_rank itself must not
    # import torch (or anything heavy) at module level.
    code = ("import sys, gradsync.bench.scale_rank; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "False"


def test_request_counts_are_read_where_gradsync_has_them(monkeypatch):
    import gradsync.cluster.rendezvous
    monkeypatch.delattr(gradsync.cluster.rendezvous, "request_counts", raising=False)
    assert scale_rank.request_counts() is None
    monkeypatch.setattr(gradsync.cluster.rendezvous, "request_counts", lambda: {"get": 3},
                        raising=False)
    assert scale_rank.request_counts() == {"get": 3}
