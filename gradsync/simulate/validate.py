"""Validation points: what the simulator predicts against what was observed.

Two kinds. *Published* points reproduce a paper's scaling efficiency from the hardware (the
shipped cluster file, each number's source or assumption in it) and the model numbers below
(each with its source, or named as assumed). *Measured here* points run training steps on
an emulated cluster of network namespaces and compare the step time (``measure.py``; they
need root and take about a minute, so ``gradsync simulate --validate --measure`` runs them
and the slow test tier checks them).

Efficiency of a published point is ``step(baseline GPUs) / step(N GPUs)``, weak scaling, as
the papers report it. Each row also gives the prediction without stragglers
(``jitter_cv=0``, ``persistent_cv=0``) and without persistently slow GPUs only
(``persistent_cv=0``), so that what each term adds shows next to what the network costs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cluster import load
from .step import Model, simulate

__all__ = ["Point", "PUBLISHED", "predict", "published_rows"]


@dataclass(frozen=True)
class Point:
    name: str
    cluster: str
    model: Model
    gpus: int
    observed: float
    """Observed scaling efficiency (0..1)."""
    algorithm: str
    baseline: int
    source: str
    assumed: str


PUBLISHED = (
    Point("Horovod Inception V3", "horovod-512",
          Model(params=23.8e6, compute=64 / 142, bucket_bytes=64 << 20), 512, 0.90, "ring", 1,
          "arXiv:1802.05799: ~90% on 512 GPUs; 23.8M parameters (Szegedy et al. 2016); "
          "Horovod's 64 MB fusion buffer and NCCL 2 ring allreduce",
          "compute 64/142 s: batch 64 at 142 img/s, a P100 in TensorFlow's published "
          "tf_cnn_benchmarks (the paper gives no single-GPU step time)"),
    Point("Horovod VGG-16", "horovod-512",
          Model(params=138.4e6, compute=64 / 154, bucket_bytes=64 << 20), 512, 0.68, "ring", 1,
          "arXiv:1802.05799: 68% on 512 GPUs; 138.4M parameters (Simonyan & Zisserman 2014)",
          "compute 64/154 s: batch 64 at 154 img/s, a P100 in tf_cnn_benchmarks; gradients "
          "ready at an even rate (VGG's FC layers, 90% of its bytes, come out early, which "
          "the model does not know)"),
    Point("DDL ResNet-50", "ddl-256",
          Model(params=25.6e6, compute=32 / 219, bucket_bytes=64 << 20), 256, 0.95,
          "hierarchical", 1,
          "arXiv:1708.02188: 95% on 256 GPUs, ResNet-50, batch 32 per GPU; 25.6M parameters "
          "(He et al. 2016); DDL's topology-aware multi-ring is modelled by the hierarchical "
          "plan",
          "compute 32/219 s: a P100's ResNet-50 rate in tf_cnn_benchmarks (Caffe's is not in "
          "the paper); 64 MB buckets"),
    Point("Goyal et al. ResNet-50", "goyal-256",
          Model(params=25.6e6, compute=32 / 219, bucket_bytes=64 << 20), 256, 0.90, "auto", 8,
          "arXiv:1706.02677: ~90% from 8 to 256 GPUs, batch 32 per GPU; gradients "
          "allreduced as backward produces them (Caffe2/Gloo), hierarchical across servers",
          "compute 32/219 s as for DDL; 64 MB buckets; efficiency against one 8-GPU server "
          "as the paper measures it"),
    Point("Kurth et al. DeepLabv3+ (FP32)", "summit",
          Model(params=43.7e6, compute=2 * 14.41e12 / 13.13e12, bucket_bytes=64 << 20), 27360,
          0.907, "hierarchical", 1,
          "SC18 doi:10.1109/sc.2018.00054: 90.7% on 27,360 V100 GPUs in single precision, "
          "325.8 PF/s sustained; Horovod with hierarchical allreduce. The authors' code "
          "(github.com/azrael417/ClimDeepLearn, deeplab-tf-train.py): 'sustained' is an "
          "epoch's training FLOPs over its wall time, 'peak' the fastest single step; their "
          "Summit job scripts of 1 to 1,024 nodes exclude 70 to 99 named nodes "
          "(run_scripts/summit, run_scripts/bigruns_update, crappy_nodes.txt) found by "
          "timing every GPU alone "
          "(*_perftest.sh, --disable_horovod): persistently slow GPUs, modelled by "
          "summit.json's persistent_cv",
          "43.7M parameters, 14.41 TF per sample, batch 2 per GPU: assumed from the paper's "
          "network description; 13.13 TF/s per GPU = 325.8 PF/s / 27,360 / 0.907; 64 MB "
          "buckets: Horovod's default fusion threshold (25 MB or 128 MB move it by 0.2 "
          "points at most); baseline one GPU (the abstract does not say; one 6-GPU node "
          "as baseline gives 95.5%, docs/simulate.md); gradient lag 0 (lag 1, in their "
          "code, overlaps the allreduce with the whole next step: at most the 0.4% the "
          "network costs here)"),
)


def predict(point: Point, jitter: bool = True, persistent: bool = True) -> float:
    """The simulator's efficiency for a published point (``jitter=False``: as if every rank
    computed in exactly the model's time, no stragglers of either kind; ``persistent=False``:
    all GPUs equally fast, per-step jitter kept)."""
    cluster = load(point.cluster)
    model = point.model
    if not jitter:
        model = replace(model, jitter_cv=0.0, persistent_cv=0.0)
    elif not persistent:
        model = replace(model, persistent_cv=0.0)
    base = simulate(cluster, model, point.baseline, point.algorithm).step
    return base / simulate(cluster, model, point.gpus, point.algorithm).step


def published_rows() -> list[dict]:
    rows = []
    for p in PUBLISHED:
        got = predict(p)
        rows.append({"point": p.name, "cluster": p.cluster, "gpus": p.gpus,
                     "algorithm": p.algorithm, "predicted": got,
                     "predicted_no_jitter": predict(p, jitter=False),
                     "predicted_no_persistent": predict(p, persistent=False),
                     "jitter_cv": load(p.cluster).jitter_cv,
                     "persistent_cv": load(p.cluster).persistent_cv, "observed": p.observed,
                     "error_points": 100 * (got - p.observed), "source": p.source,
                     "assumed": p.assumed})
    return rows
