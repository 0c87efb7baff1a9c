"""``join()``: a rank that has run out of data keeps the others' gradient allreduces going.

Horovod's semantics: after ``join()`` a rank takes part in the other ranks' allreduces with
zeros until every rank has joined; then ``join()`` returns, on every rank, the rank that joined
last. Averages still divide by the full number of ranks, joined ones included.

How, without a coordinator. gradsync has no per-cycle negotiation (ranks issue the same
collectives in the same order, ``engine.py``), so a joined rank cannot ask what the others will
issue next. It does know what a DistributedOptimizer step issues: the gradient buckets, in their
fixed order (``buckets.py``). So a joined rank *follows* its process's DistributedOptimizer:
round after round it contributes zeros to each bucket's allreduce, under the same name, shape,
op and scaling. The first bucket carries the join flag, 1 from each training rank and 0 from
each joined one, so after the first allreduce of a round every joined rank knows whether anyone
still trains. The round in which the flag sums to zero is the last one: every rank is inside
``join()``. The ranks whose first round it was joined last; one Max allreduce tells all ranks
the highest of them.

Supported: while a rank is joined, the others run DistributedOptimizer steps (any number, with
any ``backward_passes_per_step``, ``synchronize``/``skip_synchronize``, GradScaler) and then
call ``join()``; with no DistributedOptimizer, ``join()`` is a barrier that returns the highest
rank. Not supported: any other collective on a training rank while another rank is joined (a
plain allreduce, a broadcast, SyncBatchNorm's statistics, a metric average): the joined rank is
issuing a bucket allreduce at that moment, so both fail with a CollectiveMismatchError naming
the two collectives (with ``check_collectives``, the default). Nor more than one
DistributedOptimizer in the process: ``join()`` raises ValueError, as it could not tell which
one the other ranks are stepping.
"""

from __future__ import annotations

import torch

from .. import api as gs
from ..collectives.ops import Max
from .optimizer import live_optimizers

__all__ = ["join"]


def join(device: int = -1) -> int:
    """Marks this rank as out of data; returns the last rank to join, once every rank has.

    Until every rank has joined, this rank contributes zeros to the others' gradient
    allreduces. Its own model is not updated meanwhile: broadcast the parameters from the
    returned rank afterwards (``broadcast_parameters(model.state_dict(), root_rank=last)``).

    Args:
        device: Horovod's device for the zero tensors; only -1 (CPU) is supported.

    Raises:
        ValueError: this process has more than one DistributedOptimizer.
        RuntimeError: called between backward() and step().
    """
    if device != -1:
        raise NotImplementedError(f"join(device={device}): gradsync.torch works on CPU tensors; "
                                  "call join() with the default device=-1")
    if gs.size() == 1:
        return gs.rank()
    followed = live_optimizers()
    if len(followed) > 1:
        raise ValueError(f"join() follows this process's DistributedOptimizer, but there are "
                         f"{len(followed)}: it cannot tell which one the other ranks step")
    joined_last = True
    if followed:
        optimizer = followed[0]
        optimizer._gs_require_idle("join")
        joined_last = not optimizer._gs_follow_round()
        if not joined_last:
            while optimizer._gs_follow_round():
                pass
    mine = torch.tensor([gs.rank() if joined_last else -1], dtype=torch.int64)
    return int(gs.allreduce(mine, op=Max, name="join.last_rank")[0])
