"""Data servers against each worker's own torch ``DataLoader``, in the same job.

    gradsync bench data -np W [--data-servers D] [--data-workers K] [--cost-ms 2]
        [--samples 512] [--batch-size 32] [--shape 3,32,32] [--repeats 5] [--borrow]
        [--step-ms 0] [--server-cpus LIST] [--emulate none|netns] [--profile DIR]

Every rank runs this module (``drive`` starts the job with ``--data-servers D``, or, with
``--emulate netns``, on emulated hosts: the W workers on host ``w``, each data server on a
host of its own, ``netns.py``). The data are synthetic: sample ``i`` is an array of ``--shape``
float32 values all equal to ``i % 251`` and the label ``i``; ``dataset[i]`` costs
``--decode-ms`` of CPU (the decode, which the data servers cache), and the transform costs
``--cost-ms`` of CPU per sample every epoch (CPU time of the calling thread, spun: a stated
cost that a loaded machine stretches in wall time but does not shrink). Three measurements:

1. **Data servers.** Epoch 0 is the warm-up (it fills the cache); epochs 1..R are timed, each
   started after a barrier: an epoch's time is the slowest worker's, its throughput the
   epoch's samples over that time. Every epoch is verified: each worker checks each batch's
   labels against the ids the ``Loader`` says it holds and its values against the labels, and
   the workers' ids together must be every sample exactly once (``#wrong`` counts the
   samples missing, repeated or wrong).
2. **Transport.** One more epoch, in which the training loop first waits while the data
   servers fill the pipeline (the Loader's queue and every slot: ``2 * prefetch + 1`` batches'
   preparation), then sleeps per batch about as long as the data servers take to prepare one
   for every worker (``W * batch * cost / D``, and half as much again), so that each batch is
   ready when it is asked for; in each sleep it times a *memory copy* of a batch's bytes
   into a fresh buffer
   (``numpy.empty`` + ``copyto``: what a worker that loaded its own batch would still pay to
   put it in a buffer of its own), from a source not in this core's caches (one of a pool of
   at least 8 MiB, in turn), as a slot was last written by the data server's core. A batch's
   *transport* cost is how it was asked for plus the read of its bytes into the worker's
   fresh buffer (``Loader.transfers()``). Asking is, from a server on the same host, the poll
   of the stream's slot table (from the first look until the header is seen, less the time
   the batch was still being prepared: the naps of the back-off after it was published are
   counted), else the ``take`` call (the control round trip, less the time the server waited
   for the batch to be prepared: the server says how long; a batch that came on the reply
   of an earlier take is asked for in no time). Ratio = transport / copy, medians over the
   epoch's batches. Between hosts the header line ``# takes:`` says how many takes the data
   servers answered in the whole run and how many batches their replies brought.
3. **DataLoader.** Each worker's own ``torch.utils.data.DataLoader`` over the same dataset and
   transform, with a ``DistributedSampler`` (its share, shuffled) and ``num_workers`` =
   ``max(1, round(D * K / W))``, so that the loading processes number the data servers'
   producers (``--data-workers K``: the same total cores when W divides D * K; the header says
   when not); persistent workers, one warm-up
   epoch, then R timed epochs as in 1. Its epochs alternate with the data servers' (one of
   each, in turn), so that both feeds see the same load on a shared machine; the ratio is
   printed of the medians and epoch by epoch.

**Cores the workers do not have** (Project Adam's point: the data are prepared off the
training machines). ``--step-ms S`` spins S ms of the training loop's CPU per batch in every
timed epoch of both feeds (the training step the worker's cores also run), and
``--server-cpus LIST`` pins the data-server ranks (and the producers they start) to those
CPUs and the workers (and the ``DataLoader``'s loading processes they start) to the others:
a worker's own ``DataLoader`` then shares the worker's cores with its training step, where the
data servers use cores of their own, as two kinds of machine would. Without them both feeds
share every core, and only the feeds differ.

The data servers' batches are copied into buffers of their own, as the ``Loader`` does by
default and as a ``DataLoader``'s batches are the caller's to keep; ``--borrow`` measures
``Loader(copy=False)`` instead (the tensors view the slot until the next batch is taken).
``--profile DIR``: every rank writes a cProfile of each of its threads' work to
``DIR/rank<R>.prof`` (the producers and serving threads of a data server, the training loop
of a worker), for ``python -m pstats``; the per-batch breakdown in docs/data.md comes from it.
Its times are each thread's CPU seconds (``time.thread_time``), not wall time: a thread's
waits (for a lock, the GIL, a reply) and a loaded machine's stretch do not count, so that
profiles taken on a shared machine compare; the profiler's own cost per call inflates
functions called often, whose call counts are exact.

Medians over the R epochs (and over the transport epoch's batches) are printed, with the
spread (lowest and highest); ``--json FILE`` writes the row. The data servers are idle while
the DataLoader runs (no epoch of theirs is started), and the DataLoader's processes while the
data servers run (their sampler has handed out nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from .allreduce import at_least

__all__ = ["parser", "drive", "run", "Synthetic", "Costly", "spin"]

_POOL = 8 << 20  # bytes of the memory copy's sources (see _transport)
_FILL = 251  # sample i holds i % 251: exact in float32, and varied enough to catch a mix-up


def spin(seconds: float) -> None:
    """Uses ``seconds`` of this thread's CPU time (a stated cost, whatever the load)."""
    if seconds <= 0:
        return
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Synthetic:
    """Sample ``i``: (``shape`` float32 values equal to ``i % 251``, label ``i``); each
    ``dataset[i]`` costs ``decode_s`` of CPU (the decode, which a data server caches)."""

    def __init__(self, samples: int, shape: tuple[int, ...], decode_s: float = 0.0):
        self.samples, self.shape, self.decode_s = samples, tuple(shape), decode_s

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int):
        spin(self.decode_s)
        return np.full(self.shape, i % _FILL, dtype=np.float32), i


