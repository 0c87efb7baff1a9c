"""``gradsync bench compress``: real training over shaped links, each mode to a fixed target.

    gradsync bench compress [--hosts 4] [--ranks-per-host 1] [--task lm|cnn]
        [--rates 25mbit,100mbit,1gbit,unshaped] [--modes floor,gloo-fp32,...]
        [--target-loss L | --target-accuracy A] [--max-steps S] [--minutes M] [--seed N]
        [--markdown] [--json FILE]

What it answers (issue 38): on hosts joined by a link of a given rate, how long does a real
job take to reach a fixed validation quality with each way of exchanging gradients, against
the floor no scheme can beat, its compute-only time? Bytes saved are not the measure; time to
the target is, since a compressor can save bytes and lose more in extra steps.

**The hosts** are ``netns.Cluster``'s: one network namespace per emulated host (``h0`` ...),
``--ranks-per-host`` ranks each, all joined by one switch; every host's link is shaped with
``tc`` (``Cluster.reshape``, both ends) to each rate of ``--rates`` in turn (``unshaped``: no
shaping, the veth's own speed). The ranks start as torchrun would start them (``netns.run``),
one job per mode and rate, so no mode inherits another's threads, sockets or state, and a
mode that crashes (torch's PowerSGD hook did, issue 38) is reported as failed while the
others go on.

**The tasks** (``compress_tasks.py``): ``lm``, a byte-level transformer (1.3 M parameters by
default) on CPython's standard library, validation files kept apart by a hash of their path;
``cnn``, a small CNN on scikit-learn's digits. **The modes**, each rate running all of them in
this order (``compress_report.MODES``): ``floor`` (no exchange), DDP over gloo at fp32, with
torch's bf16 hook and with torch's PowerSGD hook (one bucket), DDP over the gradsync backend
at fp32, with gradsync's int8, int4 and PowerSGD hooks and with ``compression="auto"``
(``gs-auto``, whose row's ``choice`` says what it chose per bucket class, with the numbers
behind it under the table; ``gs-auto-local`` the same with local SGD's H among its choices,
up to ``--local-sgd``), the Horovod API's ``DistributedOptimizer`` with Int8 or PowerSGD
and ``gradient_lag=1`` (``gs-int8-lag``, ``gs-powersgd-lag``: each step's exchange runs behind
the next step's compute), and gradsync's DiLoCo (H inner steps, the outer gradient in int8
or ``--diloco-sync``), at once (``gs-diloco``) or overlapped (``gs-streaming``: each sync
lands ``--streaming-delay`` inner steps after it starts, the steps taken meanwhile kept).
Every mode trains the same model from the same weights on the same batches with the
same optimizer (AdamW); only the exchange differs.

**What is reported**, per rate and mode (``compress_report.py``): whether it reached the
target, the steps and training seconds to it (evaluation excluded, each segment timed at its
slowest rank, ``compress_rank.py``), its ratio to the floor (compute-only seconds per step x
the fp32 run's steps to the target), seconds per step, the bytes each host sent per step
(counted on its interface), the final validation loss (and accuracy for the CNN), and the
mode's settings. A mode that did not reach the target says why (max steps, time budget,
diverged) and gets no ratio.

The bench is a measurement: run it on a quiet machine. ``--minutes`` and ``--max-steps``
bound each mode's training; every job also has a deadline, after which its ranks are killed
and the mode is reported as failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading

from . import compress_report as cr
from .compress_tasks import TASKS, Sizes, prepare
from ..testbed.netns import Cluster, NetnsError, parse_rate, run, unavailable_reason

__all__ = ["parser", "drive", "settings_of", "parse_modes", "parse_rates"]

_DEFAULTS = {"lm": {"target_loss": 2.4, "target_accuracy": None, "lr": 3e-3, "batch": 8},
             "cnn": {"target_loss": None, "target_accuracy": 0.95, "lr": 2e-3, "batch": 32}}


def parse_rates(text: str) -> list[str]:
    """``"25mbit,unshaped"`` -> the rates, each checked (``unshaped``: no shaping)."""
    rates = [r.strip() for r in text.split(",") if r.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("give at least one rate")
    for rate in rates:
        if rate != "unshaped":
            try:
                parse_rate(rate)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
    return rates


def parse_modes(text: str) -> list[str]:
    """``"gs-int8,floor"`` -> the modes, in the bench's order (``compress_report.MODES``)."""
    names = {"gs-auto" if m.strip() == "auto" else m.strip() for m in text.split(",")
             if m.strip()}
    unknown = sorted(names - set(cr.MODES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown) or repr(text)}; "
                                         f"choose from {', '.join(cr.MODES)}")
    return [m for m in cr.MODES if m in names]


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync bench compress", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks-per-host", type=_positive(int), default=1, metavar="K",
                   help="ranks per emulated host (default 1)")
    p.add_argument("--task", choices=TASKS, default="lm", help="lm (default) or cnn")
    p.add_argument("--rates", type=parse_rates, default=parse_rates("25mbit,100mbit,1gbit,"
                                                                    "unshaped"),
                   help="link rates in turn, as tc writes them, or 'unshaped' (default "
                        "25mbit,100mbit,1gbit,unshaped)")
    p.add_argument("--delay", help="one-way delay on each host link (needs netem; default none)")
    p.add_argument("--modes", type=parse_modes, default=list(cr.MODES),
                   help=f"which modes, of {','.join(cr.MODES)} (default all)")
    target = p.add_argument_group("the target and the budget of each mode")
    target.add_argument("--target-loss", type=_positive(float),
                        help="validation loss to reach, nats per item (lm default 2.4)")
    target.add_argument("--target-accuracy", type=_positive(float),
                        help="validation accuracy to reach (cnn; default 0.95)")
    target.add_argument("--max-steps", type=_positive(int), default=400,
                        help="steps before a mode gives up (default 400)")
    target.add_argument("--minutes", type=_positive(float), default=3.0,
                        help="training minutes before a mode gives up (default 3)")
    target.add_argument("--eval-every", type=_positive(int), default=8,
                        help="steps between evaluations (default 8)")
    target.add_argument("--floor-steps", type=_positive(int), default=96,
                        help="steps the floor mode times (default 96: over 24 its step moved "
                             "by 40%% between runs on a shared 2-core machine)")
    train = p.add_argument_group("training")
    train.add_argument("--seed", type=int, default=0, help="weights, batches, compressors")
    train.add_argument("--batch", type=_positive(int),
                       help="items per rank per step (lm: windows, default 8; cnn: 32)")
    train.add_argument("--lr", type=_positive(float), help="AdamW's (lm 3e-3, cnn 2e-3)")
    train.add_argument("--val-items", type=_positive(int), default=256,
                       help="lm: validation windows (default 256)")
    train.add_argument("--lm-dim", type=_positive(int), default=Sizes.lm_dim)
    train.add_argument("--lm-layers", type=_positive(int), default=Sizes.lm_layers)
    train.add_argument("--lm-heads", type=_positive(int), default=Sizes.lm_heads)
    train.add_argument("--lm-context", type=_positive(int), default=Sizes.lm_context)
    train.add_argument("--cnn-width", type=_positive(int), default=Sizes.cnn_width)
    compressors = p.add_argument_group("compressors")
    compressors.add_argument("--powersgd-rank", type=_positive(int), default=4,
                             help="rank of both PowerSGD modes (default 4)")
    compressors.add_argument("--diloco-h", type=_positive(int), default=8,
                             help="gs-diloco's inner steps per sync (default 8)")
    compressors.add_argument("--local-sgd", type=_positive(int), default=8, metavar="H",
                             help="gs-auto-local's largest H (Auto(local_sgd=H); default 8)")
    compressors.add_argument("--local-overlap", type=int, default=0, metavar="D",
                             help="gs-auto-local's most steps a sync may run behind "
                                  "(Auto(local_overlap=D); default 0: at once)")
    compressors.add_argument("--outer-lr", type=_positive(float), default=0.7)
    compressors.add_argument("--outer-momentum", type=float, default=0.9)
    compressors.add_argument("--diloco-sync", choices=("int8", "int4", "bf16", "fp32"),
                             default="int8",
                             help="gs-diloco's outer gradient on the wire (default int8, "
                                  "with error feedback)")
    compressors.add_argument("--diloco-fp32", action="store_const", dest="diloco_sync",
                             const="fp32", help="the same as --diloco-sync fp32")
    compressors.add_argument("--streaming-fragments", type=_positive(int), default=1,
                             metavar="F", help="gs-streaming's fragments, synced in turn "
                                               "(default 1: the whole model at once)")
    compressors.add_argument("--streaming-delay", type=_positive(int), default=2, metavar="D",
                             help="inner steps each gs-streaming sync overlaps before it lands "
                                  "(default 2); below --diloco-h // F")
    compressors.add_argument("--streaming-overwrite", action="store_true",
                             help="gs-streaming's landings overwrite the steps taken in flight "
                                  "by the new anchor (DiLoCo(mix=0)) instead of keeping them "
                                  "(carry=True, the default)")
    compressors.add_argument("--bucket-cap-mb", type=_positive(float), metavar="MB",
                             help="DDP's bucket_cap_mb in every DDP mode but gloo-powersgd, "
                                  "which keeps one bucket (default DDP's own, 25)")
    compressors.add_argument("--no-overlap", action="store_true",
                             help="gradsync's hooks reduce inside the hook call instead of "
                                  "behind backward (HookState(overlap=False))")
    out = p.add_argument_group("output")
    out.add_argument("--verbose", action="store_true", help="echo the ranks' output")
    out.add_argument("--markdown", action="store_true", help="print the report as Markdown")
    out.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE")
    return p


