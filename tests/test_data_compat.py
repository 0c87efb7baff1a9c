"""``gradsync.data.as_dataloader``: DDP over the "gradsync" backend and Lightning's Trainer fed
by data servers through a real ``torch.utils.data.DataLoader``.

The rank side is tests/ranks/data_ddp.py; these tests check each worker's labels against the
plan (``gradsync.data.plan``), the even epochs DDP needs, and that DDP kept the workers'
parameters equal (its allreduce ran at every step on every worker).
"""

import importlib.util
import json

import pytest

from gradsync.data import plan as P

import harness

pytestmark = pytest.mark.multiprocess

BATCH, SEED = 4, 3  # as in data_ddp.py


def _run(mode, workers, servers, samples, directory):
    r = harness.launch(workers, "data_ddp.py", mode, str(directory), str(samples),
                       timeout=150, launcher_args=("--data-servers", str(servers)))
    assert r.returncode == 0, str(r)
    return [json.loads((directory / f"{mode}-{w}.json").read_text()) for w in range(workers)]


def _planned(samples, epoch, servers, workers, worker, count):
    batches = P.worker_batches(P.plan(samples, BATCH, SEED, epoch, servers, workers), worker)
    return [i for b in batches[:count] for i in b.ids.tolist()]


def test_ddp_trains_on_even_epochs_of_the_planned_batches(tmp_path):
    # 44 samples in 11 batches over 3 workers: 4, 4 and 3; each worker yields 3, so DDP's
    # allreduce pairs up, and the 2 batches past the even count are dropped.
    got = _run("ddp", 3, 1, 44, tmp_path)
    for w, record in enumerate(got):
        assert record["lengths"] == [3, 3]
        for epoch in (0, 1):
            assert record["epochs"][str(epoch)] == _planned(44, epoch, 1, 3, w, 3)
    for epoch in ("0", "1"):
        ids = [i for record in got for i in record["epochs"][epoch]]
        assert len(ids) == len(set(ids)) == 36
    assert got[0]["params"] == got[1]["params"] == got[2]["params"]


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="Lightning is not installed (pip install lightning)")
def test_lightning_trainer_gets_every_sample_exactly_once(tmp_path):
    # 44 samples over 2 data servers: 6 batches each, 12 in all, 6 per worker (none dropped).
    got = _run("lightning", 2, 2, 44, tmp_path)
    for epoch in ("0", "1"):
        ids = [i for record in got for i in record["epochs"][epoch]]
        assert sorted(ids) == list(range(44)), f"epoch {epoch}"
        for w, record in enumerate(got):
            assert record["epochs"][epoch] == _planned(44, int(epoch), 2, 2, w, 6)
    assert [record["lengths"] for record in got] == [[6, 6], [6, 6]]
    assert got[0]["params"] == got[1]["params"]
