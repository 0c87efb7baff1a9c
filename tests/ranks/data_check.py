"""Data-server checks, one scenario per run: ``data_check.py SCENARIO DIR [ARGS]``.

Every rank runs this script; data-server ranks serve inside ``gradsync.data.Loader`` and exit.
The dataset's sample i is ``{"x": [i, i, i], "id": i}`` and the transform adds a number drawn
from its generator, so a worker can check every value it receives against the closed form
(``expected``): the sample's id, and an augmentation that differs between epochs. Each worker
writes what it received, in order, to ``DIR/<tag>-<rank>.json`` as ``{epoch: [ids]}``; the test
checks them (tests/test_data_multiprocess.py).

    count DIR EPOCHS         EPOCHS whole epochs, the first loop left with break after 2
                             batches and entered again; worker 0 writes the servers' counters
    stop DIR STEPS           STEPS batches of epoch 0, then state_dict(), saved by worker 0
    resume DIR EPOCHS        loads DIR/state.json and runs to the end of epoch EPOCHS - 1
    killserver DIR EPOCHS    as count, but worker 0 SIGKILLs data server 0 after 5 batches
    lose-POINT DIR EPOCHS    worker 0 SIGKILLs three data servers, each while every other
                             worker is held at a moment (``lose``): server 0 while they
                             connect (held before POINT: dial, hello or regions), server 1
                             while every worker is inside state_dict(), server 2 between
                             epochs 0 and 1; each worker writes its ids as count does, and
                             those it had received when it called state_dict() to
                             DIR/before-<rank>.json; worker 0 the state to DIR/state.json
    shrink DIR STEPS         2 workers commit after STEPS batches, take 2 more, then worker 1
                             is lost and worker 0 resets to the commit alone (``shrink``)
    broken DIR SAMPLE        the dataset cannot read sample SAMPLE: each worker iterates epoch
                             0 and writes the error it raised to DIR/broken-<rank>.txt
    stopserver DIR EPOCHS    as count (no break), but worker 0 SIGSTOPs data server 0 once
                             every worker has 3 batches and writes when to DIR/stopped.json;
                             each worker writes the servers it gave up, when and why, to
                             DIR/lost-<rank>.json; at the end worker 0 SIGCONTs the server,
                             which finds its workers gone and ends (``stopped``)
    holdserver DIR EPOCHS    as count (no break), but each data server holds its GIL in one C
                             call for GS_DATA_HOLD seconds (``hold``), once every worker has
                             its first batch; each worker writes the servers it gave up to
                             DIR/lost-<rank>.json (``gil_held``)

GS_DATA_COLLATE=pack serves ``Tokens`` (sample i: ``i % 8`` tokens) packed into rows of 8 by
``collate.Pack``; each worker checks every sample's tokens and writes the ids as count does.
GS_DATA_ORDER=global cuts the batches from the epoch's permutation (``Loader``'s ``order``).
GS_DATA_SLOW=ID:SECONDS makes the dataset take SECONDS to read sample ID (a slow server, not a
lost one: its decode is cached, so only the first epoch pays).
GS_DATA_HOLD=SECONDS makes each data server, once DIR/hold exists, hold its GIL for SECONDS in
one C call while it reads its next sample (as a long ``import torch`` does), then write how
long to DIR/gil-<pid>.json.
"""

import common  # (deadline)

import ctypes
import json
import os
import signal
import sys
import time

import numpy as np
import torch

import gradsync as gs
import gradsync.data

SAMPLES = int(os.environ.get("GS_DATA_SAMPLES", "103"))
BATCH = int(os.environ.get("GS_DATA_BATCH", "4"))
SEED = int(os.environ.get("GS_DATA_SEED", "7"))
ORDER = os.environ.get("GS_DATA_ORDER", "servers")  # how batches are cut (plan.ORDERS)
SLOW = [float(x) for x in os.environ["GS_DATA_SLOW"].split(":")] \
    if os.environ.get("GS_DATA_SLOW") else None
HOLD = float(os.environ.get("GS_DATA_HOLD", "0"))
_held = []


def hold():
    """(A data server, GS_DATA_HOLD.) Once DIR/hold exists, holds the GIL for HOLD seconds
    (once): ctypes.pythonapi is a PyDLL, whose calls keep the GIL, so no other thread of this
    server runs Python meanwhile, its Python beater included."""
    directory = sys.argv[2]
    if _held or not os.path.exists(os.path.join(directory, "hold")):
        return
    start = time.monotonic()
    ctypes.pythonapi.usleep(int(HOLD * 1e6))
    _held.append(time.monotonic() - start)
    with open(os.path.join(directory, f"gil-{os.getpid()}.json"), "w") as f:
        json.dump(_held[0], f)


