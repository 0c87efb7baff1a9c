"""``gradsync simulate``: project a training step to any number of GPUs of a cluster.

    gradsync simulate --cluster summit --model params=60M,compute_ms=180,buckets=25MB \\
        --gpus 6,96,1536,27360 [--algorithm auto|ring|hierarchical|halving_doubling|doubling]
        [--compression none|bf16|int8|powersgd:4|randomk:0.01|diloco:100[+int8][@all|@hosts]]
        [--json [FILE]] [--plot scaling.png]
    gradsync simulate --validate [--measure] [--json [FILE]]

``--cluster`` takes a cluster file (JSON, or YAML with PyYAML; schema in
``gradsync/simulate/cluster.py`` and docs/simulate.md) or the name of a shipped one. Per GPU
count it prints the step time, the communication left exposed after overlapping backward,
the time waited for the slowest rank (the cluster's ``jitter_cv`` and ``persistent_cv``, 0
unless the file or ``--model jitter_cv=,persistent_cv=`` sets them), the scaling efficiency
against one GPU, the busiest tier, the compression's compute per step and the megabytes one
rank sends per step (compressed / uncompressed), and the algorithm each bucket ran.
``--compression`` (or ``--model compression=``) models gradsync's compressors: their bytes,
their compute (the cluster file's ``compress_seconds_per_element``, measured by
``python3 -m gradsync.simulate.calibrate``, else assumed from its ``reduce_bandwidth``), the
tiers they compress, and local SGD's and DiLoCo's sync every H steps (docs/simulate.md).
``--plot`` (needs matplotlib: ``pip install 'gradsync[simulate]'``) draws efficiency and
step time against GPU count, one line per algorithm. ``--validate`` prints the validation
points, predicted against observed, then the sources and assumptions of each point and
cluster file; ``--measure`` adds the measured-here points (root, about twenty minutes): training
steps on 3 and 4 ranks, allreduces on 16 to 64 ranks over 4 to 16 emulated hosts.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from ..testbed.rows import add_json_option, write_json
from ..errors import ConfigError
from dataclasses import replace

from .cluster import load, shipped
from .compression import parse as parse_compression
from .compression import rate
from .step import ALGORITHMS, CANDIDATES, check, parse_model, simulate

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradsync simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to simulate")
    what.add_argument("--cluster", help=f"cluster file, or a shipped one: {', '.join(shipped())}")
    what.add_argument("--model", help="params=60M,compute_ms=180[,buckets=25MB,backward=0.67,"
                                      "update_ms=0,bytes_per_param=4,compression=int8,"
                                      "matrix=1024x1024,jitter_cv=0.02,persistent_cv=0.01]")
    what.add_argument("--gpus", help="GPU counts, comma-separated, e.g. 6,96,1536,27360")
    what.add_argument("--algorithm", choices=ALGORITHMS, default="auto",
                      help="allreduce algorithm; auto: the planner's choice per bucket")
    what.add_argument("--compression", help="none, fp16, bf16, int8, int4, fp8, powersgd:R, "
                      "randomk:RATIO, localsgd:H, diloco:H[+int8]; @slowest (default: only the "
                      "top tier, as gradsync), @hosts (across nodes) or @all (every tier); "
                      "overrides --model compression=")
    check = p.add_argument_group("validation")
    check.add_argument("--validate", action="store_true",
                       help="print the validation points: predicted, observed, error")
    check.add_argument("--measure", action="store_true",
                       help="with --validate: also run the measured-here points (root)")
    out = p.add_argument_group("output")
    add_json_option(out)
    out.add_argument("--plot", metavar="PNG", help="draw efficiency and step time (matplotlib)")
    return p


def _gpus(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--gpus {text!r}: expected integers such as 6,96,1536") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--gpus {text!r}: expected positive integers")
    return counts


def main(argv: "list[str] | None" = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.validate:
        return _validate(args)
    missing = [o for o in ("cluster", "model", "gpus") if getattr(args, o) is None]
    if missing:
        p.error(f"needs --{', --'.join(missing)} (or --validate)")
    if args.plot:
        _require_matplotlib()
    try:
        cluster = load(args.cluster)
        model = parse_model(args.model)
        if args.compression is not None:
            model = replace(model, compression=args.compression)
            check(model)
        counts = _gpus(args.gpus)
        rows = [simulate(cluster, model, n, args.algorithm) for n in counts]
    except (ConfigError, ValueError) as exc:
        p.error(str(exc))
    if args.json:
        write_json([r.as_dict() for r in rows], args.json)
    if args.json != "-":
        print(f"# {cluster.name}: {model.params / 1e6:.1f}M parameters "
              f"({model.gradient_bytes / 1e6:.0f} MB of gradients, "
              f"{len(model.buckets())} buckets), compute {model.compute * 1e3:.1f} ms, "
              f"algorithm {args.algorithm}, compression {rows[0].compression}, jitter_cv "
              f"{cluster.jitter_cv if model.jitter_cv is None else model.jitter_cv:g}, "
              f"persistent_cv "
              f"{cluster.persistent_cv if model.persistent_cv is None else model.persistent_cv:g}")
        _print_rate(cluster, model)
        print(f"{'gpus':>7} {'step_ms':>10} {'exposed_ms':>10} {'straggle_ms':>11} {'eff':>6}  "
              f"{'busiest tier':<14} {'compress_ms':>11} {'MB_sent':>15}  algorithms (buckets)")
        for r in rows:
            algs = ", ".join(f"{a} x{k}" for a, k in r.algorithms.items()) or "-"
            sent = f"{r.wire_bytes / 1e6:.2f}/{r.fp32_bytes / 1e6:.2f}"
            print(f"{r.gpus:>7} {r.step * 1e3:>10.2f} {r.exposed * 1e3:>10.2f} "
                  f"{r.straggle * 1e3:>11.2f} {r.efficiency:>6.1%}  {r.busiest_tier or '-':<14} "
                  f"{r.compress * 1e3:>11.2f} {sent:>15}  {algs}")
        print("# MB_sent: megabytes one rank sends per step, compressed/uncompressed"
              + (f" (amortised over the {rows[0].sync_every} steps between syncs)"
                 if rows[0].sync_every > 1 else ""))
    if args.plot:
        _plot(args.plot, cluster, model, counts, args.algorithm)
    return 0


def _print_rate(cluster, model) -> None:
    """Where the compression's compute rate comes from: measured, or assumed."""
    comp = parse_compression(model.compression)
    kinds = {comp.kind} | ({comp.outer.kind} if comp.outer else set())
    for kind in sorted(kinds - {"none", "localsgd", "diloco"}):
        per = rate(cluster, kind)
        if kind in cluster.compress_seconds_per_element:
            where = f"measured: {cluster.compress_source or 'the cluster file'}"
        else:
            where = ("assumed: the library's passes over memory at the cluster's "
                     "reduce_bandwidth (docs/simulate.md)")
        print(f"# {kind} compute {per * 1e9:.3g} ns per element ({where})")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("gradsync simulate --plot needs matplotlib: pip install 'gradsync[simulate]' "
                 "(or pip install matplotlib)")


