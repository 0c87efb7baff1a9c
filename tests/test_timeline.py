"""The timeline writer (gradsync/timeline.py): a Chrome-trace file, valid while it is written,
one row per tensor name, nested phases, complete at close, safe from many threads."""

from __future__ import annotations

import json
import threading
import time

import pytest

from gradsync.timeline import Timeline, load, merge, rank_path


def rows(events: list[dict], pid: int = 0) -> dict[str, int]:
    """Tensor name -> tid, from the thread-name metadata of process ``pid``."""
    return {e["args"]["name"]: e["tid"] for e in events
            if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == pid
            and e["tid"] != 0}


def bars(events: list[dict], tid: int) -> list[tuple[str, float, float, int]]:
    """The (phase, start, end, depth) of every B/E pair on row ``tid``, matched as viewers do."""
    stack, out = [], []
    for e in events:
        if e.get("tid") != tid or e["ph"] not in "BE":
            continue
        if e["ph"] == "B":
            stack.append(e)
        else:
            b = stack.pop()
            out.append((b["name"], float(b["ts"]), float(e["ts"]), len(stack)))
    assert not stack, f"unclosed bars on row {tid}: {stack}"
    return out


def test_events_are_valid_json_while_the_writer_is_open(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path), flush_interval=0.02)
    try:
        tl.begin("grad.fc1", "NEGOTIATE", {"dtype": "float32", "shape": [10, 4]})
        tl.instant("grad.fc1", "rank 1 ready")
        # The writer's own pass (no flush() call) must bring the events into the file.
        deadline = time.monotonic() + 10
        while True:
            events = json.loads(path.read_text())  # a complete array after every write
            if any(e.get("ph") == "i" for e in events) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        tid = rows(events)["grad.fc1"]
        begin = next(e for e in events if e.get("ph") == "B")
        assert (begin["name"], begin["tid"], begin["pid"]) == ("NEGOTIATE", tid, 0)
        assert begin["args"] == {"dtype": "float32", "shape": [10, 4]}
        assert any(e.get("ph") == "i" and e["name"] == "rank 1 ready" and e["s"] == "t"
                   for e in events)
        tl.end("grad.fc1")
        assert tl.flush()
        assert [b[0] for b in bars(json.loads(path.read_text()), tid)] == ["NEGOTIATE"]
    finally:
        tl.close()