class Numbers:
    def __init__(self, broken=-1):
        self.broken = broken

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        if i == self.broken:
            raise OSError(f"sample {i} is unreadable")
        if SLOW is not None and i == SLOW[0]:
            time.sleep(SLOW[1])  # emulated slow storage: the server is slow, not lost
        if HOLD:
            hold()
        return {"x": np.full(3, i, np.float32), "id": i}


class Tokens:
    """Sample i: ``i % 8`` tokens (0 .. 7: empty ones included), ``1000 * i + k``; packed
    into rows of 8 with a separator, a sample of 7 tokens fills a row."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return torch.arange(i % 8, dtype=torch.int64) + 1000 * i


def receive_packed(loader, batch, seen):
    ids = loader.ids.tolist()
    samples = gradsync.data.Pack.split(batch)
    assert len(samples) == len(ids) and batch["tokens"].shape[1] == 8
    for i, tokens in zip(ids, samples):
        assert tokens.tolist() == (torch.arange(i % 8) + 1000 * i).tolist(), (i, tokens)
    seen.setdefault(str(loader._active.epoch), []).extend(ids)


def augment(sample, rng):
    return {"x": sample["x"] + np.float32(rng.integers(0, 1000)), "id": sample["id"]}


def expected(ids, epoch):
    bump = [np.random.default_rng([SEED, epoch, i]).integers(0, 1000) for i in ids]
    return np.repeat((np.asarray(ids) + np.asarray(bump, dtype=np.float32))[:, None], 3, 1)


def receive(loader, batch, seen):
    ids = batch["id"].tolist()
    assert ids == loader.ids.tolist(), (ids, loader.ids)
    assert batch["x"].dtype == torch.float32 and batch["x"].shape == (len(ids), 3)
    np.testing.assert_array_equal(batch["x"].numpy(), expected(ids, loader._active.epoch))
    seen.setdefault(str(loader._active.epoch), []).extend(ids)


def write(directory, tag, seen):
    with open(os.path.join(directory, f"{tag}-{gs.rank()}.json"), "w") as f:
        json.dump(seen, f)


def shrink(loader, directory, steps, seen):
    """Two workers take ``steps`` batches, commit (``state_dict``), take 2 more; then worker
    1 is lost (it takes nothing more) and worker 0 goes on alone as a new generation of one
    worker from the commit, to the end of epoch 1."""
    it = iter(loader)
    for _ in range(steps):
        receive(loader, next(it), seen)
    state = loader.state_dict()
    for _ in range(2):  # taken after the commit: rolled back
        receive(loader, next(it), seen)
    gs.barrier()
    shrunk = os.path.join(directory, "shrunk")
    if gs.rank() == 1:
        # Lost: still connected, taking nothing, until worker 0 is done.
        common.until(lambda: os.path.exists(shrunk), "worker 0's end", every=0.05)
        return
    loader.reset(0, 1, state)
    after: dict = {}
    while loader.epoch < 2:
        for batch in loader:
            receive(loader, batch, after)
    with open(os.path.join(directory, "shrink.json"), "w") as f:
        json.dump({"state": state, "before": seen, "after": after}, f)
    open(shrunk, "w").close()


# --- holding workers at a moment of the data code while a data server is killed ----------
#
# Each kill is a meeting in DIR: every worker held for it writes DIR/held-<stage>-<rank> where
# it is held and waits for DIR/release-<stage>; worker 0 waits until every held worker is
# there, SIGKILLs the data server, waits until its process has exited (so that its sockets are
# closed and its port refuses), and writes the release. No sleep stands for any of these steps.

def held(directory, stage):
    """(A held worker.) Says it is at ``stage``'s moment and waits for the release."""
    open(os.path.join(directory, f"held-{stage}-{gs.rank()}"), "w").close()
    release = os.path.join(directory, f"release-{stage}")
    common.until(lambda: os.path.exists(release), f"the release of {stage}")