class Costly:
    """A transform of ``cost_s`` CPU seconds per sample that returns the sample as it was
    (its values are checked on the workers)."""

    def __init__(self, cost_s: float):
        self.cost_s = cost_s

    def __call__(self, sample, rng):
        spin(self.cost_s)
        return sample


class _Transformed:
    """The dataset as a worker's own ``DataLoader`` sees it: decoded and transformed in its
    loading processes, every epoch (a torch map-style dataset needs only these two)."""

    def __init__(self, dataset: Synthetic, transform: Costly, seed: int):
        self.dataset, self.transform, self.seed = dataset, transform, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.transform(self.dataset[i], np.random.default_rng([self.seed, i]))


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: dimensions separated by commas, "
                                         "as 3,32,32") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: every dimension must be >= 1")
    return dims


def _cpus(text: str) -> set[int]:
    """A CPU list as ``taskset`` reads one: ``1``, ``0,2`` or ``2-3,5``."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, dash, last = part.partition("-")
            cpus.update(range(int(first), int(last if dash else first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--server-cpus {text!r}: CPUs as 1, 0,2 or "
                                         "2-3,5") from None
    here = os.sched_getaffinity(0)
    if not cpus or not cpus < here:
        raise argparse.ArgumentTypeError(
            f"--server-cpus {text!r}: must name some, not all, of this process's CPUs "
            f"{sorted(here)}: the workers need the others")
    return cpus


def _pin(server_cpus: set[int] | None) -> None:
    """Pins this rank (and every process it starts from now on) to the data servers' CPUs or
    to the others (``--server-cpus``)."""
    if server_cpus is None:
        return
    from ..cluster.launch_env import detect

    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, server_cpus if detect(data_server=True).is_data_server
                         else mine - server_cpus)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync bench data")
    p.add_argument("--data-servers", type=at_least(1), default=1, metavar="D",
                   help="data-server ranks beside the -np workers (default 1)")
    p.add_argument("--data-workers", type=at_least(1), default=1, metavar="K",
                   help="producer processes per data server (default 1); the DataLoader gets "
                        "as many loading processes in all")
    p.add_argument("--borrow", action="store_true",
                   help="Loader(copy=False): the tensors view the slot until the next batch "
                        "(default: each batch copied into a buffer of its own, the Loader's "
                        "default)")
    p.add_argument("--profile", metavar="DIR",
                   help="write each rank's cProfile (all its threads) to DIR/rank<R>.prof")
    p.add_argument("--cost-ms", type=at_least(0.0, float), default=2.0,
                   help="CPU milliseconds the transform spends per sample (default 2)")
    p.add_argument("--decode-ms", type=at_least(0.0, float), default=0.0,
                   help="CPU milliseconds of dataset[i], cached by the data servers (default 0)")
    p.add_argument("--samples", type=at_least(1), default=512, help="dataset size (512)")
    p.add_argument("--batch-size", type=at_least(1), default=32, help="samples per batch (32)")
    p.add_argument("--shape", type=_shape, default=(3, 32, 32),
                   help="each sample's float32 shape (3,32,32)")
    p.add_argument("--repeats", type=at_least(1), default=5,
                   help="timed epochs of each feed (5)")
    p.add_argument("--prefetch", type=at_least(1), default=None,
                   help="the Loader's prefetch (default the data_prefetch setting)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-ms", type=at_least(0.0, float), default=0.0,
                   help="CPU milliseconds of the training step per batch, spun by the worker "
                        "in every timed epoch of both feeds (default 0)")
    p.add_argument("--server-cpus", type=_cpus, default=None, metavar="LIST",
                   help="pin the data servers to these CPUs (as 1 or 2-3,5) and the workers "
                        "and their DataLoaders to the others: cores the workers do not have")
    p.add_argument("--emulate", choices=("none", "netns"), default="none",
                   help="netns: workers on one emulated host, each data server on its own "
                        "(needs root)")
    p.add_argument("--timeout", type=at_least(1.0, float), default=600.0,
                   help="seconds before an emulated run's ranks are stopped (600)")
    p.add_argument("--json", help="write the row to this file")
    p.add_argument("--result", help=argparse.SUPPRESS)  # where rank 0 leaves the rows for drive
    return p


# ---------------------------------------------------------------------- starting the job
def drive(run_cmd: list[str], options, rest: list[str], workers: int, servers=None) -> int:
    """Starts the job through ``gradsync run`` (``run_cmd``, as ``bench/cli.py`` built it) or
    on emulated hosts, then prints the table that rank 0 left; returns the job's status."""
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-data-") as tmp:
        result = os.path.join(tmp, "rows.json")
        module = [sys.executable, "-m", __name__, *rest, "--result", result]
        if options.emulate == "none":
            status = subprocess.call([*run_cmd, "--data-servers", str(options.data_servers),
                                      "--data-workers", str(options.data_workers), *module])
        else:
            status = _emulated(options, module, workers)
        if status != 0 or not os.path.exists(result):
            return status or 1
        with open(result) as f:
            rows = json.load(f)
    _print(rows)
    if options.json:
        with open(options.json, "w") as f:
            json.dump(rows[0] | {"per_worker_transfer": [r["transfer"] for r in rows],
                                 "per_worker_cpus": [r["cpus"] for r in rows]}, f, indent=1)
    return 0


