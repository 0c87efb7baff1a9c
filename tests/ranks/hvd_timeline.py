"""The Horovod API's timeline: hvd.start_timeline/stop_timeline and GRADSYNC_TIMELINE
(argv[1]: the path given to start_timeline). Each rank checks its own file's rows and bars."""

import common  # noqa: F401  (deadline)

import os
import sys

import torch

import gradsync.torch as hvd
from gradsync.timeline import load, rank_path
from gradsync.torch import process_sets

hvd.init()
R, N = hvd.rank(), hvd.size()
ctl = process_sets.controller(hvd.global_process_set)


def rows(events):
    return {e["args"]["name"]: e["tid"] for e in events
            if e.get("name") == "thread_name" and e.get("tid")}


def bars(events, tid):
    """(phase, depth) of each bar on row ``tid``, in order of opening."""
    out, depth = [], 0
    for e in events:
        if e.get("tid") != tid or e.get("ph") not in ("B", "E"):
            continue
        if e["ph"] == "B":
            out.append((e["name"], depth))
            depth += 1
        else:
            depth -= 1
    assert depth == 0, "a bar was left open"
    return out


# 1. From init (GRADSYNC_TIMELINE): the first operation is in the file named by the variable.
hvd.allreduce(torch.ones(3), name="from_env")

# 2. start_timeline: a fused pair and a broadcast.
path = sys.argv[1]
hvd.start_timeline(path, mark_cycles=True)
with ctl._cv:  # both announced in one cycle on this rank: fused
    ha = hvd.allreduce_async(torch.ones(5), name="tl_a")
    hb = hvd.allreduce_async(torch.ones(7), name="tl_b")
hvd.synchronize(ha), hvd.synchronize(hb)
hvd.broadcast(torch.ones(2), root_rank=0, name="tl_bc")
hvd.stop_timeline()

events = load(rank_path(path, R))
ids = rows(events)
assert {"allreduce.tl_a", "allreduce.tl_b", "broadcast.tl_bc"} <= set(ids), ids
for name in ("allreduce.tl_a", "allreduce.tl_b"):
    phases = [p for p, _ in bars(events, ids[name])]
    assert phases == ["NEGOTIATE_ALLREDUCE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
                      "MEMCPY_OUT_FUSION_BUFFER"], (name, phases)
phases = [p for p, _ in bars(events, ids["broadcast.tl_bc"])]
assert phases == ["NEGOTIATE_BROADCAST", "QUEUE", "BROADCAST"], phases
assert any(e.get("name") == "CYCLE_START" for e in events)
meta = [e for e in events if e.get("name") == "process_name"]
assert meta[0]["args"]["start_time_since_epoch_in_micros"] > 0, meta
assert "allreduce.from_env" not in ids  # that one went to the other file

# 3. Stopped: nothing more is recorded; the file from init was closed by start_timeline.
hvd.allreduce(torch.ones(3), name="after_stop")
assert "allreduce.after_stop" not in rows(load(rank_path(path, R)))
env_events = load(rank_path(os.environ["GRADSYNC_TIMELINE"], R))
assert "allreduce.from_env" in rows(env_events), rows(env_events)
assert not any(e.get("name") == "CYCLE_START" for e in env_events)  # mark_cycles off

hvd.shutdown()
print(f"ok timeline {R}", flush=True)