def settings_of(options, hosts: int, data: str) -> dict:
    """What every rank reads (``compress_rank.py``): the options, the task's defaults filled."""
    if options.task == "cnn" and options.target_loss is not None:
        raise ValueError("the cnn task's target is --target-accuracy")
    if options.task == "lm" and options.target_accuracy is not None:
        raise ValueError("the lm task's target is --target-loss")
    if options.task == "lm" and options.lm_dim % options.lm_heads:
        raise ValueError(f"--lm-dim {options.lm_dim} is not a multiple of --lm-heads "
                         f"{options.lm_heads}")
    defaults = _DEFAULTS[options.task]
    return {"task": options.task, "data": data, "hosts": hosts,
            "ranks_per_host": options.ranks_per_host, "seed": options.seed,
            "target_loss": options.target_loss if options.target_loss is not None
            else defaults["target_loss"],
            "target_accuracy": options.target_accuracy if options.target_accuracy is not None
            else defaults["target_accuracy"], "max_steps": options.max_steps,
            "minutes": options.minutes, "eval_every": options.eval_every,
            "floor_steps": options.floor_steps,
            "batch": options.batch or defaults["batch"], "lr": options.lr or defaults["lr"],
            "val_items": options.val_items,
            "sizes": {"lm_dim": options.lm_dim, "lm_layers": options.lm_layers,
                      "lm_heads": options.lm_heads, "lm_context": options.lm_context,
                      "cnn_width": options.cnn_width},
            "powersgd_rank": options.powersgd_rank, "diloco_h": options.diloco_h,
            "local_sgd": options.local_sgd, "local_overlap": options.local_overlap,
            "outer_lr": options.outer_lr, "outer_momentum": options.outer_momentum,
            "diloco_sync": options.diloco_sync,
            "streaming_fragments": options.streaming_fragments,
            "streaming_delay": options.streaming_delay,
            "streaming_carry": not options.streaming_overwrite,
            "bucket_cap_mb": options.bucket_cap_mb, "overlap": not options.no_overlap,
            "collective_timeout": 120 + 60 * options.minutes,
            "delay": options.delay}