def _emulated(options, module: list[str], workers: int) -> int:
    from ..testbed import netns

    why = netns.unavailable_reason()
    if why is not None:
        print(f"gradsync bench data: --emulate netns needs network namespaces: {why}",
              file=sys.stderr)
        return 2
    hosts = [("w", workers)] + [(f"d{d}", 1) for d in range(options.data_servers)]
    lock = threading.Lock()

    def echo(slot, line: str) -> None:
        with lock:
            sys.stdout.write(f"[{slot.rank}]<{slot.host.name}>: {line}")
            sys.stdout.flush()

    try:
        with netns.Cluster(hosts) as cluster:
            results = netns.run(cluster, module, timeout=options.timeout, on_line=echo,
                                env={"GRADSYNC_DATA_SERVERS": str(options.data_servers),
                                     "GRADSYNC_DATA_WORKERS": str(options.data_workers)},
                                stop_on_failure=True)
    except netns.NetnsError as exc:
        print(f"gradsync bench data: {exc}", file=sys.stderr)
        return 1
    failed = [r for r in results if r.returncode != 0]
    for r in failed:
        print(f"gradsync bench data: {r}", file=sys.stderr)
    return 1 if failed else 0


# ---------------------------------------------------------------------- the ranks
def run(args) -> dict | None:
    """One rank's part (a data server never returns from the ``Loader``); returns the row on
    rank 0."""
    import torch

    import gradsync
    import gradsync.data

    torch.set_num_threads(1)
    _pin(args.server_cpus)
    if args.profile:
        _profile(args.profile)
    dataset = Synthetic(args.samples, args.shape, args.decode_ms / 1e3)
    transform = Costly(args.cost_ms / 1e3)
    loader = gradsync.data.Loader(dataset, args.batch_size, transform=transform,
                                  seed=args.seed, prefetch=args.prefetch,
                                  copy=not args.borrow)
    rank, workers, servers = gradsync.rank(), gradsync.size(), loader.servers
    threads = max(1, round(servers * args.data_workers / workers))
    own = _Own(dataset, transform, args, rank, workers, threads)
    epochs, wrong = [], 0
    # The two feeds' epochs alternate, so that both see the same load on a shared machine;
    # epoch 0 of each is its warm-up (the cache fills, the loading processes start).
    for epoch in range(args.repeats + 1):
        seconds, ids, bad = _epoch(iter(loader), loader, step=args.step_ms / 1e3)
        wrong += _exactly_once(ids, bad, args.samples)
        own.epoch(epoch)
        if epoch > 0:
            epochs.append(args.samples / seconds)
    copy_s, taken, transport_wrong = _transport(loader, args, workers, servers)
    wrong += transport_wrong
    transfers = loader.transfers()[-taken:]
    # Each server's slots: mapped here (the same host) or read over its TCP connection; a
    # batch asked for by polling the slot table or by a take call.
    road = "/".join(sorted({"shm" if slots.direct is not None else "tcp"
                            for slots in loader.slots}))
    ask = "/".join(sorted({"poll" if p is not None else "take" for p in loader.pollers}))
    # The takes the data servers answered (every worker's, the whole run: after the barrier
    # every worker's last epoch is over) and the batches their replies brought: between
    # hosts, how many batches one request carries.
    gradsync.barrier()
    counters = loader.stats()
    loader.close()
    own.close()
    row = {"workers": workers, "data_servers": servers, "loader_workers": threads,
           "data_workers": args.data_workers, "copy": not args.borrow,
           "cost_ms": args.cost_ms, "decode_ms": args.decode_ms, "step_ms": args.step_ms,
           "server_cpus": None if args.server_cpus is None else sorted(args.server_cpus),
           "cpus": sorted(os.sched_getaffinity(0)),  # this worker's (``_pin``)
           "samples": args.samples,
           "batch_size": args.batch_size, "shape": list(args.shape),
           "transport": _transport_name(), "repeats": args.repeats, "wrong": wrong,
           "servers_samples_s": _summary(epochs), "dataloader_samples_s": _summary(own.rates),
           "dataloader_wrong": own.wrong,
           "takes": sum(c["takes"] for c in counters),
           "sent": sum(c["sent"] for c in counters),
           # each timed epoch of the data servers over the DataLoader's epoch after it
           "pair_ratios": [a / b for a, b in zip(epochs, own.rates)]}
    row["throughput_ratio"] = (row["servers_samples_s"]["median"]
                               / row["dataloader_samples_s"]["median"])
    # Asking (a poll, or a take's round trip) is its time less the batch's preparation.
    asked = [t - w for t, w, _, _ in transfers]
    read = [r for _, _, r, _ in transfers]
    total = [t + r for t, r in zip(asked, read)]
    row["transfer"] = {"road": road, "ask": ask,
                       # batches that were still being prepared when asked for
                       "late": sum(1 for _, w, _, _ in transfers if w > 0),
                       "bytes": int(statistics.median(n for _, _, _, n in transfers)),
                       "batches": len(transfers),
                       "ask_us": _summary(asked, 1e6), "read_us": _summary(read, 1e6),
                       "total_us": _summary(total, 1e6), "copy_us": _summary(copy_s, 1e6),
                       "waited_us": _summary([w for _, w, _, _ in transfers], 1e6)}
    copy_us = row["transfer"]["copy_us"]["median"]
    row["transfer"]["ratio"] = row["transfer"]["total_us"]["median"] / copy_us
    row["transfer"]["read_ratio"] = row["transfer"]["read_us"]["median"] / copy_us
    rows = gradsync.allgather_object(row, name="bench.data.rows")
    if rank != 0:
        return None
    if args.result:
        with open(args.result, "w") as f:
            json.dump(rows, f)
    else:  # started without drive
        _print(rows)
    return rows[0]


