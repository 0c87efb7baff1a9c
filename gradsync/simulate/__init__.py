"""``gradsync simulate``: training steps at any scale, from the planner's cost model.

``cluster`` (the file schema and loader), ``fabric`` (the cost model's closed forms over tiers
of identical units), ``step`` (compute, buckets and their overlapped allreduces),
``compression`` (what gradsync's compressors and local SGD send and compute), ``validate``
(published points), ``measure`` (points measured here on emulated clusters), ``calibrate``
(compression compute per element, measured here), ``cli``.
"""

from .cluster import Cluster, load
from .step import Model, StepResult, parse_model, simulate

__all__ = ["Cluster", "Model", "StepResult", "load", "parse_model", "simulate"]
