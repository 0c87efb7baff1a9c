"""Compression compute per element, measured here: the numbers a cluster file's
``compress_seconds_per_element`` takes (``compression.py`` charges them per bucket).

    python3 -m gradsync.simulate.calibrate [--elements 4M] [--repeats 5] [--json]

Each of gradsync's compressors (``gradsync.compress``: int8, int4, fp8, PowerSGD rank 4, random-k
1%; and the bf16/fp16 casts of ``gradsync.torch.compression``) reduces a bucket of float32
gradients on a one-rank ``Comm`` whose collectives return their input: what is timed is the
compressor's own work on the bucket (residual, quantize, the owner's sum, dequantize; P, Q and
the orthogonalisation), none of the network's. With n ranks the work per element is the same:
int8's owner sums n versions of 1/n of the bucket, PowerSGD's matrix products do not depend on
n. It prints the median seconds per element of ``repeats`` runs after one warm-up, and the
cluster-file lines to paste. It measures this machine's CPU (gradsync's compressors work on
CPU tensors); for a GPU cluster run it where the compressors will run, or leave the field out
and the simulator assumes the passes at ``reduce_bandwidth`` (and says so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

__all__ = ["measure", "main"]



def measure(elements: int = 4 << 20, repeats: int = 5, matrix: int = 1024) -> dict[str, float]:
    """Median seconds per element of each kind on this machine."""
    import torch

    from ..compress import FP8, Int4, Int8, PowerSGD, RandomK
    from ..compress.comm import Loopback
    from ..torch.compression import BF16Compressor, FP16Compressor

    rows = max(1, elements // matrix)
    shapes = [(rows, matrix)]
    flat = torch.randn(rows * matrix, generator=torch.Generator().manual_seed(0))
    comm = Loopback()

    def cast(codec):
        return lambda: codec.decompress(*codec.compress(flat))

    runs = {"bf16": cast(BF16Compressor), "fp16": cast(FP16Compressor)}
    for kind, c in (("int8", Int8()), ("int4", Int4()), ("fp8", FP8()),
                    ("powersgd", PowerSGD(rank=4)),
                    ("randomk", RandomK(ratio=0.01))):
        runs[kind] = lambda c=c: c.reduce(flat, shapes, comm, "calibrate", True)
    out = {}
    for kind, run in runs.items():
        run()  # warm-up: allocates the residuals
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        out[kind] = statistics.median(times) / flat.numel()
    return out


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m gradsync.simulate.calibrate",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=float, default=4 << 20, help="bucket size in elements")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print only the cluster-file fields")
    args = p.parse_args(argv)
    if args.elements < 1024 or args.repeats < 1:
        p.error("--elements must be at least 1024 and --repeats at least 1")
    rates = measure(int(args.elements), args.repeats)
    import os
    import platform

    fields = {"compress_seconds_per_element": {k: float(f"{v:.4g}") for k, v in rates.items()},
              "compress_source": f"python3 -m gradsync.simulate.calibrate on "
                                 f"{platform.node()} ({os.cpu_count()} CPUs, "
                                 f"{platform.processor() or platform.machine()}), "
                                 f"{int(args.elements)} elements, median of {args.repeats}"}
    if not args.json:
        for kind, per in rates.items():
            print(f"{kind:<9} {per * 1e9:8.2f} ns per element")
        print("# cluster-file fields:")
    print(json.dumps(fields, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
