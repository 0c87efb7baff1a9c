"""Parameter-server benchmark: gradsync's one-sided PS beside a gRPC PS, and a straggler.

Run as ``gradsync bench ps -np N --servers S [...]``. A parameter server learns its model from
the workers' first ``hello`` and keeps it for the life of the job, so one job measures one
model: this module is a *driver* that starts one ``gradsync run -np N --servers S`` job per
model size (or per consistency mode), every rank of which runs this module again; worker 0
hands the job's row back in a JSON file and the driver prints the table. Only the driver
prints; the server ranks run ``python -m gradsync.ps`` (not this module) and exit when the
workers are done.

**Throughput** (the default). For each size (``--sizes``, float32), every worker builds a
``ParameterClient`` (mode ``async``, optimizer ``sgd``, lr 2^-10) over one flat parameter of
that size, whose gradient is all ones. A timed iteration is one ``push`` (the gradient
lands in the server's memory and is applied) and one ``pull`` (the newest parameters are
read back). Warm-up first; then a barrier of the workers; the iteration count is worker 0's
choice, broadcast; every worker times its iterations back to back, all workers at once, as
training would. The time shown is the median over iterations of the slowest worker (the one
with the largest median), with its interquartile range; ``algbw = 2 x size / time``: a
push and a pull each move the model once. The gRPC peer (``grpc_ps.py``: protobuf
``bytes`` over HTTP/2, the server in its own process, started by the driver for each size)
runs in the same job, in the same worker processes, through the same loop. The last column is
``speedup = gRPC time / gradsync time``.

Verification: the gradient is 1 and lr = 2^-10, so after P pushes of all workers every
parameter must be exactly -P/1024 (exact in float32 for P < 2^24). After timing every worker
pulls and counts the elements that differ (``#wrong``, summed over workers), on both servers;
each gradsync server's counters and the gRPC server's step count must equal P.

**Straggler** (``--straggler``). Every worker trains the same small MLP on scikit-learn's
digits (its own shard of the training set) through a ``ParameterClient``; worker N-1 is made
``--slowdown`` times slower by sleeping (slowdown - 1) x its own compute time after each
step's forward and backward. One job per mode (sync, backup with k = N-1, async, ssp with
s = 3); worker 0 scores the test set every ``--eval-every`` steps, and its wall time (from a
barrier of the workers after set-up) until the accuracy first reaches ``--target`` is the
result, with the server's counters at that moment and each phase's median time per step.
``--lr`` is the step per gradient: sync and backup apply the *average* of N (k) gradients as
one update, so they use N (k) times it, and every mode moves each gradient by the same lr
(the linear scaling rule; ``--lr-scaling none`` turns that off). Momentum defaults to 0:
with server-side momentum, stale gradients of async training overshoot (asynchrony itself
acts as momentum, Mitliagkas et al. 2016). ``--train-seconds`` bounds each run's training,
``--deadline`` each job.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from .allreduce import at_least, parse_size

__all__ = ["parser", "drive", "throughput_rank", "straggler_rank", "LR"]

LR = 2.0 ** -10           # throughput runs: lr x gradient (1) is exact in float32
MODES = ("sync", "backup", "async", "ssp")
_STOP = "bench.ps.stop"   # store key: worker 0 reached the target, every worker stops


def _modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return modes


def _size_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (parse_size(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX such as 1K:64M, got {text!r}")
    if not 4 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 4 <= MIN <= MAX bytes, got {text!r}")
    return lo, hi


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync bench ps")
    p.add_argument("--transport", choices=["auto", "tcp"], default="auto",
                   help="GRADSYNC_TRANSPORT of the jobs: auto (shared memory on one host) or "
                        "tcp (every region access over TCP, as between hosts)")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--deadline", type=float, default=600.0,
                   help="seconds one job (one size or one mode) may take before it is killed")
    t = p.add_argument_group("throughput")
    t.add_argument("--sizes", type=_size_range, default="1K:64M",
                   help="MIN:MAX bytes of float32 (default 1K:64M)")
    t.add_argument("--factor", type=at_least(2), default=4, help="size multiplier between rows")
    t.add_argument("--seconds", type=float, default=0.5, help="target timed seconds per size")
    t.add_argument("--max-iters", type=at_least(5), default=1000)
    t.add_argument("--warmup", type=at_least(0), default=3)
    s = p.add_argument_group("straggler")
    s.add_argument("--straggler", action="store_true",
                   help="time to accuracy with one slow worker, in each consistency mode")
    s.add_argument("--modes", type=_modes, default=list(MODES),
                   help="modes to run, separated by commas (default: sync,backup,async,ssp)")
    s.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    s.add_argument("--slowdown", type=at_least(1.0, float), default=3.0,
                   help="how many times slower the last worker is (default 3)")
    s.add_argument("--backup", type=at_least(1), help="backup mode's k (default: workers - 1)")
    s.add_argument("--staleness", type=at_least(0), default=3, help="ssp mode's bound s")
    s.add_argument("--hidden", type=at_least(1), default=512,
                   help="MLP hidden width (64-h-h-10)")
    s.add_argument("--batch-size", type=at_least(1), default=64,
                   help="samples per worker per step")
    s.add_argument("--lr", type=float, default=0.1,
                   help="server SGD learning rate per gradient (see --lr-scaling)")
    s.add_argument("--lr-scaling", choices=["linear", "none"], default="linear",
                   help="linear: sync and backup, which apply the average of N (k) gradients "
                        "as one update, use lr x N (x k), so that every mode moves lr per "
                        "gradient (Goyal et al.); none: --lr in every mode")
    s.add_argument("--momentum", type=float, default=0.0)
    s.add_argument("--eval-every", type=at_least(1), default=5,
                   help="worker 0's steps between tests")
    s.add_argument("--train-seconds", type=float, default=60.0,
                   help="training time limit of one mode (a run that has not reached the "
                        "target by then reports its last accuracy)")
    s.add_argument("--seed", type=int, default=0)
    # Set by the driver on the ranks of one job; not for users.
    p.add_argument("--job-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--job-mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    return p


def _sizes(args) -> list[int]:
    lo, hi = args.sizes
    out, size = [], lo
    while size <= hi:
        out.append(size // 4 * 4)
        size *= args.factor
    return out


# --- the driver -------------------------------------------------------------------------

def drive(run: list[str], args, rest: list[str], workers: int, servers: int) -> int:
    """Starts one job per size (or per mode) with the ``gradsync run`` prefix ``run``.

    Args:
        run: ``[python, -m, gradsync, run, -np, N, --servers, S]``, as ``bench/cli.py`` built it.
        args: this parser's parsed options; ``rest`` the same options unparsed (the ranks get
            them again).
        workers, servers: N and S.
    Returns:
        The exit status: 0, or the first failed job's.
    """
    if args.straggler and workers < 2:
        print("gradsync bench ps: --straggler needs at least 2 workers (-np 2)", file=sys.stderr)
        return 2
    env = {**os.environ, "GRADSYNC_TRANSPORT": args.transport, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-ps-") as tmp:
        if args.straggler:
            status = _drive_straggler(run, args, rest, env, tmp, workers, servers, rows)
        else:
            status = _drive_throughput(run, args, rest, env, tmp, workers, servers, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return status


def _job(run, rest, extra, env, deadline: float, result: str) -> tuple[int, dict | None]:
    """Runs one job to completion (killing its process group past ``deadline``)."""
    cmd = [*run, sys.executable, "-m", __name__, *rest, *extra, "--result", result]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        status = proc.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"# job {' '.join(extra)} passed its {deadline:.0f}s deadline; killed", flush=True)
        return 124, None
    if status != 0 or not os.path.exists(result):
        return status or 1, None
    with open(result) as f:
        return 0, json.load(f)


def _drive_throughput(run, args, rest, env, tmp, workers, servers, rows) -> int:
    for i, size in enumerate(_sizes(args)):
        port_file = os.path.join(tmp, f"grpc-{size}.port")
        grpc_server = subprocess.Popen(
            [sys.executable, "-m", "gradsync.bench.grpc_ps", "--elements", str(size // 4),
             "--lr", repr(LR), "--port-file", port_file], env=env, start_new_session=True)
        try:
            port = _wait_port(port_file, grpc_server, 60.0)
            status, row = _job(run, rest, ["--job-size", str(size), "--grpc-port", str(port)],
                               env, args.deadline, os.path.join(tmp, f"row-{size}.json"))
        finally:
            grpc_server.terminate()
            try:
                grpc_server.wait(10)
            except subprocess.TimeoutExpired:
                grpc_server.kill()
                grpc_server.wait()
        if row is None:
            print(f"# the job for {size} bytes failed (status {status})", flush=True)
            return status
        row.update(workers=workers, servers=servers)
        rows.append(row)
        _print_throughput(row, header=i == 0)
        if not row["verified"]:
            print(f"# VERIFICATION FAILED at {size} bytes: " + ", ".join(
                f"{peer} applied {row[peer]['pushes']} pushes of {row[peer]['expected_pushes']}"
                for peer in ("gradsync", "grpc")), flush=True)
            return 1
    return 0


def _wait_port(path: str, proc: subprocess.Popen, timeout: float) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.path.exists(path):
            with open(path) as f:
                return int(f.read())
        if proc.poll() is not None:
            raise RuntimeError(f"the gRPC server exited with status {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"the gRPC server did not write {path} within {timeout:.0f}s")


def _print_throughput(row: dict, header: bool) -> None:
    if header:
        path = {"shm": "shared memory (control calls over loopback TCP)",
                "tcp": "TCP"}[row["transport"]]
        print(f"# parameter server, {row['workers']} workers, {row['servers']} server(s), "
              f"data path: {path}; mode async, sgd", flush=True)
        print("# time = push+pull, median over iterations of the slowest worker; algbw = "
              "2*size/time (GB/s); grpc = one gradsync.bench.grpc_ps server in its own process, "
              "the same workers and loop; speedup = grpc time / gradsync time", flush=True)
        print(f"#{'size(B)':>11} {'count':>10} {'time(us)':>10} {'iqr(us)':>9} {'algbw':>6} "
              f"{'#wrong':>6} | {'grpc(us)':>11} {'iqr(us)':>10} {'algbw':>6} {'#wrong':>6} | "
              f"{'speedup':>7}", flush=True)
    g, o = row["gradsync"], row["grpc"]
    print(f"{row['size']:>12} {row['count']:>10} {g['time_us']:>10.1f} {g['iqr_us']:>9.1f} "
          f"{g['algbw']:>6.2f} {g['wrong']:>6} | {o['time_us']:>11.1f} {o['iqr_us']:>10.1f} "
          f"{o['algbw']:>6.2f} {o['wrong']:>6} | {row['speedup']:>6.1f}x", flush=True)


def _drive_straggler(run, args, rest, env, tmp, workers, servers, rows) -> int:
    data = os.path.join(tmp, "digits.npz")
    _save_digits(data, args.seed)
    for i, mode in enumerate(args.modes):
        status, row = _job(run, rest, ["--job-mode", mode, "--data", data], env, args.deadline,
                           os.path.join(tmp, f"{mode}.json"))
        if row is None:
            print(f"# the {mode} job failed (status {status})", flush=True)
            return status
        row.update(workers=workers, servers=servers)
        sync = next((r for r in [*rows, row] if r["mode"] == "sync"), None)
        row["vs_sync"] = (sync["time_s"] / row["time_s"]
                          if sync and sync["reached"] and row["reached"] else None)
        rows.append(row)
        _print_straggler(row, args, header=i == 0)
    print("# where a step's time goes: median ms per step of worker 0 and of the slow worker "
          "(push includes waiting for the server's round or bound)", flush=True)
    print(f"#{'mode':>6} {'worker':>6} {'compute':>8} {'sleep':>8} {'push':>8} {'pull':>8}",
          flush=True)
    for row in rows:
        for w in (0, row["slow"]):
            ms = row["phases_ms"].get(str(w))  # JSON made the worker a string
            if ms is None:
                continue
            print(f"#{row['mode']:>6} {w:>6} " + " ".join(f"{v:>8.2f}" for v in ms), flush=True)
    return 0


def _print_straggler(row: dict, args, header: bool) -> None:
    if header:
        print(f"# straggler: {row['workers']} workers, {row['servers']} server(s), worker "
              f"{row['slow']} {args.slowdown:g}x slower (sleeps {args.slowdown - 1:g}x its "
              f"compute time per step); MLP 64-{args.hidden}-{args.hidden}-10 on digits, batch "
              f"{args.batch_size} per worker; server sgd, momentum {args.momentum}, lr "
              f"{args.lr} per gradient" + (" (sync: x N, backup: x k, on their averages)"
                                           if args.lr_scaling == "linear" else ""), flush=True)
        print(f"# time = worker 0's wall time until its test accuracy first reached "
              f"{args.target} (scored every {args.eval_every} of its steps); server 0's counters "
              f"then: updates = versions, applied/dropped gradients, most versions of staleness, "
              f"gradients pushed per worker; vs-sync = sync time / this time",
              flush=True)
        print(f"#{'mode':>6} {'param':>5} {'time(s)':>8} {'acc':>6} {'w0-steps':>8} "
              f"{'updates':>7} {'applied':>7} {'dropped':>7} {'stale':>5} {'pushes':>16} "
              f"{'vs-sync':>7}", flush=True)
    param = {"backup": f"k={row.get('backup')}", "ssp": f"s={row.get('staleness')}"}.get(
        row["mode"], "-")
    time_s = f"{row['time_s']:.2f}" if row["reached"] else f">{row['time_s']:.0f}"
    ratio = f"{row['vs_sync']:.1f}x" if row["vs_sync"] else "-"
    pushes = "/".join(str(c) for c in row["clocks"])
    print(f"{row['mode']:>7} {param:>5} {time_s:>8} {row['accuracy']:>6.3f} {row['steps']:>8} "
          f"{row['version']:>7} {row['applied']:>7} {row['dropped']:>7} "
          f"{row['max_staleness']:>5} {pushes:>16} {ratio:>7}", flush=True)


# --- throughput, on every rank --------------------------------------------------------

def _measure(fn, args, gs, name: str) -> dict:
    """Warm-up, agreed iteration count, back-to-back timed iterations on every worker."""
    for _ in range(args.warmup):
        fn()
    gs.barrier()
    probe = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        probe.append(time.perf_counter() - start)
    iters = int(min(args.max_iters, max(5, args.seconds / max(min(probe), 1e-6))))
    iters = int(gs.broadcast_object(iters, 0, name=f"bench.ps.{name}.iters"))
    samples = np.empty(iters)
    gs.barrier()  # the workers start together, and then each goes at its own pace
    for i in range(iters):
        start = time.perf_counter()
        fn()
        samples[i] = time.perf_counter() - start
    # The slowest worker's median (and its spread) is the figure: a push+pull that all the
    # workers do at once is done when the last one's is.
    mine = (float(np.median(samples)), float(np.subtract(*np.percentile(samples, [75, 25]))))
    med, iqr = max(gs.allgather_object(mine, name=f"bench.ps.{name}.samples"))
    return {"time_us": med * 1e6, "iqr_us": iqr * 1e6, "iters": iters,
            "pushes_each": args.warmup + len(probe) + iters}


def _wrong(pulled: np.ndarray, pushes: int, gs, name: str) -> int:
    """Elements of every worker's pull that differ from the closed form -pushes * LR."""
    want = np.float32(-pushes * LR)
    mine = int(np.count_nonzero(pulled != want))
    return int(gs.allreduce(np.array([mine], np.int64), op=gs.Sum, name=name)[0])


