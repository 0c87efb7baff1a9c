"""Allreduce benchmark in the style of nccl-tests, with gloo or Open MPI beside it.

Run as ``gradsync bench allreduce -np N [--compare gloo|mpi]``; every rank runs this module.
With ``--compare gloo`` the ranks start through ``gradsync run`` and also join a
torch.distributed gloo group; with ``--compare mpi`` they start through Open MPI's ``mpirun``
(gradsync adopts its ranks, ``launch_env.py``) and also call ``MPI_Allreduce`` through mpi4py,
so the peer runs in the same processes, on the same buffer, interleaved size by size.
For each size: warm-up, then ``iters`` timed in-place allreduces, each started after a barrier
so that ranks start together, each timed on every rank; a sample is the slowest rank's time
(the collective is not done until the last rank is). The iteration count is chosen on rank 0
and broadcast so that all ranks agree. After timing, one allreduce of known inputs is checked
(#wrong = elements that differ from the closed form). Only rank 0 prints.

The timed buffer holds zeros, so that repeated in-place sums stay finite (ones would double
every iteration and overflow to inf after about 128 of them). The ``memcpy`` column is the
floor: one process copying the same number of bytes (``np.copyto``), measured on every rank
at the same moment, so under the same load. With ``--exchange``, the ``exchange`` column is
the ring's transfers alone: every rank sends the bytes a bandwidth-optimal allreduce sends,
2 (n - 1) / n of the vector, to the next rank over a plain TCP socket while it receives as many
from the previous one, one segment each way at a time, of the size the ring cuts for that
vector (``ring.segment_bytes``; it runs after gradsync's allreduce, whose trials chose it), with
no reduction (``RingExchange``): what is left of an allreduce's time beyond it is its folds
and its own overhead.

Over TCP the ring's first large allreduces are trials (of segment sizes, then of lending;
``collectives/ring.py``): when the plain ring runs on the job's Comm, gradsync's warm-up goes
on until they are over, so that the timed allreduces run as a long job's do (``hierarchical``
and ``topo_ring`` run theirs on views of the Comm, which the warm-up does not wait for).

    algbw = size / time            busbw = algbw * 2 (n - 1) / n

busbw is the per-link traffic of a bandwidth-optimal allreduce, comparable across n.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

__all__ = ["parser", "run", "drive", "mpirun_command", "missing_mpi", "parse_size", "size_range",
           "at_least"]

MPI_INSTALL = ("apt-get install -y --no-install-recommends openmpi-bin && "
               "pip install mpi4py  (or: pip install -e '.[bench]')")

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    return int(float(text[:len(text) - len(unit)]) * _UNITS[unit])


def size_range(text: str, factor: int) -> list[int]:
    """The sizes of ``MIN:MAX`` (as ``parse_size`` reads them), from MIN up to MAX by ``factor``."""
    size, high = (parse_size(part) for part in text.split(":"))
    sizes = []
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


def at_least(minimum, kind=int):
    """An argparse ``type`` that parses ``kind`` and refuses values below ``minimum``."""
    def parse(text: str):
        value = kind(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync bench allreduce")
    p.add_argument("--sizes", default="4K:64M", help="MIN:MAX bytes, stepping by --factor (default 4K:64M)")
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows (default 4)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "int32"])
    p.add_argument("--algorithm", default="auto",
                   help="gradsync algorithm, or several separated by commas, each measured in "
                        "the same run (e.g. ring,topo_ring,hierarchical,auto); default auto")
    p.add_argument("--buffer", default="plain",
                   help="where gradsync's vector lives: plain (NumPy memory), shared (a shared "
                        "buffer of the host's shared-memory group, as DistributedOptimizer's "
                        "buckets; one host only), or both separated by a comma, each measured "
                        "in the same run; default plain")
    p.add_argument("--topology", help="topology file for the planner (GRADSYNC_TOPOLOGY)")
    p.add_argument("--compare", choices=["gloo", "mpi", "none"], default="none",
                   help="also measure this peer in the same run: torch.distributed's gloo, "
                        "or Open MPI through mpi4py (the ranks then start under mpirun)")
    p.add_argument("--exchange", action="store_true",
                   help="also time the ring's transfers alone: the bytes a bandwidth-optimal "
                        "allreduce sends, over plain TCP sockets between the ranks, in "
                        "segments of chunk_bytes, with no reduction")
    p.add_argument("--seconds", type=float, default=0.5, help="target timed seconds per size")
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--iters", type=at_least(1),
                   help="timed iterations per size, instead of as many as --seconds allows "
                        "(skips the two probing calls: for links so slow that one call takes "
                        "seconds)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the rows to this file (rank 0)")
    p.add_argument("--profile", action="store_true",
                   help="after the largest size, profile 20 gradsync allreduces of it on "
                        "rank 0 (cProfile) and print where the time goes")
    return p


def missing_mpi() -> "str | None":
    """What ``--compare mpi`` lacks (with the command that installs it), or None."""
    lacking = [what for what, ok in (("Open MPI's mpirun", shutil.which("mpirun")),
                                     ("mpi4py", importlib.util.find_spec("mpi4py")))
               if not ok]
    if not lacking:
        return None
    return (f"gradsync bench allreduce --compare mpi needs {' and '.join(lacking)}; "
            f"install with: {MPI_INSTALL}")


def mpirun_command(np_: int, argv: list[str], port: int) -> list[str]:
    """The mpirun line that starts ``np_`` benchmark ranks on this host.

    gradsync adopts mpirun's ranks and meets them at MASTER_ADDR/MASTER_PORT. Root may run
    Open MPI only with ``--allow-run-as-root``; more ranks than cores need ``--oversubscribe``.
    Everything else is Open MPI's default (shared-memory transport, its own binding).
    """
    cmd = ["mpirun", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if np_ > len(os.sched_getaffinity(0)):
        cmd.append("--oversubscribe")
    cmd += ["-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}"]
    for name in ("PYTHONPATH", "PATH", *sorted(n for n in os.environ if n.startswith("GRADSYNC_"))):
        if name in os.environ:  # gradsync's settings too (GRADSYNC_SHM_FAST=0 ...)
            cmd += ["-x", name]
    return cmd + [sys.executable, "-m", __name__, *argv]


def drive(run: list[str], args, rest: list[str], workers: int, servers: "int | None") -> int:
    """Starts the ranks: through ``gradsync run`` (``run``), or through mpirun for
    ``--compare mpi``. Returns the exit status."""
    if args.compare != "mpi":
        return subprocess.call([*run, sys.executable, "-m", __name__, *rest])
    problem = missing_mpi()
    if problem is None and "-H" in run:
        problem = "gradsync bench allreduce --compare mpi runs on this host: leave out -H"
    if problem is None and args.dtype == "float16":
        problem = "MPI has no float16 sum: use another --dtype with --compare mpi"
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.call(mpirun_command(workers, rest, port))


class RingExchange:
    """Every rank streams ``2 (n - 1) / n`` of a vector's bytes to the next rank while it
    receives as many from the previous one, over one plain TCP socket each way (4 MiB socket
    buffers and ``TCP_NODELAY``, as gradsync's own), one segment of ``segment`` bytes each way at
    a time, one thread moving both: the ring allreduce's transfers without its reductions
    (``--exchange``). Setting it up is a collective: every rank must construct it together."""

    def __init__(self, world, gs, segment: int):
        n, me = world.size, world.rank
        self.segment = segment
        server = socket.create_server((world.peers[me].addr, 0))
        ports = gs.allgather_object(server.getsockname()[1], name="bench.exchange")
        after = world.peers[(me + 1) % n]
        self._out = socket.create_connection((after.addr, ports[after.rank]))
        self._in, _ = server.accept()
        server.close()
        for sock in (self._out, self._in):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.setblocking(False)

    @staticmethod
    def buffers(nbytes: int, rank: int, n: int) -> "tuple[np.ndarray, np.ndarray]":
        """What each rank sends (bytes of ``rank % 251 + 1``) and receives for an allreduce
        of ``nbytes``."""
        volume = 2 * (n - 1) * nbytes // n
        return np.full(volume, rank % 251 + 1, np.uint8), np.zeros(volume, np.uint8)

    def wrong(self, send: np.ndarray, receive: np.ndarray, rank: int, n: int) -> int:
        """One more exchange, into zeros: the bytes not received as the previous rank sent
        them."""
        receive[:] = 0
        self(send, receive)
        return int(np.count_nonzero(receive != (rank - 1) % n % 251 + 1))

    def __call__(self, send: np.ndarray, receive: np.ndarray) -> None:
        out, into = memoryview(send), memoryview(receive)
        for start in range(0, len(out), self.segment):
            self._segment(out[start:start + self.segment], into[start:start + self.segment])

    def _segment(self, out: memoryview, into: memoryview) -> None:
        sent = got = 0
        while sent < len(out) or got < len(into):
            moved = False
            if sent < len(out):
                try:
                    sent += self._out.send(out[sent:])
                    moved = True
                except BlockingIOError:
                    pass
            if got < len(into):
                try:
                    k = self._in.recv_into(into[got:])
                except BlockingIOError:
                    k = -1
                if k == 0:
                    raise ConnectionError("the previous rank closed its exchange socket")
                if k > 0:
                    got, moved = got + k, True
            if not moved:
                select.select([self._in] if got < len(into) else [],
                              [self._out] if sent < len(out) else [], [], 1.0)

    def close(self) -> None:
        self._out.close()
        self._in.close()


#: At most this many more warm-up calls while an allreduce is among its trials: the segment
#: sizes' (2 turns of 4 each) and lending's (3 each; ``transport/comm.py``).
_TRIAL_WARMUPS = 24


def _timed(fn, barrier, iters: int, reduce_max) -> list[float]:
    samples = np.empty(iters)
    for i in range(iters):
        barrier()
        start = time.perf_counter()
        fn()
        samples[i] = time.perf_counter() - start
    return reduce_max(samples).tolist()


def run(args) -> list[dict]:
    import torch

    import gradsync as gs

    torch.set_num_threads(1)
    gs.init(**({"topology": args.topology} if args.topology else {}))
    from gradsync import job
    from gradsync.collectives import ring
    from gradsync.collectives.planner import choose_allreduce

    world = job.world()
    rank, n = gs.rank(), gs.size()
    gloo = mpi = None
    if args.compare == "gloo":
        import torch.distributed as dist

        store = torch.distributed.PrefixStore("bench-gloo", world.store.base)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
        gloo = dist
    elif args.compare == "mpi":
        from mpi4py import MPI

        mpi = MPI
        if MPI.COMM_WORLD.Get_size() != n or MPI.COMM_WORLD.Get_rank() != rank:
            raise SystemExit(f"MPI's world ({MPI.COMM_WORLD.Get_rank()} of "
                             f"{MPI.COMM_WORLD.Get_size()}) is not gradsync's ({rank} of {n})")
    peer = "gloo" if gloo is not None else "mpi" if mpi is not None else None
    lo, hi = (parse_size(s) for s in args.sizes.split(":"))
    dtype = np.dtype(args.dtype)
    reduce_max = lambda a: gs.allreduce(a, op=gs.Max, name="bench.samples")  # noqa: E731
    exchange = (RingExchange(world, gs, world.config.chunk_bytes) if args.exchange and n > 1
                else None)
    rows = []
    size = lo
    algorithms = args.algorithm.split(",")
    buffers = args.buffer.split(",")
    if set(buffers) - {"plain", "shared"}:
        raise SystemExit(f"--buffer takes plain, shared or both, not {args.buffer!r}")
    runs = [(alg, buf) for buf in buffers for alg in algorithms]
    while size <= hi:
        count = max(1, size // dtype.itemsize)
        nbytes = count * dtype.itemsize
        x = np.zeros(count, dtype=dtype)
        xs = {"plain": x}
        if "shared" in buffers:
            raw = world.shared_buffer(nbytes)
            if raw is None:
                raise SystemExit("--buffer shared needs 2 or more ranks, all on one host")
            xs["shared"] = raw.view(dtype)
        copy_src = np.zeros_like(x)
        impls = [("memcpy", "memcpy", lambda: np.copyto(x, copy_src), gs.barrier, x)]
        for alg, buf in runs:
            impls.append(("gradsync", (alg, buf), lambda alg=alg, xb=xs[buf]: gs.allreduce_(
                xb, op=gs.Sum, name="bench", algorithm=alg), gs.barrier, xs[buf]))
        if exchange is not None:
            sent, received = exchange.buffers(nbytes, rank, n)

            def exchanged(nbytes=nbytes, sent=sent, received=received):
                exchange.segment = ring.segment_bytes(world.comm, nbytes,
                                                      world.config.chunk_bytes)
                exchange(sent, received)
            impls.append(("exchange", "exchange", exchanged, gs.barrier, x))
        if gloo is not None:
            t = torch.from_numpy(x)
            impls.append(("gloo", "gloo", lambda: gloo.all_reduce(t), gloo.barrier, x))
        if mpi is not None:
            cw = mpi.COMM_WORLD
            impls.append(("mpi", "mpi", lambda: cw.Allreduce(mpi.IN_PLACE, x, op=mpi.SUM),
                          cw.Barrier, x))
        measured = {}
        # The trials are the plain ring's (on the job's Comm): only its warm-up waits for them.
        trying = lambda: ring.measuring(world.comm, nbytes, world.config.chunk_bytes)  # noqa: E731
        rings = {alg: choose_allreduce(nbytes, n, alg, world.config, world.shares_host,
                                       world.topology) == "ring" for alg in algorithms}
        for label, key, fn, barrier, data in impls:
            measured[key] = _measure(args, fn, barrier, reduce_max, data,
                                     label not in ("memcpy", "exchange"), rank, n, nbytes, gs,
                                     trying if label == "gradsync" and rings[key[0]] else None)
        if exchange is not None:
            measured["exchange"]["wrong"] = int(gs.allreduce(
                np.array([exchange.wrong(sent, received, rank, n)]), op=gs.Sum,
                name="bench.exchange.wrong")[0])
        if "shared" in xs:
            world.release_shared(xs["shared"].ctypes.data)
        for alg, buf in runs:
            row = {"size": nbytes, "count": count, "dtype": dtype.name, "requested": alg,
                   "algorithm": choose_allreduce(nbytes, n, alg, world.config,
                                                 world.shares_host, world.topology),
                   "buffer": buf, "transport": world.config.transport, "ranks": n,
                   "shm_road": _shm_road(world),
                   "segment": ring.segment_bytes(world.comm, nbytes, world.config.chunk_bytes),
                   "gradsync": measured[alg, buf], "memcpy": measured["memcpy"]}
            if exchange is not None:
                row["exchange"] = measured["exchange"]
            if peer is not None:
                row["peer"] = peer
                row[peer] = measured[peer]
                row["ratio"] = row["gradsync"]["busbw"] / row[peer]["busbw"]
            if len(runs) > 1:
                row["speedup_vs_first"] = measured[runs[0]]["time_us"] / \
                    measured[alg, buf]["time_us"]
            rows.append(row)
            if rank == 0:
                _print_row(row, header=len(rows) == 1, compare=peer is not None,
                           several=len(runs) > 1, shared="shared" in buffers)
        size *= args.factor
    if rank == 0:
        _print_trials(world.comm, world.config.chunk_bytes, [row["size"] for row in rows])
    if args.profile:
        _profile(lambda: gs.allreduce_(x, op=gs.Sum, name="bench", algorithm=algorithms[0]),
                 gs.barrier, rank)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if exchange is not None:
        exchange.close()
    if gloo is not None:
        gloo.destroy_process_group()
    gs.shutdown()
    return rows


def _measure(args, fn, barrier, reduce_max, x, check: bool, rank: int, n: int, nbytes: int,
             gs, trying=None) -> dict:
    """Median time of ``fn`` (the slowest rank's per iteration), and a correctness check.

    ``trying``: whether ``fn`` is still among its trials; the warm-up goes on while it is, on
    any rank (up to ``_TRIAL_WARMUPS`` more calls)."""
    for _ in range(args.warmup):
        fn()
    for _ in range(_TRIAL_WARMUPS if trying is not None else 0):
        if not gs.allreduce(np.array([int(trying())]), op=gs.Max, name="bench.trying")[0]:
            break
        fn()
    if args.iters is None:
        probe = _timed(fn, barrier, 2, reduce_max)
        iters = int(min(args.max_iters, max(5, args.seconds / max(min(probe), 1e-6))))
        iters = int(gs.broadcast_object(iters, 0, name="bench.iters"))
    else:
        iters = args.iters  # the same argument on every rank: nothing to agree on
    samples = _timed(fn, barrier, iters, reduce_max)
    wrong = 0
    if check:
        count = x.size
        x[:] = np.arange(count) % 5 + rank  # closed form: sum = n*(i%5) + n(n-1)/2
        fn()
        want = n * (np.arange(count) % 5) + n * (n - 1) / 2
        wrong = int(gs.allreduce(np.array([np.count_nonzero(x != want.astype(x.dtype))]),
                                 op=gs.Sum, name="bench.wrong")[0])
        x[:] = 0
    med = statistics.median(samples)
    algbw = nbytes / med / 1e9
    return {"time_us": med * 1e6, "iqr_us": float(np.subtract(
        *np.percentile(samples, [75, 25])) * 1e6), "samples_us": [s * 1e6 for s in samples],
        "iters": iters, "algbw": algbw,
        "busbw": algbw * (2 * (n - 1) / n if n > 1 else 1), "wrong": wrong}


def _print_trials(comm, chunk_bytes: int, sizes: "list[int]") -> None:
    """What the ring's trials (segment sizes, lending) chose on ``comm`` for ``sizes``."""
    from gradsync.collectives import ring

    seen = set()
    for nbytes in sizes:
        sizing = comm.segments(chunk_bytes, nbytes) if nbytes >= ring.TUNE_FROM_BYTES else None
        if sizing is None or sizing.chosen is None or id(sizing) in seen:
            continue
        seen.add(id(sizing))
        tried = ", ".join(f"{way} B: {cost * 1e12:.0f} ps/B" for way, cost in
                          zip(sizing.ways, sizing.medians()))
        print(f"# ring over TCP: segments of {sizing.chosen} B chosen for allreduces of "
              f"{nbytes} B (rank 0's medians: {tried})", flush=True)
    if comm.lends and comm.lending.chosen is not None and comm.lending.seconds_per_byte[True]:
        print(f"# ring over TCP: lending {'chosen' if comm.lending.chosen else 'not chosen'} "
              f"for allreduces above {ring.LEND_ABOVE_BYTES} B", flush=True)


def _profile(fn, barrier, rank: int, iters: int = 20) -> None:
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    for _ in range(iters):
        barrier()
        if rank == 0:
            profiler.enable()
        fn()
        if rank == 0:
            profiler.disable()
    if rank == 0:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(12)
        print(f"# profile of rank 0 over {iters} allreduces of the largest size "
              "(tottime = time in the function itself)", flush=True)
        print(out.getvalue(), flush=True)


def _alg_label(row: dict) -> str:
    """``auto:ring`` for the planner's choice, else the algorithm's name; ``+shared`` on a
    shared buffer."""
    label = row["algorithm"]
    if row.get("requested", label) != label:
        label = f"{row['requested']}:{label}"
    return label + ("+shared" if row.get("buffer") == "shared" else "")


def _shm_road(world) -> str:
    """Which road a small shared-memory allreduce takes: compiled, python, or none (no group)."""
    from gradsync.collectives.ops import ReduceOp

    if not world.shares_host:
        return "none"
    compiled = world.small_road(ReduceOp.SUM, np.dtype(np.float32), 4) is not None
    return "compiled" if compiled else "python"


def _print_row(row: dict, header: bool, compare: bool, several: bool = False,
               shared: bool = False) -> None:
    if header:
        cols = f"{'size(B)':>12} {'count':>11} {'type':>8} {'algorithm':>22} {'time(us)':>10} " \
               f"{'algbw':>7} {'busbw':>7} {'#wrong':>6} {'memcpy(us)':>10}"
        if "exchange" in row:
            cols += f" {'exchange(us)':>12}"
        if compare:
            cols += f" | {row['peer'] + '(us)':>10} {'busbw':>7} {'#wrong':>6} {'ratio':>6}"
        if several:
            cols += f" | {'speedup':>7}"
        print(f"# allreduce, {row['ranks']} ranks, transport={row['transport']}, small shm "
              f"allreduce road={row.get('shm_road', 'none')}, in place, "
              f"op=sum; busbw = algbw*2(n-1)/n "
              f"(GB/s); time = median over iterations of the slowest rank"
              + ("; speedup = time of the first algorithm listed / this one's" if several
                 else "") + ("; +shared = on shared buffers (--buffer)" if shared else "")
              + ("; exchange = the ring's transfers alone, over plain TCP sockets, no "
                 "reduction (--exchange)" if "exchange" in row else ""),
              flush=True)
        print(cols, flush=True)
    g = row["gradsync"]
    line = f"{row['size']:>12} {row['count']:>11} {row['dtype']:>8} {_alg_label(row):>22} " \
           f"{g['time_us']:>10.1f} {g['algbw']:>7.2f} {g['busbw']:>7.2f} {g['wrong']:>6} " \
           f"{row['memcpy']['time_us']:>10.1f}"
    if "exchange" in row:
        line += f" {row['exchange']['time_us']:>12.1f}"
    if compare:
        o = row[row["peer"]]
        line += f" | {o['time_us']:>10.1f} {o['busbw']:>7.2f} {o['wrong']:>6} {row['ratio']:>6.2f}"
    if several:
        line += f" | {row['speedup_vs_first']:>7.2f}"
    print(line, flush=True)


if __name__ == "__main__":
    run(parser().parse_args(sys.argv[1:]))