def _profile(directory: str) -> None:
    """Profiles every thread this process runs from now on (and this one), each with a
    ``cProfile.Profile`` of its own; writes them, merged, to ``directory/rank<R>.prof`` when
    the process exits (a data server's too: it exits inside the ``Loader``)."""
    import atexit
    import cProfile
    import pstats

    os.makedirs(directory, exist_ok=True)
    profiles, lock = [], threading.Lock()
    run = threading.Thread.run

    def profiled(thread):
        profile = cProfile.Profile(time.thread_time)
        with lock:
            profiles.append(profile)
        profile.enable()
        try:
            run(thread)
        finally:
            profile.disable()

    threading.Thread.run = profiled
    main = cProfile.Profile(time.thread_time)
    profiles.append(main)
    main.enable()

    def write() -> None:
        main.disable()
        with lock:
            done = list(profiles)
        stats = None
        for profile in done:
            try:
                stats = pstats.Stats(profile) if stats is None else stats.add(profile)
            except TypeError:  # a thread still running (a daemon): its profile is not ready
                continue
        if stats is not None:
            # GRADSYNC_RANK from ``gradsync run``, RANK from an emulated run's torchrun-style
            # variables (``testbed/netns.py``).
            rank = os.environ.get("GRADSYNC_RANK", os.environ.get("RANK", "0"))
            stats.dump_stats(os.path.join(directory, f"rank{rank}.prof"))

    atexit.register(write)