def throughput_rank(args) -> dict | None:
    """One size: gradsync's PS, then the gRPC PS, in this job's workers. Worker 0 returns
    the row (and writes it to ``--result``); the others return None."""
    import torch

    import gradsync as gs
    from gradsync.bench.grpc_ps import GrpcClient
    from gradsync.ps import ParameterClient

    gs.init()
    torch.set_num_threads(1)
    count, n = args.job_size // 4, gs.size()
    param = torch.nn.Parameter(torch.zeros(count))
    ps = ParameterClient([param], optimizer="sgd", lr=LR, mode="async")
    with torch.no_grad():
        param.grad.fill_(1.0)  # p.grad is the client's flat gradient buffer: push sends it
    row = {"size": count * 4, "count": count, "mode": "async",
           "transport": "shm" if all(peer.region("params").direct is not None
                                     for peer in ps.peers) else "tcp"}

    def ps_step():
        ps.push()
        ps.pull()

    g = _measure(ps_step, args, gs, "gradsync")
    gs.barrier()  # every push is applied when it returns (async): the servers are done
    pushes = n * g["pushes_each"]
    ps.pull()
    g["wrong"] = _wrong(param.detach().numpy(), pushes, gs, "bench.ps.wrong")
    g["pushes"] = min(s["applied"] for s in ps.stats()) if gs.rank() == 0 else None

    grpc = GrpcClient(f"127.0.0.1:{args.grpc_port}", count, timeout=args.deadline)
    grad, out = np.ones(count, np.float32), np.empty(count, np.float32)

    def grpc_step():
        grpc.push(grad)
        grpc.pull(out)

    o = _measure(grpc_step, args, gs, "grpc")
    gs.barrier()
    grpc_pushes = n * o["pushes_each"]
    grpc.pull(out)
    o["wrong"] = _wrong(out, grpc_pushes, gs, "bench.ps.grpc.wrong")
    o["pushes"] = grpc.step
    grpc.close()
    ps.close()
    if gs.rank() != 0:
        return None
    for m in (g, o):
        m["algbw"] = 2 * row["size"] / (m["time_us"] * 1e-6) / 1e9
    g["expected_pushes"], o["expected_pushes"] = pushes, grpc_pushes
    row.update(gradsync=g, grpc=o, speedup=o["time_us"] / g["time_us"],
               verified=all(m["pushes"] == m["expected_pushes"] for m in (g, o)))
    return row


