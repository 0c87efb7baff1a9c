"""The server jobs of ``gradsync bench chaos``: a parameter-server job or a data-server job
whose every worker logs what it did, so that a fault on a *server* can be measured from the
workers' lines.

``gradsync bench chaos --servers S`` (or ``--data-servers D``) starts this module as the
command of ``gradsync run -np W --servers S --ps-replicas R ...`` (or ``... --data-servers D``):
the workers and the data servers run it (a data server serves inside ``Loader`` and never
reaches the training loop); the launcher starts the parameter servers as ``python -m
gradsync.ps``. ``chaos_rank.py`` is the elastic worker job's script; the lines here share its
format (``chaos_report.Log`` reads the step lines of both), every time a ``time.time()`` of one
machine.

Every rank that runs this script, before it serves or trains, and worker 0 for each parameter
server:

- ``CHAOS hello p=P host=H rank=R wall=T``: rank R started on emulated host H as pid P (a server
  started again by the launcher says hello again, with its new pid: the bench signals servers
  by these pids). A worker and a data server say it itself; a parameter server runs
  ``python -m gradsync.ps``, not this script, so worker 0 says it for each server, from the
  address record the server publishes (``ps/server/<s>``, its pid among it), and again for
  each new pid a restarted server publishes (looked at every 50 ms).

**The parameter-server job** (``--job ps``): each worker trains an MLP through
``gradsync.ps.ParameterClient`` (``--mode sync`` or ``async``, Adam on the servers) on batches
fixed by (worker, step), so a ``sync`` run's parameters after step S depend on nothing but S:
two runs with the same seeds and steps end bit for bit equal, whatever faults the servers took.

- ``CHAOS step p=P g=0 r=R n=W s=S e=0 wall=T t0=T0 v=V,V,... h=HASH i=I,...``: worker R's step
  S, its push begun at T0 and every shard's acknowledged version ``V`` (the version the push's
  reply named), the step done at T; HASH digests the model after the pull (in ``sync`` equal on
  every worker and to the fault-free run's step S; in ``async`` ``-``, since workers pull at
  different moments); I names the batch's rows (8 a step: its goodput);
- ``CHAOS view p=P shard=K epoch=E members=A,B wall=T``: worker 0's watcher (a thread looking
  at the store every 50 ms) saw shard K's view E (a view is the shard's copies; the first is
  the primary, docs/ps.md): a server dropped or joined;
- ``CHAOS psfinal p=P shard=K version=V applied=A acked=N copies=C view=M agree=0|1 digest=D``:
  worker 0, once every worker left: shard K's primary applied A gradients, the workers had N
  pushes acknowledged, C copies answered of the M in its view, and whether they hold the
  same version, counters and bits (``agree``); D is the primary's parameter digest.

The job stops when worker 0, every 10 steps, finds ``--stop-file`` (an all-reduce tells every
worker, so all run the same steps) or after ``--steps`` steps.

**The data-server job** (``--job data``): each worker takes its batches of a data set of
``--samples`` rows from ``gradsync.data.Loader`` and trains nothing (``--compute`` seconds a
batch): what matters is which samples reach which worker.

- ``CHAOS step p=P g=0 r=R n=W s=S e=E wall=T h=- i=I,...``: worker R's S-th batch, of epoch E,
  holding samples I;
- ``CHAOS dlost p=P r=R d=D wall=T``: worker R's loader gave up data server D (a thread looks
  at ``loader.lost`` every 20 ms); its share goes to the others;
- ``CHAOS epoch p=P r=R e=E wall=T``: worker R's loop over epoch E ended.

The job stops at the end of the first epoch not below the number in ``--stop-file`` (the bench
writes the next epoch, so that every worker ends with the same whole epoch).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time

__all__ = ["parser", "main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m gradsync.bench.chaos_server_rank",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=("ps", "data"), required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--mode", choices=("sync", "async"), default="sync",
                   help="the parameter servers' consistency mode")
    p.add_argument("--steps", type=int, default=0,
                   help="stop after this many steps (0: at the stop file)")
    p.add_argument("--params", type=int, default=100_000, help="model size (parameters)")
    p.add_argument("--samples", type=int, default=2048, help="rows of the data set")
    p.add_argument("--batch", type=int, default=8, help="rows per batch")
    p.add_argument("--compute", type=float, default=0.02,
                   help="seconds of emulated compute per step (a sleep: it changes no number)")
    return p


_OUT = threading.Lock()


def _emit(line: str) -> None:
    """Writes one whole line: the watcher thread and the training loop both write, and two
    ``print`` calls racing can splice their lines."""
    with _OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _say(line: str) -> None:
    _emit(f"CHAOS {line} wall={time.time():.6f}")


def _digest(tensors) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _watch(stopping: threading.Event, look, period: float) -> threading.Thread:
    """Calls ``look()`` every ``period`` seconds on a thread of its own until ``stopping``."""
    def loop():
        while not stopping.wait(period):
            look()
    thread = threading.Thread(target=loop, name="chaos-watch", daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------- parameter servers
def _ps(options, pid: int) -> None:
    import numpy as np
    import torch

    import gradsync as gs
    import gradsync.ps
    from gradsync.ps.replication import Views

    torch.manual_seed(0)
    torch.set_num_threads(1)
    width = max(8, options.params // 29)  # 24 -> width -> 4: about 29 * width parameters
    model = torch.nn.Sequential(torch.nn.Linear(24, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 4))
    # On a server rank this serves until the workers are done, then ends the process.
    ps = gradsync.ps.ParameterClient(model, optimizer="adam", lr=0.001, mode=options.mode)
    stopping, watcher = threading.Event(), None
    if ps.rank == 0:
        # Its own store connection: a look must never queue behind the client's requests.
        store = ps._store.clone_private()
        views = [Views(store, k, ps.servers, ps.replicas, 5.0) for k in range(ps.shards)]
        seen = [v.first for v in views]
        incarnations: dict[int, int] = {}  # server -> the pid whose hello was said

        def servers_hello():
            for s in range(ps.servers):
                info = json.loads(store.get(f"ps/server/{s}", 5.0))
                if incarnations.get(s) != info["pid"]:
                    incarnations[s] = info["pid"]
                    _say(f"hello p={info['pid']} host={info['host']} rank={ps.workers + s}")

        servers_hello()  # every server has published its record: the client reached it

        def look():
            try:
                servers_hello()
            except Exception:  # the store is going away with the job: nothing to see
                return
            for k, v in enumerate(views):
                try:
                    newest = v.newest(seen[k])
                except Exception:  # the store is going away with the job: nothing to see
                    return
                if newest.epoch != seen[k].epoch:
                    seen[k] = newest
                    _say(f"view p={pid} shard={k} epoch={newest.epoch} "
                         f"members={','.join(map(str, newest.members))}")
        watcher = _watch(stopping, look, 0.05)

    acked, step = 0, 0
    rows = options.batch
    while True:
        g = torch.Generator().manual_seed(1000 * step + ps.rank)
        x = torch.randn(rows, 24, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :4] * 0.5)
        loss.backward()
        time.sleep(options.compute)
        t0 = time.time()
        acked += int(ps.push())
        versions = list(ps.tags)  # the versions the push's replies named, one per shard
        ps.pull()
        ps.gflat[:] = 0
        step += 1
        h = _digest(p for p in model.parameters()) if options.mode == "sync" else "-"
        first = (step - 1) * rows * ps.workers + ps.rank * rows
        _emit(f"CHAOS step p={pid} g=0 r={ps.rank} n={ps.workers} s={step} e=0 "
              f"wall={time.time():.6f} t0={t0:.6f} v={','.join(map(str, versions))} h={h} "
              f"i={','.join(str(first + j) for j in range(rows))}")
        if options.steps and step >= options.steps:
            break
        if not options.steps and step % 10 == 0:
            flag = np.array([float(ps.rank == 0 and os.path.exists(options.stop_file))])
            if gs.allreduce(flag, op=gs.Sum)[0] > 0:
                break
    ps.leave()
    total = int(gs.allreduce(np.array([acked], np.int64), op=gs.Sum)[0])
    gs.barrier()  # every worker has left: the servers' counters are final
    if ps.rank == 0:
        stopping.set()
        watcher.join(2.0)
        _final(ps, total, pid)
    gs.barrier()
    ps.close()


def _final(ps, total: int, pid: int) -> None:
    copies = ps.replica_stats()
    for k, primary in enumerate(ps.stats()):
        shard = [st for st in copies.values() if st["lo"] == primary["lo"]]
        agree = all(st[key] == primary[key] for st in shard
                    for key in ("version", "clocks", "applied", "digest"))
        _say(f"psfinal p={pid} shard={k} version={primary['version']} "
             f"applied={primary['applied']} acked={total} copies={len(shard)} "
             f"view={len(primary['view'][1])} agree={int(agree)} digest={primary['digest']}")


# ---------------------------------------------------------------------- data servers
class _Rows:
    """The data set: row i is ``[i, i, i, i]`` (float32); only data servers index it."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import numpy as np

        return {"x": np.full(4, i, np.float32), "id": i}