def _deadline(s: dict) -> float:
    """Seconds a job may take: start-up, its training budget, and its evaluations."""
    return 180 + 3 * 60 * s["minutes"]


def _run_mode(cluster: Cluster, s: dict, folder: str, rate: str, mode: str,
              verbose: bool) -> dict:
    result = os.path.join(folder, f"{rate}.{mode}.json")
    settings = os.path.join(folder, "settings.json")
    argv = [sys.executable, "-m", "gradsync.bench.compress_rank", "--settings", settings,
            "--mode", mode, "--result", result]
    lock = threading.Lock()

    def echo(slot, line: str) -> None:
        with lock:
            sys.stdout.write(f"[{mode} {slot.rank}] {line}" + ("" if line.endswith("\n")
                                                               else "\n"))

    # The library's defaults, the heartbeat's included: a live rank taken for lost on a busy
    # machine is a defect to see, not to hide (beats need no GIL since issue 36's fix).
    results = run(cluster, argv, timeout=_deadline(s), stop_on_failure=True,
                  on_line=echo if verbose else None)
    failed = [r for r in results if r.returncode != 0 and not r.stopped]
    timed_out = [r.rank for r in results if r.timed_out]
    if failed or timed_out or not os.path.exists(result):
        if failed:
            first = min(failed, key=lambda r: r.ended)
            tail = first.output.strip().splitlines()[-1:] or [""]
            why = f"rank {first.rank} exited {first.returncode}: {tail[0]}"
        elif timed_out:
            why = f"ranks {timed_out} passed the {_deadline(s):g} s deadline"
        else:
            why = "rank 0 wrote no result"
        return {"rate": rate, "mode": mode, "failed": why,
                "output_tail": "".join(r.output[-2000:] for r in results)}
    with open(result) as f:
        row = json.load(f)
    row["rate"] = rate
    return row


