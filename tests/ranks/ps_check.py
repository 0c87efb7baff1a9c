"""Parameter-server checks, one scenario per run: ``ps_check.py SCENARIO [ARGS]``.

The workers run this script; under gradsync run a server runs ``python -m gradsync.ps``, under
``harness.spawn`` (torchrun's way) it runs this script too and serves inside
``ParameterClient`` (``gs.init``), then exits. Workers train a small MLP on closed-form batches (``batch(worker, step)``), so a
reference model trained locally on the same batches is what the servers must hold.

    parity OPT [STEPS]     sync mode vs a local torch optimizer over every worker's batch;
                           the last worker is slow; then sync's guarantee from the counters
    factor                 parity with Project Adam's factored Linear gradients; less traffic
    mode MODE STEPS        the last worker is slow; each mode's guarantee from the counters
    kill MODE              worker 2 dies at step 3; the others finish (async, backup) or
                           raise PeerLostError naming it (sync)
    killserver             worker 0 kills server 0; every worker raises PeerLostError
    save DIR / restore DIR a checkpoint at step 3 restores the same parameters and continues
                           to the same step-5 parameters; save is also a parity run (Adam)
    bf16                   a bf16 model trains on float32 master weights
    mismatch               worker 1 builds another model
"""

import common  # noqa: F401  (deadline)
from checks import Checks

import os
import signal
import sys
import time

import numpy as np
import torch

import gradsync as gs
import gradsync.ps
from gradsync.errors import CollectiveMismatchError, PeerLostError


def model(hidden: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 4))


def batch(worker: int, step: int, rows: int = 8):
    g = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(rows, 24, generator=g)
    return x, x[:, :4] * 0.5


def loss(m, worker, step):
    x, y = batch(worker, step)
    return torch.nn.functional.mse_loss(m(x), y)


def train_step(m, ps, worker, step):
    loss(m, worker, step).backward()
    return ps.step()


def max_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


fail = Checks(os.environ.get("GRADSYNC_RANK"), label="FAIL worker").fail


HYPER = {"sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
         "adam": {"lr": 0.01, "weight_decay": 1e-3}}


class Local:
    """The reference: the same model trained in this process by torch.optim on every
    worker's batch of each step, averaged as sync mode averages them."""

    def __init__(self, optimizer: str, width: int, workers: int):
        self.optimizer, self.workers, self.model = optimizer, workers, model(width)
        self.opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer](
            self.model.parameters(), **HYPER[optimizer])

    def step(self, m, step: int) -> float:
        """One step of the reference; fails unless ``m`` (after its server step) equals it."""
        self.opt.zero_grad()
        for w in range(self.workers):
            (loss(self.model, w, step) / self.workers).backward()
        self.opt.step()
        diff = max_diff(m, self.model)
        if diff > 2e-5:
            fail(f"step {step}: parameters differ from the local {self.optimizer} by {diff:.3g}")
        return diff


def slow_worker(ps) -> bool:
    """Whether this is the last of several workers, which sleeps 0.08 s a step: sync rounds
    must wait for the slowest worker (sync_counters checks that they did)."""
    return ps.rank == ps.workers - 1 and ps.workers > 1


def parity(optimizer: str, steps: int, factor: bool = False) -> None:
    width = 256 if factor else 32
    m = model(width)
    ps = gradsync.ps.ParameterClient(m, optimizer=optimizer, mode="sync",
                                     factor_fc=8 if factor else None, **HYPER[optimizer])
    ref = Local(optimizer, width, ps.workers)
    dense = 0
    for step in range(steps):
        if slow_worker(ps):
            time.sleep(0.08)
        train_step(m, ps, ps.rank, step)
        diff = ref.step(m, step)
        dense += sum(p.numel() for p in m.parameters()) * 4
    print(f"worker {ps.rank}: {steps} steps match {optimizer} (max diff {diff:.2g}); "
          f"pushed {ps.bytes_pushed} bytes, dense {dense}, ratio {dense / ps.bytes_pushed:.2f}")
    if factor and not dense > 1.5 * ps.bytes_pushed:
        fail(f"factored push sent {ps.bytes_pushed} bytes, dense would be {dense}")
    sync_counters(ps, steps)
    ps.close()