# --- the straggler experiment, on every rank ------------------------------------------

def _save_digits(path: str, seed: int) -> None:
    """The train/test split of scikit-learn's digits, made once by the driver (importing
    scikit-learn costs each rank about a second of CPU that the other ranks would feel)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixels are 0..16
    train, test = train_test_split(np.arange(len(x)), test_size=0.2, random_state=seed,
                                   stratify=digits.target)
    np.savez(path, x_train=x[train], y_train=digits.target[train], x_test=x[test],
             y_test=digits.target[test])


def straggler_rank(args) -> dict | None:
    """One mode: trains until worker 0 reaches the target; worker 0 returns the row."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import gradsync as gs
    from gradsync import job
    from gradsync.ps import ParameterClient

    gs.init()
    torch.set_num_threads(1)
    rank, n = gs.rank(), gs.size()
    slow, mode = n - 1, args.job_mode
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10))
    with np.load(args.data) as data:
        x_train, y_train, x_test, y_test = (torch.from_numpy(data[k]) for k in (
            "x_train", "y_train", "x_test", "y_test"))
    y_train, y_test = y_train.long(), y_test.long()
    mine = torch.arange(rank, len(y_train), n)  # this worker's shard
    k = args.backup if args.backup is not None else max(1, n - 1)
    ps = ParameterClient(model, optimizer="sgd", lr=_lr(args, mode, n, k),
                         momentum=args.momentum, mode=mode, backup=k, staleness=args.staleness)
    store = job.world().store
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    order, at = mine[torch.randperm(len(mine), generator=gen)], 0
    steps, accuracy, reached = 0, 0.0, False
    phases = []  # per step: compute, sleep, push, pull (seconds)
    gs.barrier()
    start = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if elapsed > args.train_seconds or (rank != 0 and store.check(_STOP)):
            break
        if at + args.batch_size > len(order):
            order, at = mine[torch.randperm(len(mine), generator=gen)], 0
        idx = order[at:at + args.batch_size]
        at += args.batch_size
        t0 = time.perf_counter()
        F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
        t1 = time.perf_counter()
        if rank == slow:
            time.sleep((args.slowdown - 1) * (t1 - t0))
        t2 = time.perf_counter()
        ps.push()
        t3 = time.perf_counter()
        ps.pull()
        model.zero_grad(set_to_none=False)  # zeroes the client's flat gradient in place
        phases.append((t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3))
        steps += 1
        if rank == 0 and steps % args.eval_every == 0:
            with torch.no_grad():
                accuracy = (model(x_test).argmax(1) == y_test).sum().item() / len(y_test)
            if accuracy >= args.target:
                elapsed, reached = time.perf_counter() - start, True
                break
    stats = ps.stats()[0] if rank == 0 else None  # the counters at the moment of the result
    if rank == 0:
        # In sync mode the others wait in push for worker 0's gradient: its goodbye (close)
        # closes their round, and they then see the stop.
        store.set(_STOP, "1")
    ps.close()
    median = np.median(phases, axis=0) * 1e3 if phases else np.zeros(4)
    store.set(f"bench.ps.phases.{rank}", json.dumps([round(float(v), 3) for v in median]))
    if rank != 0:
        return None
    found = store.wait_keys([f"bench.ps.phases.{w}" for w in range(n)], 60.0)
    phases_ms = {w: json.loads(found[f"bench.ps.phases.{w}"]) for w in range(n)
                 if f"bench.ps.phases.{w}" in found}
    return {"mode": mode, "slow": slow, "reached": reached, "time_s": elapsed,
            "accuracy": accuracy, "target": args.target, "steps": steps,
            "lr": _lr(args, mode, n, k), "backup": k if mode == "backup" else None,
            "staleness": args.staleness if mode == "ssp" else None,
            "phases_ms": phases_ms,  # worker -> median compute, sleep, push, pull
            **{key: stats[key] for key in ("version", "applied", "dropped", "max_staleness",
                                           "max_clock_gap", "clocks")}}


def _lr(args, mode: str, workers: int, k: int) -> float:
    """The server's lr: ``--lr`` per gradient, so sync and backup, which apply the average of
    N (or k) gradients as one update, scale it by N (or k) under ``--lr-scaling linear``."""
    if args.lr_scaling == "none":
        return args.lr
    return args.lr * {"sync": workers, "backup": k}.get(mode, 1)


def main(argv: list[str] | None = None) -> int:
    """One rank of a job the driver started (``--job-size`` or ``--job-mode``)."""
    args = parser().parse_args(argv)
    if args.job_size is None and args.job_mode is None:
        raise SystemExit("gradsync.bench.ps runs as one job of 'gradsync bench ps'; start "
                         "it with: gradsync bench ps -np N --servers S [options]")
    row = throughput_rank(args) if args.job_size is not None else straggler_rank(args)
    if row is not None and args.result:
        with open(args.result, "w") as f:
            json.dump(row, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