def _transport_name() -> str:
    from gradsync import job

    return job.world().config.transport


def _epoch(batches, loader=None, pause: float = 0.0, on_pause=None, lead: float = 0.0,
           step: float = 0.0):
    """Iterates one epoch of ``batches`` after a barrier (and ``lead`` seconds more), spinning
    ``step`` seconds of CPU per batch (the training step); returns the slowest worker's
    seconds, this worker's ids and its wrong samples."""
    import gradsync

    gradsync.barrier()
    time.sleep(lead)
    start = time.perf_counter()
    ids, bad = [], 0
    for x, y in batches:
        labels = y.numpy()
        if loader is not None and not np.array_equal(labels, loader.ids):
            bad += len(labels)  # the Loader says it delivered other samples than it did
        values = x.reshape(len(labels), -1)
        bad += int((values != _column(labels)).any(1).sum())
        ids.append(labels.copy())
        spin(step)
        if pause:
            time.sleep(pause)
            if on_pause is not None:
                on_pause()
    mine = time.perf_counter() - start
    slowest = max(gradsync.allgather_object(mine, name="bench.data.epoch"))
    return slowest, (np.concatenate(ids) if ids else np.zeros(0, np.int64)), bad


def _column(labels: np.ndarray):
    """The value every element of sample ``i`` holds, as a column to compare rows with."""
    import torch

    return torch.from_numpy((labels % _FILL).astype(np.float32)).reshape(-1, 1)