def sync_counters(ps, steps: int) -> None:
    """Sync mode's guarantee from every server's counters, once every worker has left: each
    round applied every worker's gradient (the slow last one's too), none dropped, none stale.
    The parity runs check it, so that no job of its own is needed for it."""
    ps.leave()
    gs.barrier()  # every worker has left: the counters are final
    if ps.rank != 0:
        return
    for st in ps.stats():
        checks = [st["applied"] == ps.workers * steps, st["version"] == steps,
                  st["dropped"] == 0, st["max_staleness"] == 0]
        if not all(checks):
            fail(f"sync counters break the mode's guarantee: {st} ({checks})")
    print("sync: counters hold")


def modes(mode: str, steps: int) -> None:
    m = model()
    ps = gradsync.ps.ParameterClient(m, optimizer="sgd", lr=0.05, mode=mode,
                                     backup=2, staleness=1)
    slow = ps.rank == ps.workers - 1
    # Every worker has its first parameters (and its first gradient's tag) before any trains:
    # on a loaded machine a worker that got them late found the others' rounds done but the
    # last, which its backup-mode wait below then waited for in vain (seen with tests on
    # three pytest workers, tests/parallel.py).
    gs.barrier()
    if slow and mode in ("async", "ssp") and ps.workers > 1:
        # The slow worker's first gradient must be computed on parameters that the others
        # update before it arrives (staleness >= 1). Sleeping alone does not promise that on a
        # loaded machine, where the fast workers may not have started yet: wait for a push.
        end = time.monotonic() + 30
        while min(st["version"] for st in ps.stats()) < 1:
            if time.monotonic() > end:
                fail("no other worker pushed within 30 s")
            time.sleep(0.01)
    for step in range(steps):
        if slow:
            time.sleep(0.08)
        if slow and step == 0 and mode == "backup" and ps.workers > 2:
            # Backup's guarantee shows in a gradient dropped for coming after its round
            # closed. The sleep does not promise one on a loaded machine, where the other
            # workers may be as slow (a busy run: 48 applied, 0 dropped): wait until the
            # others closed the round this worker's first gradient is tagged with.
            end = time.monotonic() + 30
            while not all(st["version"] > tag for st, tag in zip(ps.stats(), ps.tags)):
                if time.monotonic() > end:
                    fail("the other workers closed no round within 30 s")
                time.sleep(0.01)
        train_step(m, ps, ps.rank, step)
    ps.leave()
    gs.barrier()  # every worker has left: the counters are final
    if ps.rank == 0:
        total = ps.workers * steps
        for st in ps.stats():
            print(f"server {st['server']}: {st}")
            checks = {
                "sync": [st["applied"] == total, st["version"] == steps, st["dropped"] == 0,
                         st["max_staleness"] == 0],
                "backup": [st["applied"] + st["dropped"] == total, st["dropped"] >= 1,
                           st["max_staleness"] == 0],
                "async": [st["applied"] == total, st["version"] == total,
                          st["max_staleness"] >= 1],
                "ssp": [st["applied"] == total, 1 <= st["max_clock_gap"] <= 1,
                        st["max_staleness"] >= 1],
            }[mode]
            if not all(checks):
                fail(f"{mode} counters break the mode's guarantee: {st} ({checks})")
        print(f"{mode}: counters hold")
    ps.close()


def kill(mode: str) -> None:
    m = model()
    ps = gradsync.ps.ParameterClient(m, optimizer="sgd", lr=0.05, mode=mode, backup=2)
    # Worker 0 trains on until its server has counted worker 2 as lost. Stopping after its 10
    # steps to wait for that could wait for ever in backup mode: on a loaded machine worker 2
    # may start only once the others have finished, and its pushes then need a partner.
    step, end = 0, time.monotonic() + 30
    try:
        while step < 10 or (ps.rank == 0 and ps.stats()[0]["lost"] != [2]
                            and time.monotonic() < end):
            if ps.rank == 2 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            train_step(m, ps, ps.rank, step)
            step += 1
    except PeerLostError as exc:
        print(f"worker {ps.rank}: PeerLostError peer={exc.peer}: {exc}")
        # Disconnects now, so that the server ends: in a shared job (tests/service_jobs.py)
        # this process goes on to the next scenario, and no exit closes its connections.
        ps.close()
        sys.exit(3)
    if ps.rank == 0:
        print(f"worker 0 trained its 10 steps and {step - 10} more; server counters "
              f"{ps.stats()}")
    ps.close()