def test_one_row_per_name_and_phases_nest(tmp_path):
    path = tmp_path / "t.json"
    with Timeline(str(path)) as tl:
        for name in ("a", "b", "a", "c"):
            tl.begin(name, "ALLREDUCE")
            tl.begin(name, "MEMCPY_IN_FUSION_BUFFER")
            tl.end(name)
            tl.begin(name, "RING")
            tl.end(name, "RING")
            tl.end(name, "ALLREDUCE")
    events = load(str(path))
    ids = rows(events)
    assert list(ids) == ["a", "b", "c"] and len(set(ids.values())) == 3
    for name, repeats in (("a", 2), ("b", 1), ("c", 1)):
        got = bars(events, ids[name])
        assert sorted(phase for phase, *_ in got) == sorted(
            ["ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "RING"] * repeats)
        for phase, start, end, depth in got:
            assert start <= end
            assert depth == (0 if phase == "ALLREDUCE" else 1)
            if depth:  # inside its ALLREDUCE bar
                assert any(p == "ALLREDUCE" and s <= start and end <= e for p, s, e, _ in got)
    meta = [e for e in events if e.get("name") == "process_name"]
    assert len(meta) == 1 and meta[0]["pid"] == 0 and meta[0]["args"]["name"] == "rank 0"
    # Horovod's key for the file's wall-clock origin, in microseconds since the epoch.
    assert abs(meta[0]["args"]["start_time_since_epoch_in_micros"] / 1e6 - time.time()) < 60


def test_end_with_a_phase_closes_the_bars_inside_it(tmp_path):
    path = tmp_path / "t.json"
    with Timeline(str(path)) as tl:
        tl.begin("x", "ALLREDUCE")
        tl.begin("x", "QUEUE")
        tl.end("x", "ALLREDUCE")  # QUEUE ends with it
        tl.end("x")  # nothing open: ignored, warned
        tl.begin("x", "BROADCAST")
    events = load(str(path))
    got = bars(events, rows(events)["x"])
    assert sorted((p, d) for p, _, _, d in got) == [("ALLREDUCE", 0), ("BROADCAST", 0), ("QUEUE", 1)]


def test_close_makes_a_complete_file_and_ends_open_bars(tmp_path):
    path = tmp_path / "t.json"
    tl = Timeline(str(path), flush_interval=60)  # no pass of the writer before close
    tl.begin("w", "ALLREDUCE")
    tl.begin("w", "QUEUE")
    tl.close()
    assert tl.closed
    text = path.read_text()
    assert text.startswith("[\n") and text.endswith("\n]")
    events = json.loads(text)
    assert [(p, d) for p, _, _, d in bars(events, rows(events)["w"])] == [("QUEUE", 1),
                                                                        ("ALLREDUCE", 0)]
    tl.begin("w", "LATE")  # after close: dropped, no error
    tl.close()
    assert json.loads(path.read_text()) == events


def test_cycle_marks_only_when_asked(tmp_path):
    for mark, want in ((True, 3), (False, 0)):
        path = tmp_path / f"c{mark}.json"
        with Timeline(str(path), mark_cycles=mark, rank=2) as tl:
            for _ in range(3):
                tl.cycle()
        events = load(rank_path(str(path), 2))
        marks = [e for e in events if e.get("name") == "CYCLE_START"]
        assert len(marks) == want
        assert all(e["ph"] == "i" and e["s"] == "p" and e["pid"] == 2 for e in marks)


def test_rank_files(tmp_path):
    path = str(tmp_path / "t.json")
    assert rank_path(path, 0) == path and rank_path(path, 3) == path + ".3"
    for rank in (0, 1):
        with Timeline(path, rank=rank) as tl:
            tl.begin(f"g{rank}", "ALLREDUCE")
            tl.end(f"g{rank}")
        assert tl.path == rank_path(path, rank)
    out = str(tmp_path / "all.json")
    assert merge(out, [path, path + ".1"]) == len(load(path)) + len(load(path + ".1"))
    events = load(out)
    assert rows(events, 0) == {"g0": 1} and rows(events, 1) == {"g1": 1}


def test_concurrent_writers(tmp_path):
    path = tmp_path / "t.json"
    threads, per_thread = 6, 500
    with Timeline(str(path), flush_interval=0.005) as tl:
        start = threading.Barrier(threads)

        def work(t: int) -> None:
            start.wait()
            for i in range(per_thread):
                name = f"t{t}.{i % 5}"
                tl.begin(name, "ALLREDUCE", {"i": i})
                tl.begin(name, "QUEUE")
                tl.end(name)
                tl.end(name, "ALLREDUCE")
                if i % 50 == 0:
                    tl.instant(name, "tick")

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    events = load(str(path))
    ids = rows(events)
    assert len(ids) == threads * 5
    total = 0
    for name, tid in ids.items():
        got = bars(events, tid)
        total += len(got)
        assert sorted({p for p, *_ in got}) == ["ALLREDUCE", "QUEUE"]
    assert total == threads * per_thread * 2
    assert sum(e.get("ph") == "i" for e in events) == threads * per_thread // 50


def test_load_repairs_a_file_cut_mid_write(tmp_path):
    path = tmp_path / "t.json"
    with Timeline(str(path)) as tl:
        for i in range(5):
            tl.begin("x", f"P{i}")
            tl.end("x")
    text = path.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[:-1].rstrip() + ",\n" + '{"ph": "B", "pid": 0, "ti')  # a crash mid-line
    assert load(str(cut)) == json.loads(text)


def test_unwritable_path_raises(tmp_path):
    with pytest.raises(OSError):
        Timeline(str(tmp_path / "missing-dir" / "t.json"))


def test_non_json_args_are_recorded_by_repr(tmp_path):
    path = tmp_path / "t.json"
    with Timeline(str(path)) as tl:
        tl.begin("x", "ALLREDUCE", {"dtype": object})
        tl.end("x")
    begin = next(e for e in load(str(path)) if e.get("ph") == "B")
    assert "object" in begin["args"]["repr"]