def _data(options, pid: int) -> None:
    import gradsync.data
    import gradsync as gs

    # On a data-server rank this serves until the workers are done, then ends the process.
    loader = gradsync.data.Loader(_Rows(options.samples), batch_size=options.batch, seed=0)
    gs.init()
    rank, workers = gs.rank(), gs.size()
    stopping, known = threading.Event(), set()

    def look():
        try:
            lost = set(loader.lost)
        except RuntimeError:  # the fetch thread added one while we copied: look again later
            return
        for d in sorted(lost - known):
            known.add(d)
            _say(f"dlost p={pid} r={rank} d={d}")
    watcher = _watch(stopping, look, 0.02)

    step = 0
    while True:
        epoch = loader.epoch
        for batch in loader:
            time.sleep(options.compute)
            step += 1
            _emit(f"CHAOS step p={pid} g=0 r={rank} n={workers} s={step} e={epoch} "
                  f"wall={time.time():.6f} h=- i={','.join(map(str, batch['id'].tolist()))}")
        _say(f"epoch p={pid} r={rank} e={epoch}")
        if _stop_epoch(options.stop_file) <= epoch:
            break
    stopping.set()
    watcher.join(2.0)
    look()
    loader.close()


def _stop_epoch(path: str) -> float:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):  # not yet written
        return float("inf")


def main(argv=None) -> None:
    options = parser().parse_args(argv)
    pid = os.getpid()
    _say(f"hello p={pid} host={os.environ.get('GRADSYNC_HOSTNAME', '?')} "
         f"rank={os.environ.get('GRADSYNC_RANK', '?')}")
    (_ps if options.job == "ps" else _data)(options, pid)


if __name__ == "__main__":
    main()