def _exactly_once(ids: np.ndarray, bad: int, samples: int) -> int:
    """The samples missing, repeated or wrong in an epoch, summed over the workers."""
    import gradsync

    views = gradsync.allgather_object((ids.tolist(), bad), name="bench.data.ids")
    counts = np.bincount(np.concatenate([np.asarray(v, np.int64) for v, _ in views]),
                         minlength=samples)
    return int(np.abs(counts[:samples] - 1).sum() + counts[samples:].sum()
               + sum(b for _, b in views))


def _transport(loader, args, workers: int, servers: int) -> tuple[list[float], int, int]:
    """The transport epoch: returns the memory copies' seconds, how many batches came and
    the samples missing, repeated or wrong."""
    copies: list[float] = []
    # The servers' pace is servers / (batch * cost) batches a second for all the workers: a
    # loop half as fast again keeps every stream's slots full, so no take waits.
    per_batch = workers * args.batch_size * (args.cost_ms + args.decode_ms) / 1e3 / servers
    pause = 1.5 * per_batch + 0.005
    # The queue (prefetch), the batch the fetch thread holds and every slot (prefetch) full
    # before the first batch: from then on the servers stay ahead of the loop.
    lead = (2 * loader.prefetch + 1) * per_batch + 0.05

    sources: list[np.ndarray] = []

    def copy() -> None:
        nbytes = loader.transfers()[-1][3]  # the latest batch's (a short one is copied short)
        if not sources or sources[0].nbytes != nbytes:
            # A slot was last written by the server's core: copy from a source this core has
            # not touched lately either, one of a pool of at least 8 MiB (4 times a core's L2
            # here), in turn.
            sources[:] = [np.ones(nbytes, np.uint8) for _ in range(max(2, -(-_POOL // nbytes)))]
        sources.append(sources.pop(0))
        source = sources[0]
        start = time.perf_counter()
        target = np.empty(nbytes, dtype=np.uint8)  # fresh, as each batch's buffer is
        np.copyto(target, source)
        copies.append(time.perf_counter() - start)

    before = len(loader.transfers())
    _, ids, bad = _epoch(iter(loader), loader, pause, copy, lead)
    return copies, len(loader.transfers()) - before, _exactly_once(ids, bad, args.samples)


class _Own:
    """Each worker's own DataLoader over the same data, one epoch at a time."""

    def __init__(self, dataset: Synthetic, transform: Costly, args, rank: int, workers: int,
                 threads: int):
        from torch.utils.data import DataLoader, DistributedSampler

        self.samples = args.samples
        data = _Transformed(dataset, transform, args.seed)
        self.sampler = DistributedSampler(data, num_replicas=workers, rank=rank, shuffle=True,
                                          seed=args.seed, drop_last=False)
        self.loader = DataLoader(data, batch_size=args.batch_size, sampler=self.sampler,
                                 num_workers=threads, persistent_workers=True)
        self.step = args.step_ms / 1e3
        self.rates: list[float] = []  # samples/s of the timed epochs
        self.wrong = 0

    def epoch(self, epoch: int) -> None:
        """Runs epoch ``epoch``; times it unless it is epoch 0 (the warm-up)."""
        import gradsync

        self.sampler.set_epoch(epoch)
        seconds, ids, bad = _epoch(self.loader, step=self.step)
        # The sampler pads the last share with repeated samples (drop_last=False): count
        # the samples served, and check only that none is missing or wrong.
        views = gradsync.allgather_object((ids.tolist(), bad), name="bench.data.own")
        served = np.concatenate([np.asarray(v, np.int64) for v, _ in views])
        self.wrong += int(self.samples - len(np.unique(served)) + sum(b for _, b in views))
        if epoch > 0:
            self.rates.append(len(served) / seconds)

    def close(self) -> None:
        """Stops the loading processes before the job ends."""
        del self.loader


def _summary(values: list[float], scale: float = 1.0) -> dict:
    return {"median": statistics.median(values) * scale, "low": min(values) * scale,
            "high": max(values) * scale}


def _print(rows: list[dict]) -> None:
    row = rows[0]
    w, d, k = row["workers"], row["data_servers"], row["loader_workers"]
    p = row.get("data_workers", 1)
    same = "same cores" if w * k == d * p else f"NOT the same cores: {d} data servers of " \
                                               f"{p} producer(s), {w * k} loading processes"
    fed = "copied" if row.get("copy") else "borrowed"
    if row.get("server_cpus"):
        same = f"data servers pinned to CPUs {row['server_cpus']}, the workers and their " \
               "DataLoaders to the others"
    print(f"# data servers against each worker's own DataLoader, in the same job: {w} "
          f"worker(s), {d} data server(s), DataLoader num_workers={k} ({same}); "
          f"{p} producer(s) per data server, batches {fed}; transform "
          f"{row['cost_ms']:g} ms CPU/sample, decode {row['decode_ms']:g} ms, training step "
          f"{row.get('step_ms', 0):g} ms CPU/batch; "
          f"{row['samples']} samples of float32 {tuple(row['shape'])}, batch "
          f"{row['batch_size']}; median (lowest-highest) of {row['repeats']} epochs; "
          f"GRADSYNC_TRANSPORT={row['transport']}", flush=True)
    s, o = row["servers_samples_s"], row["dataloader_samples_s"]
    print(f"{'feed':>14} {'samples/s':>10} {'lowest':>9} {'highest':>9} {'#wrong':>6}")
    print(f"{'data servers':>14} {s['median']:>10.0f} {s['low']:>9.0f} {s['high']:>9.0f} "
          f"{row['wrong']:>6}")
    print(f"{'DataLoader':>14} {o['median']:>10.0f} {o['low']:>9.0f} {o['high']:>9.0f} "
          f"{row['dataloader_wrong']:>6}")
    pairs = row["pair_ratios"]
    print(f"# throughput ratio (data servers / DataLoader): {row['throughput_ratio']:.2f} "
          f"of the medians; epoch by epoch (each feed's epochs alternate): median "
          f"{statistics.median(pairs):.2f}, {min(pairs):.2f}-{max(pairs):.2f}")
    if row.get("takes"):
        print(f"# takes: {row['takes']} answered by the data servers, bringing {row['sent']} "
              f"batches ({row['sent'] / row['takes']:.2f} a take)")
    print("# transport per batch against a memory copy of it into a fresh buffer, per worker, "
          "us (median over the transport epoch's batches): ask = the poll of the slot table "
          "(poll) or the take's control round trip (take), read = the bytes; ratios to the "
          "copy; late = batches still being prepared when asked for (their wait for the "
          "preparation is not counted)")
    print(f"{'worker':>6} {'road':>7} {'ask':>5} {'bytes':>9} {'batches':>7} {'late':>4} "
          f"{'ask':>8} "
          f"{'read':>8} {'total':>8} {'copy':>8} {'read/copy':>9} {'total/copy':>10}")
    for r, t in enumerate(x["transfer"] for x in rows):
        print(f"{r:>6} {t['road']:>7} {t['ask']:>5} {t['bytes']:>9} {t['batches']:>7} "
              f"{t['late']:>4} "
              f"{t['ask_us']['median']:>8.1f} "
              f"{t['read_us']['median']:>8.1f} {t['total_us']['median']:>8.1f} "
              f"{t['copy_us']['median']:>8.1f} {t['read_ratio']:>9.2f} {t['ratio']:>10.2f}",
              flush=True)


if __name__ == "__main__":
    run(parser().parse_args(sys.argv[1:]))
