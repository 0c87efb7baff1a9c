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

*Compressed* points (``COMPRESSED``) check the compression model (``compression.py``) the
same way, against a published run with a compressor: torch's PowerSGD hook at 3 Gbit/s
(pytorch/pytorch#74148). The issue also reports the run with PowerSGD's two allreduces
removed by hand, so ``powersgd_share`` compares what those two allreduces cost, predicted
against observed, apart from everything else the issue does not describe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cluster import load
from .step import Model, simulate

__all__ = ["Point", "PUBLISHED", "COMPRESSED", "predict", "published_rows", "powersgd_share"]


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


_74148 = ("pytorch/pytorch#74148 (2022-03-13, the issue's own text): torch's PowerSGD DDP "
          "hook, PyTorch 1.10, ResNet-50 on ImageNet, V100-32GB, 'the lowest bandwidth is "
          "3Gbit'; speed-up over one GPU 3.5 on 2 nodes x 2 GPUs, 5.23 on 3 x 2, 5.46 on 4 x 2, "
          "and 6.29 on 4 x 2 with the hook's P and Q allreduces removed by hand; 25.6M "
          "parameters (He et al. 2016); DDP's 25 MB buckets (bucket_cap_mb's default)")
_74148_ASSUMED = ("compute 32/360 s: batch 32 at about 360 images/s, a V100's fp32 ResNet-50 "
                  "training rate as I recall NVIDIA's published figures (not verified here; the "
                  "issue gives neither batch nor rate); PowerSGD rank 1 (the hook's default "
                  "matrix_approximation_rank; the issue does not say); every gradient matrix "
                  "taken as 512 x 4608 (ResNet-50's last-stage 3x3 convolutions); the hook "
                  "compresses on every rank (powersgd:1@all) and allreduces its uncompressed "
                  "tensors with the Ps, as gradsync's does (torch's hook sends them in a third "
                  "allreduce); speed-up against one GPU without DDP")
_RESNET50_V100 = Model(params=25.6e6, compute=32 / 360, bucket_bytes=25e6,
                       compression="powersgd:1@all", matrix=(512, 4608))

COMPRESSED = tuple(
    Point(f"pytorch#74148 PowerSGD r1, {gpus} GPUs", "pytorch-74148", _RESNET50_V100, gpus,
          speedup / gpus, "auto", 1, _74148, _74148_ASSUMED)
    for gpus, speedup in ((4, 3.5), (6, 5.23), (8, 5.46)))
"""The compressed check: efficiency = the issue's speed-up / GPUs."""

POWERSGD_SHARE_OBSERVED = 6.29 / 5.46
"""pytorch#74148 on 8 GPUs: the step with PowerSGD's P and Q allreduces over the step without
them (speed-up 6.29 without, 5.46 with)."""


def powersgd_share(point: "Point | None" = None) -> float:
    """Predicted step with PowerSGD's two allreduces over the step without them: the same
    run, each bucket's exchange only the allreduce of its uncompressed tensors (what the
    issue's hand-edited hook still sent), and no compression compute."""
    from .compression import call_time, powersgd_plan, shapes_of
    from .fabric import TierFabric
    from .step import CANDIDATES, _timeline
    from .straggle import straggler_factor

    point = point or COMPRESSED[-1]
    cluster, model = load(point.cluster), point.model
    fabric = TierFabric(cluster, point.gpus)
    times = []
    for nbytes in model.buckets():
        shapes = shapes_of(nbytes / model.bytes_per_param, model.matrix)
        plain = sum(int(s[0]) for s, p in zip(shapes, powersgd_plan(shapes, 1)) if p is None)
        times.append(call_time(fabric, ("allreduce", 4 * plain), CANDIDATES))
    slowest = model.compute * straggler_factor(point.gpus, cluster.jitter_cv,
                                               cluster.persistent_cv)
    without = _timeline(replace(model, compute=slowest), times)
    return simulate(cluster, model, point.gpus, point.algorithm).step / without


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
    for p in PUBLISHED + COMPRESSED:
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