def kill(directory, stage, pid, holding):
    """(Worker 0.) Once the workers ``holding`` are held at ``stage``, SIGKILLs process ``pid``
    (a data server) and releases them when it has exited."""
    names = [os.path.join(directory, f"held-{stage}-{w}") for w in holding]
    common.until(lambda: all(os.path.exists(n) for n in names), f"every worker at {stage}")
    os.kill(pid, signal.SIGKILL)
    common.until(lambda: common.gone(pid), f"the end of data server process {pid}")
    open(os.path.join(directory, f"release-{stage}"), "w").close()


def hold_connecting(directory, point):
    """Holds workers other than 0, inside ``Loader(...)``, just before their first
    connection to a data server (``dial``), their first hello (``hello``) or their first
    read of a server's region table (``regions``): server 0 in each case."""
    from gradsync.transport import region_peer, regions

    cls, name = {"dial": (regions.Endpoint, "connect"),
                 "hello": (region_peer.RemotePeer, "call_async"),
                 "regions": (region_peer.RemotePeer, "region")}[point]
    original = getattr(cls, name)
    first = []

    def holding(self, *args, **kwargs):
        if not first and (point != "hello" or args[0] == "hello"):
            first.append(True)
            held(directory, "connect")
        return original(self, *args, **kwargs)

    setattr(cls, name, holding)


def hold_in_state_dict(directory, workers, pid_of):
    """Holds every worker inside ``state_dict()``, before its gather; worker 0 kills data
    server 1 meanwhile (``pid_of(1)``)."""
    from gradsync import api

    original = api.allgather_object

    def gather(obj, name=None):
        if name == "gradsync.data.state_dict":
            if gs.rank() == 0:
                kill(directory, "state", pid_of(1), range(1, workers))
            else:
                held(directory, "state")
        return original(obj, name=name)

    api.allgather_object = gather


def lose(loader, directory, epochs, seen, steps=3):
    """Epochs 0 .. ``epochs`` - 1, losing a data server at two more moments (the module
    docstring): during the state_dict() after ``steps`` batches of epoch 0, and between
    epochs 0 and 1."""
    hold_in_state_dict(directory, gs.size(), lambda d: loader.peers[d].pid)
    before, taken = None, 0
    while loader.epoch < epochs:
        if loader.epoch == 1:
            gs.barrier()  # every worker is between the epochs
            if gs.rank() == 0:
                kill(directory, "epoch", loader.peers[2].pid, [])
            gs.barrier()
        for batch in loader:
            receive(loader, batch, seen)
            taken += 1
            if taken == steps:
                before = list(seen["0"])
                state = loader.state_dict()
                if gs.rank() == 0:
                    with open(os.path.join(directory, "state.json"), "w") as f:
                        json.dump(state, f)
    with open(os.path.join(directory, f"before-{gs.rank()}.json"), "w") as f:
        json.dump(before, f)


def recorded_losses(loader) -> dict:
    """Every server the worker gives up from now on, with the wall time and the error, as its
    Loader does it: ``{server: [wall, error]}``."""
    losses = {}
    lose = loader._lose

    def timed(d, error):
        losses.setdefault(str(d), [time.time(), f"{type(error).__name__}: {error}"])
        lose(d, error)

    loader._lose = timed  # the fetch thread and the watch call it through the instance
    return losses


def gil_held(loader, directory, epochs, seen):
    """Epochs 0 .. ``epochs`` - 1 while each data server holds its GIL for GS_DATA_HOLD
    seconds (``hold``), from its next sample once worker 0 has made DIR/hold: after every
    worker has its first batch, so every epoch's start has been answered and no call to a
    server is in flight (a call waits for a reply that a server holding its GIL cannot give,
    on the take road as on this one). Each worker writes the servers it gave up."""
    losses = recorded_losses(loader)
    received = 0
    while loader.epoch < epochs:
        for batch in loader:
            receive(loader, batch, seen)
            received += 1
            if received == 1:
                gs.barrier()
                if gs.rank() == 0:
                    open(os.path.join(directory, "hold"), "w").close()
    write(directory, "holdserver", seen)
    with open(os.path.join(directory, f"lost-{gs.rank()}.json"), "w") as f:
        json.dump(losses, f)


