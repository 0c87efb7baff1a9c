"""Name-negotiated execution of the Horovod API (gradsync/negotiation.py), process sets and the
timeline, over 1-4 ranks; the ResponseCache and the fusion plan in-process."""

import numpy as np
import pytest

from harness import launch

from gradsync.negotiation import Request, ResponseCache, _match_key, describe

CHECKS = ["out-of-order", "barrier", "duplicate", "unnamed", "fusion", "cache", "beside",
          "rounding", "shutdown"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_negotiated_execution(np_):
    result = launch(np_, "negotiation.py", timeout=90)
    assert result.returncode == 0, result
    for check in CHECKS + (["mismatch"] if np_ > 1 else []):
        assert result.output.count(f"ok {check} ") == np_, (check, result.output[-3000:])


@pytest.mark.multiprocess
def test_an_operation_some_ranks_never_issue_fails_after_the_timeout_not_hangs(tmp_path):
    result = launch(3, "negotiation_stall.py", str(tmp_path), timeout=90,
                    env={"GRADSYNC_TIMEOUT": "4", "GRADSYNC_STALL_WARNING": "1"})
    assert result.returncode == 0, result
    assert result.output.count("ok stall ") == 3, result.output[-3000:]
    assert "operation 'allreduce.orphan' has waited" in result.output, result.output[-3000:]
    assert "not yet by ranks [2]" in result.output, result.output[-3000:]


@pytest.mark.multiprocess
# TCP inside a set at 3 ranks is in the slow tier; test_subworld.py keeps it in the default one
@pytest.mark.parametrize("np_,transport", [pytest.param(3, "tcp", marks=pytest.mark.slow),
                                           (4, "auto")])
def test_process_sets(np_, transport):
    result = launch(np_, "process_sets.py", timeout=120, env={"GRADSYNC_TRANSPORT": transport})
    assert result.returncode == 0, result
    for check in ("collectives", "global-not-blocked", "concurrent", "add-remove", "optimizer",
                  "shutdown"):
        assert result.output.count(f"ok {check} ") == np_, (check, result.output[-3000:])


@pytest.mark.multiprocess
def test_timeline_of_the_horovod_api(tmp_path):
    result = launch(2, "hvd_timeline.py", str(tmp_path / "tl.json"), timeout=60,
                    env={"GRADSYNC_TIMELINE": str(tmp_path / "env.json")})
    assert result.returncode == 0, result
    assert result.output.count("ok timeline") == 2, result
    assert (tmp_path / "tl.json").exists() and (tmp_path / "tl.json.1").exists()


def test_cache_bits_are_assigned_in_order_and_reused_after_eviction():
    cache = ResponseCache(capacity=2)
    sig = ("allreduce", "float32", (3,), "SUM", None, 1.0, 1.0)
    cache.put("allreduce.a", sig)
    cache.put("allreduce.b", sig)
    assert cache.bit("allreduce.a", sig) == 0 and cache.bit("allreduce.b", sig) == 1
    assert cache.bit("allreduce.a", sig[:2] + ((4,),) + sig[3:]) is None  # another shape
    cache.put("allreduce.a", sig)  # a hit: b is now the least recently used
    cache.put("allreduce.c", sig)
    assert cache.bit("allreduce.b", sig) is None and cache.bit("allreduce.c", sig) == 1
    assert cache.entry(1) == ("allreduce.c", sig) and len(cache) == 2
    cache.put("allreduce.noname.4", sig)  # unnamed names never repeat: not cached
    assert cache.bit("allreduce.noname.4", sig) is None and len(cache) == 2


def test_signatures_match_on_what_must_agree():
    gather = Request("allgather.x", "allgather", "float32", (3, 4))
    other_rows = Request("allgather.x", "allgather", "float32", (5, 4))
    other_cols = Request("allgather.x", "allgather", "float32", (3, 5))
    assert _match_key(gather.sig) == _match_key(other_rows.sig)
    assert _match_key(gather.sig) != _match_key(other_cols.sig)
    a = Request("allreduce.x", "allreduce", "float32", (3, 4), op="SUM", flat=np.zeros(12))
    b = Request("allreduce.x", "allreduce", "float32", (4, 3), op="SUM", flat=np.zeros(12))
    assert _match_key(a.sig) != _match_key(b.sig)
    assert describe(a.sig) == "allreduce float32[3, 4] op=SUM"
    bc = Request("broadcast.x", "broadcast", "int64", (2,), root=1, scale=(1.0, 1.0))
    assert describe(bc.sig) == "broadcast int64[2] root=1"