def _plot(path: str, cluster, model, counts: list[int], algorithm: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (eff, step) = plt.subplots(1, 2, figsize=(10, 4))
    for alg in (algorithm,) if algorithm != "auto" else CANDIDATES + ("auto",):
        rows = [simulate(cluster, model, n, alg) for n in counts]
        # auto runs one of the others: dashed and black, so it shows on top of its choice.
        style = {"linestyle": "--", "color": "black", "marker": "x"} if alg == "auto" else \
            {"marker": "o"}
        eff.plot(counts, [100 * r.efficiency for r in rows], label=alg, **style)
        step.plot(counts, [r.step * 1e3 for r in rows], label=alg, **style)
    for ax, label in ((eff, "scaling efficiency (%)"), (step, "step time (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    eff.legend()
    fig.suptitle(f"{cluster.name}: {model.params / 1e6:.0f}M params, "
                 f"compute {model.compute * 1e3:.0f} ms, compression {model.compression}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"# wrote {path}")


def _validate(args) -> int:
    from .validate import published_rows

    rows = published_rows()
    if args.measure:
        from .measure import measured_rows
        rows += measured_rows()
    if args.json:
        write_json(rows, args.json)
        if args.json == "-":
            return 0
    print(f"{'point':<34} {'cluster':<20} {'gpus':>6} {'quantity':<12} {'predicted':>10} "
          f"{'observed':>9} {'error':>8} {'no jitter':>10} {'no persistent':>13}")
    for r in rows:
        if "allreduce_ms_predicted" in r:
            print(f"{r['point']:<34} {r['cluster']:<20} {r['gpus']:>6} {'allreduce ms':<12} "
                  f"{r['allreduce_ms_predicted']:>10.1f} {r['allreduce_ms_measured']:>9.1f} "
                  f"{r['error_pct']:>+7.1f}%  {r['of_bound']:.1%} of the link-limited bound")
        elif "step_ms_predicted" in r:
            print(f"{r['point']:<34} {r['cluster']:<20} {r['gpus']:>6} {'step ms':<12} "
                  f"{r['step_ms_predicted']:>10.1f} {r['step_ms_measured']:>9.1f} "
                  f"{r['error_pct']:>+7.1f}%")
        else:
            print(f"{r['point']:<34} {r['cluster']:<20} {r['gpus']:>6} {'efficiency':<12} "
                  f"{r['predicted']:>10.1%} {r['observed']:>9.1%} "
                  f"{r['error_points']:>+6.1f}pt {r['predicted_no_jitter']:>10.1%} "
                  f"{r['predicted_no_persistent']:>13.1%}")
    from .validate import POWERSGD_SHARE_OBSERVED, powersgd_share

    print(f"# pytorch#74148, 8 GPUs: the step with PowerSGD's P and Q allreduces over the step "
          f"without them: predicted {powersgd_share():.3f}, observed {POWERSGD_SHARE_OBSERVED:.3f} "
          f"(6.29/5.46)")
    if not args.measure:
        print("# measured-here points (training steps and allreduces of 16 to 64 ranks on "
              "emulated clusters): add --measure (root, about twenty minutes)")
    _print_sources(rows)
    return 0


def _print_sources(rows: list[dict]) -> None:
    """Where each published point's numbers and each cluster file's come from."""
    wrap = textwrap.TextWrapper(width=100, initial_indent="#   ", subsequent_indent="#     ")
    print("# sources and assumptions (docs/simulate.md explains the model):")
    for r in rows:
        if "source" in r:
            print(f"# {r['point']}:")
            print(wrap.fill(f"source: {r['source']}"))
            print(wrap.fill(f"assumed: {r['assumed']}"))
    described = set()
    for r in rows:
        if "allreduce_ms_predicted" in r and r["cluster"] not in described:
            described.add(r["cluster"])
            print(wrap.fill(f"{r['cluster']}: {r['hosts']} network namespaces of "
                            f"{r['gpus'] // r['hosts']} ranks, links at {r['rate']} each way "
                            "(gradsync/testbed/netns.py); the cluster is emulated-2x2's with "
                            "the host tier at the rate's TCP payload, x 1448/1514 "
                            "(gradsync/simulate/measure_allreduce.py)"))
    for name in dict.fromkeys(r["cluster"] for r in rows if r["cluster"] in shipped()):
        cluster = load(name)
        print(f"# cluster file {name} (gradsync/simulate/clusters/{name}.json):")
        print(wrap.fill(f"source: {cluster.source}"))
        print(wrap.fill(f"jitter_cv {cluster.jitter_cv:g}: {cluster.jitter_source or 'not set'}"))
        if cluster.persistent_cv or cluster.persistent_source:
            print(wrap.fill(f"persistent_cv {cluster.persistent_cv:g}: "
                            f"{cluster.persistent_source or 'not set'}"))
        for text in cluster.assumed:
            print(wrap.fill(f"assumed: {text}"))


if __name__ == "__main__":
    sys.exit(main())