def killserver() -> None:
    m = model()
    ps = gradsync.ps.ParameterClient(m, optimizer="sgd", lr=0.05, mode="sync")
    try:
        for step in range(50):
            if ps.rank == 0 and step == 3:
                os.kill(ps.peers[0].pid, signal.SIGKILL)
            train_step(m, ps, ps.rank, step)
    except PeerLostError as exc:
        print(f"worker {ps.rank}: PeerLostError peer={exc.peer}: {exc}")
        sys.exit(3)
    fail("trained 50 steps although the server was killed")


def checkpoint(action: str, directory: str) -> None:
    """The save run is a parity run too (Adam, every step against ``Local``, the last worker
    slow, then sync's counters): test_ps.py runs it with 2 workers on 3 servers over TCP, so
    that no parity job of its own is needed for that case."""
    m = model()
    ps = gradsync.ps.ParameterClient(m, optimizer="adam", mode="sync",
                                     restore=directory if action == "restore" else None,
                                     **HYPER["adam"])
    flat = lambda: np.concatenate([p.detach().numpy().ravel() for p in m.parameters()])  # noqa
    ref = Local("adam", 32, ps.workers) if action == "save" else None
    start = 0

    def step_(step):
        if ref is not None and slow_worker(ps):
            time.sleep(0.08)
        train_step(m, ps, ps.rank, step)
        return ref.step(m, step) if ref is not None else None

    if action == "save":
        for step in range(3):
            step_(step)
        if ps.rank == 0:
            ps.save(directory)
            np.save(os.path.join(directory, "p3.npy"), flat())
        gs.barrier()
        start = 3
    else:
        if not np.array_equal(flat(), np.load(os.path.join(directory, "p3.npy"))):
            fail("restored parameters differ from the saved ones")
        if ps.tags != [3] * ps.servers:
            fail(f"restored version {ps.tags}, expected 3")
    for step in range(3, 5):
        diff = step_(step)
    if ref is not None:
        print(f"worker {ps.rank}: 5 steps match adam (max diff {diff:.2g})")
    if ps.rank == 0:
        path = os.path.join(directory, "p5.npy")
        if action == "save":
            np.save(path, flat())
        elif not np.array_equal(flat(), np.load(path)):
            fail(f"after restore, step 5 differs from the original run by "
                 f"{np.abs(flat() - np.load(path)).max():.3g}")
        print(f"{action}: ok (start {start})")
    if ref is not None:
        sync_counters(ps, 5)
    ps.close()


def bf16() -> None:
    """A bf16 model: the servers keep float32 master weights; the model holds their bf16
    rounding after every pull, and training moves it."""
    m = model().to(torch.bfloat16)
    ps = gradsync.ps.ParameterClient(m, optimizer="sgd", lr=0.1, mode="sync")
    before = [p.detach().clone() for p in m.parameters()]
    for step in range(3):
        x, y = batch(ps.rank, step)
        torch.nn.functional.mse_loss(m(x.bfloat16()).float(), y).backward()
        ps.step()
        for (p, pv, _, aliased) in ps._views:
            if aliased or p.dtype != torch.bfloat16 or not torch.equal(p, pv.to(torch.bfloat16)):
                fail("a bf16 parameter is not the bf16 rounding of the float32 master")
    if all(torch.equal(a, p) for a, p in zip(before, m.parameters())):
        fail("bf16 training did not change the parameters")
    print(f"worker {ps.rank}: bf16 ok")
    ps.close()


def mismatch() -> None:
    m = model(32 if int(os.environ.get("RANK", os.environ.get("GRADSYNC_RANK"))) == 0 else 33)
    try:
        gradsync.ps.ParameterClient(m, optimizer="sgd", lr=0.1)
    except (CollectiveMismatchError, PeerLostError) as exc:
        print(f"{type(exc).__name__}: {exc}")
        sys.exit(3)
    fail("different models were accepted")


if __name__ == "__main__":
    scenario, args = sys.argv[1], sys.argv[2:]
    if scenario == "parity":
        parity(args[0], int(args[1]) if len(args) > 1 else 4)
    elif scenario == "factor":
        parity("sgd", 3, factor=True)
    elif scenario == "mode":
        modes(args[0], int(args[1]))
    elif scenario == "kill":
        kill(args[0])
    elif scenario == "killserver":
        killserver()
    elif scenario in ("save", "restore"):
        checkpoint(scenario, args[0])
    elif scenario == "bf16":
        bf16()
    elif scenario == "mismatch":
        mismatch()
    else:
        raise SystemExit(f"unknown scenario {scenario}")