def _progress(row: dict) -> str:
    if row.get("failed"):
        return f"compress: {row['rate']} {row['mode']}: failed: {row['failed']}"
    if row["mode"] == "floor":
        return (f"compress: {row['rate']} floor: {row['seconds'] / row['steps']:.3f} s/step "
                f"over {row['steps']} steps, {row['bytes_per_step'] / 1e6:.3f} MB/step/host")
    final = row.get("final") or {}
    got = (f"target at step {row['steps_to_target']} in {row['time_to_target']:.1f} s"
           if row.get("reached") else f"{row['stop']} at step {row['steps']}")
    quality = "" if not final else f", val loss {final['loss']:.4f}"
    ran = "; ".join(row.get("allreduce") or ())  # a gradsync group's sizes and algorithms
    return (f"compress: {row['rate']} {row['mode']}: {got}{quality}, "
            f"{row['seconds'] / row['steps']:.3f} s/step, "
            f"{row['bytes_per_step'] / 1e6:.3f} MB/step/host" +
            (f"; allreduce {ran}" if ran else ""))


def drive(hosts: int, options) -> int:
    """Runs every mode at every rate on ``hosts`` emulated hosts; prints the report.

    Returns:
        0 when every mode ran to its end (reached the target or said why not); 1 when a job
        failed; 2 when the bench could not run (no namespaces, bad options).
    """
    if options.local_overlap < 0:
        print(f"gradsync bench compress: --local-overlap must be 0 or more, got "
              f"{options.local_overlap}", file=sys.stderr)
        return 2
    h, fragments, delay = options.diloco_h, options.streaming_fragments, options.streaming_delay
    if "gs-streaming" in options.modes and (fragments > h or delay >= h // fragments):
        print(f"gradsync bench compress: gs-streaming needs --streaming-fragments 1 to "
              f"--diloco-h ({h}) and --streaming-delay below --diloco-h // fragments "
              f"({h // max(1, fragments)}); got {fragments} and {delay}", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason is not None:
        print(f"gradsync bench compress emulates hosts with network namespaces, which need "
              f"root: {reason}", file=sys.stderr)
        return 2
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="gradsync-compress-") as folder:
            s = settings_of(options, hosts, folder)
            meta = prepare(options.task, folder)
            s["data_summary"] = meta
            with open(os.path.join(folder, "settings.json"), "w") as f:
                json.dump(s, f)
            print(f"compress: {hosts} hosts x {options.ranks_per_host} ranks, task "
                  f"{options.task}: {json.dumps(meta)}", flush=True)
            cluster = Cluster([(f"h{i}", options.ranks_per_host) for i in range(hosts)],
                              prefix="gscomp")
            with cluster:
                for rate in options.rates:
                    for host in cluster.hosts:
                        cluster.reshape(host.name, None if rate == "unshaped" else rate,
                                        options.delay)
                    for mode in options.modes:
                        row = _run_mode(cluster, s, folder, rate, mode, options.verbose)
                        rows.append(row)
                        print(_progress(row), flush=True)
    except (ValueError, NetnsError) as exc:
        print(f"gradsync bench compress: {exc}", file=sys.stderr)
        return 2
    s["params"] = next((r["params"] for r in rows if "params" in r), None)
    s.pop("data")
    data = cr.report(rows, s)
    sys.stdout.write(cr.format_markdown(data) if options.markdown else cr.format_text(data))
    if options.json:
        from ..testbed.rows import write_json

        write_json(data, options.json)
    return 1 if any(r.get("failed") for r in rows) else 0
