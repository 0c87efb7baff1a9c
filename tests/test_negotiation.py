"""Name-negotiated execution of the Horovod API (gradsync/pipeline/negotiation.py), process sets and
the timeline, over 1-4 ranks; the requests' signatures and the ResponseCache in-process (the
fusion stage on its own: tests/test_fusion.py)."""

import numpy as np
import pytest

from harness import launch
import small_jobs

from gradsync.pipeline.agreement import Signature
from gradsync.pipeline.negotiation import Request, ResponseCache, describe

CHECKS = ["out-of-order", "barrier", "duplicate", "unnamed", "fusion", "cache", "beside",
          "rounding", "steady", "shutdown"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_negotiated_execution(np_):
    # tests/ranks/negotiation.py, in the job it shares with other scripts (small_jobs.py)
    result = small_jobs.result(np_)
    assert small_jobs.ran(result, "negotiation.py", np_), result
    output = small_jobs.output(result, "negotiation.py")
    for check in CHECKS + (["mismatch"] if np_ > 1 else []):
        assert output.count(f"ok {check} ") == np_, (check, output[-3000:])


@pytest.mark.multiprocess
def test_an_operation_some_ranks_never_issue_fails_after_the_timeout_not_hangs(tmp_path):
    result = launch(3, "negotiation_stall.py", str(tmp_path), timeout=120,
                    env={"GRADSYNC_TIMEOUT": "4", "GRADSYNC_STALL_WARNING": "1"})
    assert result.returncode == 0, result
    assert result.output.count("ok stall ") == 3, result.output[-3000:]
    assert "operation 'allreduce.orphan' has waited" in result.output, result.output[-3000:]
    assert "not yet by ranks [2]" in result.output, result.output[-3000:]
    # a cached name, voted for as a bit, is warned about and expires all the same
    assert result.output.count("ok cached-stall ") == 3, result.output[-3000:]
    assert "operation 'allreduce.cached' has waited" in result.output, result.output[-3000:]


@pytest.mark.multiprocess
# TCP inside a set at 3 ranks is in the slow tier; test_subworld.py keeps it in the default one
@pytest.mark.parametrize("np_,transport", [pytest.param(3, "tcp", marks=pytest.mark.slow),
                                           (4, "auto")])
def test_process_sets(np_, transport):
    if transport == "auto":  # in the 4-rank job it shares with other scripts (small_jobs.py)
        result = small_jobs.result(np_)
        assert small_jobs.ran(result, "process_sets.py", np_), result
        output = small_jobs.output(result, "process_sets.py")
    else:
        result = launch(np_, "process_sets.py", timeout=120, env={"GRADSYNC_TRANSPORT": transport})
        assert result.returncode == 0, result
        output = result.output
    for check in ("collectives", "global-not-blocked", "concurrent", "add-remove", "optimizer",
                  "shutdown"):
        assert output.count(f"ok {check} ") == np_, (check, output[-3000:])


@pytest.mark.multiprocess
def test_timeline_of_the_horovod_api(tmp_path):
    result = launch(2, "hvd_timeline.py", str(tmp_path / "tl.json"), timeout=60,
                    env={"GRADSYNC_TIMELINE": str(tmp_path / "env.json")})
    assert result.returncode == 0, result
    assert result.output.count("ok timeline") == 2, result
    assert (tmp_path / "tl.json").exists() and (tmp_path / "tl.json.1").exists()


def test_a_request_carries_the_signature_every_field_named():
    # Every field by name: a field added to or dropped from Signature, or a Request that
    # builds it differently, fails here.
    q = Request("allreduce.a", "allreduce", "float32", [3, 2], op="SUM", scale=(0.5, 2))
    assert type(q.sig) is Signature
    assert q.sig == Signature(kind="allreduce", dtype="float32", shape=(3, 2), op="SUM",
                              root=None, prescale=0.5, postscale=2.0, shared=False)
    # and in this order, which is what the wire carries (see negotiation._to_wire)
    assert tuple(q.sig) == ("allreduce", "float32", (3, 2), "SUM", None, 0.5, 2.0, False)
    bc = Request("broadcast.b", "broadcast", "int64", (4,), root=1, shared=True)
    assert bc.sig == Signature(kind="broadcast", dtype="int64", shape=(4,), op=None, root=1,
                               prescale=1.0, postscale=1.0, shared=True)


def test_cache_bits_are_assigned_in_order_and_reused_after_eviction():
    cache = ResponseCache(capacity=2)
    sig = Request("allreduce.a", "allreduce", "float32", (3,), op="SUM").sig
    cache.put("allreduce.a", sig)
    cache.put("allreduce.b", sig)
    assert cache.bit("allreduce.a", sig) == 0 and cache.bit("allreduce.b", sig) == 1
    assert cache.bit("allreduce.a", sig._replace(shape=(4,))) is None  # another shape
    assert cache.bit("allreduce.a", sig._replace(shared=True)) is None  # the last field
    cache.put("allreduce.a", sig)  # a hit: b is now the least recently used
    cache.put("allreduce.c", sig)
    assert cache.bit("allreduce.b", sig) is None and cache.bit("allreduce.c", sig) == 1
    assert cache.entry(1) == ("allreduce.c", sig) and len(cache) == 2
    cache.put("allreduce.noname.4", sig)  # unnamed names never repeat: not cached
    assert cache.bit("allreduce.noname.4", sig) is None and len(cache) == 2
    # a bucket of unnamed parameters repeats every step: cached
    bucket = "allreduce.gradients[0] allreduce.noname.0.0 .. allreduce.noname.0.3 (4 tensors)"
    cache.put(bucket, sig)
    assert cache.bit(bucket, sig) == 0 and len(cache) == 2


def test_signatures_match_on_what_must_agree():
    gather = Request("allgather.x", "allgather", "float32", (3, 4))
    other_rows = Request("allgather.x", "allgather", "float32", (5, 4))
    other_cols = Request("allgather.x", "allgather", "float32", (3, 5))
    assert gather.sig.match_key() == other_rows.sig.match_key()
    assert gather.sig.match_key() != other_cols.sig.match_key()
    a = Request("allreduce.x", "allreduce", "float32", (3, 4), op="SUM", flat=np.zeros(12))
    b = Request("allreduce.x", "allreduce", "float32", (4, 3), op="SUM", flat=np.zeros(12))
    assert a.sig.match_key() != b.sig.match_key()
    assert describe(a.sig) == "allreduce float32[3, 4] op=SUM"
    bc = Request("broadcast.x", "broadcast", "int64", (2,), root=1, scale=(1.0, 1.0))
    assert describe(bc.sig) == "broadcast int64[2] root=1"
