"""The global order (``Loader(order="global")``, ``plan.py``): an epoch's batches are cut from
its permutation, so the sequence of samples, batch by batch, is the same at any number of
workers and data servers, and a job resumed at other counts goes on with the same sequence.

What is promised, and checked here: batch ``g`` of an epoch holds the same sample ids *in the
same rows* at every count (so the sequence of batches, and of samples, is equal in order), and
a job of W workers trains at its step ``k`` on batches ``k*W .. k*W + W-1``. The launcher-level
checks (real ranks, a resume at other counts) are the ``global`` tests of
tests/test_data_multiprocess.py.
"""

import itertools

import numpy as np
import pytest

from gradsync.data import plan as P

COUNTS = list(itertools.product([1, 2, 3], [1, 2, 3]))  # (servers, workers)


def _batches(samples, batch_size, servers, workers, epoch=1, done=None):
    return P.plan(samples, batch_size, seed=3, epoch=epoch, servers=servers, workers=workers,
                  done=done, cut="global")


def _rows(batches):
    return [b.ids.tolist() for b in batches]


def test_the_batches_are_the_permutation_cut_in_order_at_every_count():
    for samples, batch_size in [(0, 4), (1, 4), (103, 4), (60, 7), (256, 10)]:
        perm = P.order(samples, 3, 1).tolist()
        want = [perm[a:a + batch_size] for a in range(0, samples, batch_size)]
        for servers, workers in COUNTS:
            batches = _batches(samples, batch_size, servers, workers)
            assert _rows(batches) == want, (samples, batch_size, servers, workers)
            assert [b.index for b in batches] == list(range(len(want)))
            assert [b.worker for b in batches] == [g % workers for g in range(len(want))]
            assert [b.server for b in batches] == [g % servers for g in range(len(want))]


def test_each_step_of_a_job_trains_on_the_same_samples_at_one_two_and_three_workers():
    # A step of W workers takes each worker's next batch: the steps at 1 worker, grouped W at
    # a time, are the steps at W workers, whatever the number of servers.
    steps = {}
    for servers, workers in COUNTS:
        batches = _batches(103, 4, servers, workers)
        mine = [P.worker_batches(batches, w) for w in range(workers)]
        flat = [i for k in range(len(mine[0])) for w in range(workers) if k < len(mine[w])
                for i in mine[w][k].ids.tolist()]
        steps[servers, workers] = flat
    assert len({tuple(v) for v in steps.values()}) == 1
    assert steps[1, 1] == P.order(103, 3, 1).tolist()


def test_the_by_server_cut_depends_on_the_servers_which_the_global_cut_fixes():
    # The reason for the global cut: the default one's batches change with the servers.
    by_server = [_rows(P.plan(60, 4, 3, 1, servers, 2)) for servers in (1, 2, 3)]
    assert by_server[0] != by_server[1] != by_server[2]
    assert _rows(_batches(60, 4, 1, 2)) == _rows(_batches(60, 4, 2, 2)) == \
        _rows(_batches(60, 4, 3, 2))


@pytest.mark.parametrize("before, after", [((1, 3), (3, 2)), ((2, 2), (1, 1)),
                                           ((3, 1), (2, 3))])
def test_a_job_resumed_at_other_counts_goes_on_with_the_same_sequence(before, after):
    # A checkpoint after k steps of W workers marks k*W whole batches done: a prefix of the
    # permutation. The resumed job's batches are the rest of the same cut.
    servers, workers = before
    full = _batches(103, 4, servers, workers)
    k = 3
    done = np.zeros(103, bool)
    for b in full[:k * workers]:
        done[b.ids] = True
    resumed = _batches(103, 4, *after, done=done)
    assert _rows(resumed) == _rows(full[k * workers:])
    # A mask with holes (a worker that had delivered a batch more than another) still serves
    # exactly the rest, in the permutation's order.
    done[full[k * workers].ids] = True
    rest = _batches(103, 4, *after, done=done)
    perm = P.order(103, 3, 1)
    assert [i for r in _rows(rest) for i in r] == perm[~done[perm]].tolist()


def test_an_unknown_cut_is_refused():
    with pytest.raises(ValueError, match="order must be one of"):
        P.plan(10, 2, 0, 0, 1, 1, cut="random")


def test_the_worked_example_of_the_module_docstring(monkeypatch):
    monkeypatch.setattr(P, "order", lambda n, seed, epoch: np.array([7, 2, 9, 4, 0, 5, 3, 8, 1, 6]))
    batches = P.plan(10, 2, 0, 0, servers=2, workers=2, cut="global")
    assert [(b.ids.tolist(), b.server, b.worker) for b in batches] == [
        ([7, 2], 0, 0), ([9, 4], 1, 1), ([0, 5], 0, 0), ([3, 8], 1, 1), ([1, 6], 0, 0)]


def test_an_elastic_recovery_goes_on_with_the_same_sequence_at_the_new_count():
    # 3 workers applied 4 updates each (12 batches) and worker 1 is lost; the survivors hold
    # their 5th batch. ``live_state`` with the global cut credits the first 12 batches, a
    # prefix of the permutation, and a new generation of 2 workers goes on from batch 12.
    from gradsync.data.elastic import live_state

    full = _batches(50, 3, 2, 3)

    def position(place, acked):
        mine = P.worker_batches(full, place)
        delivered = np.zeros(50, bool)
        for b in mine[:acked]:
            delivered[b.ids] = True
        return {"epoch": 1, "acked": acked, "delivered": P.pack_mask(delivered),
                "hand": mine[acked].ids.tolist(), "start": None, "workers": 3,
                "place": place}

    state = live_state(50, 3, 3, 2, [position(0, 4), position(2, 4)], "global")
    done = P.unpack_mask(state["done"], 50)
    assert sorted(np.flatnonzero(done).tolist()) == sorted(
        i for b in full[:12] for i in b.ids.tolist())
    assert _rows(_batches(50, 3, 1, 2, done=done)) == _rows(full[12:])