def stopped(loader, directory, epochs, seen):
    """Epochs 0 .. ``epochs`` - 1 while data server 0 is stopped (SIGSTOP, by worker 0 once
    every worker has its third batch): its pid lives and its sockets stay open, so only the
    liveness watch can give it up. Each worker records every server it gave up
    (``recorded_losses``)."""
    losses = recorded_losses(loader)
    pid = loader.peers[0].pid
    received = 0
    while loader.epoch < epochs:
        for batch in loader:
            receive(loader, batch, seen)
            received += 1
            if received == 3:
                # Every worker is in the middle of epoch 0 when the server stops. Without the
                # barrier, a worker that started seconds before worker 0 on a crowded machine
                # took every batch of both epochs first, gave nothing up, and failed the test.
                gs.barrier()
                if gs.rank() == 0:
                    os.kill(pid, signal.SIGSTOP)
                    with open(os.path.join(directory, "stopped.json"), "w") as f:
                        json.dump({"wall": time.time()}, f)
    write(directory, "stopped", seen)
    with open(os.path.join(directory, f"lost-{gs.rank()}.json"), "w") as f:
        json.dump(losses, f)
    gs.barrier()  # every worker is done with the data
    if gs.rank() == 0:
        os.kill(pid, signal.SIGCONT)  # it finds its workers gone and ends


def main():
    scenario, directory = sys.argv[1], sys.argv[2]
    arg = int(sys.argv[3])
    dataset = Numbers(arg if scenario == "broken" else -1)
    workers = int(os.environ["GRADSYNC_SIZE"]) - int(os.environ["GRADSYNC_DATA_SERVERS"])
    if scenario.startswith("lose-") and 0 < int(os.environ["GRADSYNC_RANK"]) < workers:
        hold_connecting(directory, scenario[len("lose-"):])
    if os.environ.get("GS_DATA_COLLATE") == "pack":
        global receive
        receive = receive_packed
        loader = gradsync.data.Loader(Tokens(), batch_size=BATCH, seed=SEED, order=ORDER,
                                      collate=gradsync.data.Pack(8, separator=-1))
    else:
        loader = gradsync.data.Loader(dataset, batch_size=BATCH, transform=augment,
                                      seed=SEED, order=ORDER)
    seen: dict = {}
    if scenario.startswith("lose-"):
        if gs.rank() == 0:
            kill(directory, "connect", loader.peers[0].pid, range(1, gs.size()))
        lose(loader, directory, arg, seen)
        scenario = "lose"
    if scenario == "lose":
        write(directory, scenario, seen)
        gs.barrier()  # every batch of every worker has been taken, so prepared
        if gs.rank() == 0:
            with open(os.path.join(directory, "stats.json"), "w") as f:
                json.dump(loader.stats(), f)
    elif scenario in ("count", "killserver"):
        received = 0
        while loader.epoch < arg:
            for batch in loader:  # after the break below: the same epoch, where it stopped
                receive(loader, batch, seen)
                received += 1
                if scenario == "killserver" and gs.rank() == 0 and received == 5:
                    os.kill(loader.peers[0].pid, signal.SIGKILL)
                if received == 2:
                    break
        write(directory, scenario, seen)
        gs.barrier()  # every batch of every worker has been taken, so prepared
        if gs.rank() == 0:
            with open(os.path.join(directory, "stats.json"), "w") as f:
                json.dump(loader.stats(), f)
            with open(os.path.join(directory, "job"), "w") as f:  # names its segments
                f.write(os.environ["GRADSYNC_JOB_ID"])
    elif scenario == "stop":
        it = iter(loader)
        for _ in range(arg):
            receive(loader, next(it), seen)
        state = loader.state_dict()
        write(directory, "stop", seen)
        if gs.rank() == 0:
            with open(os.path.join(directory, "state.json"), "w") as f:
                json.dump(state, f)
    elif scenario == "resume":
        with open(os.path.join(directory, "state.json")) as f:
            loader.load_state_dict(json.load(f))
        while loader.epoch < arg:
            for batch in loader:
                receive(loader, batch, seen)
        write(directory, "resume", seen)
    elif scenario == "shrink":
        shrink(loader, directory, arg, seen)
    elif scenario == "stopserver":
        stopped(loader, directory, arg, seen)
    elif scenario == "holdserver":
        gil_held(loader, directory, arg, seen)
    elif scenario == "broken":
        try:
            for batch in loader:
                receive(loader, batch, seen)
            message = "no error"
        except gs.GradsyncError as exc:
            message = f"{type(exc).__name__}: {exc}"
        with open(os.path.join(directory, f"broken-{gs.rank()}.txt"), "w") as f:
            f.write(message)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    loader.close()


if __name__ == "__main__":
    main()
