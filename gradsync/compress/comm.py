"""The three collectives a compressor needs, on a gradsync World or a torch.distributed group.

A compressor sees only this narrow interface (as the collectives see only a transport's
pairs), so the Horovod API, a DDP hook and the tests' in-memory group are interchangeable:

- ``allreduce_sum_(t)``: float32 ``t`` becomes the sum over ranks, in place, the same bytes
  on every rank (PowerSGD's factors, random-k's values, uncompressed small tensors);
- ``alltoall(send)``: ``send`` is ``size`` equal blocks of bytes (uint8), block j for rank j;
  returns ``size`` blocks, block s from rank s (int8's reduce-scatter). On a World and its
  views by the pairwise exchange or Bruck's algorithm, whichever the cost model predicts
  faster on the ranks' links (``collectives/alltoall.py``; ``chosen``);
- ``allgather(mine)``: every rank's equal-sized uint8 block, in rank order (int8's
  all-gather). On a World and its views by the ring or Bruck's algorithm, whichever the cost
  model predicts faster (``collectives/allgather.py``; ``chosen``).

Each call is one collective issued in program order; a compressor issues them in an order
fixed by its arguments alone, so every rank issues the same sequence.

Tiers (``tiers.py``: compression on the slow tier only). A Comm that knows where its ranks
are also offers:

- ``placement()``: the ``Topology`` of its ranks (rank i of the Comm is rank i there), or
  None when it does not know (then everything is one tier and compressed as above);
- ``sub(ranks)``: a Comm among ``ranks`` (this Comm's numbering, in that order; member j is
  ``ranks[j]``), called by exactly those ranks, in the same order on each;
- ``reduce_scatter_sum_(t, counts)``: full-precision float32, in place; after it member j's
  block (``counts[j]`` elements, blocks back to back in member order) holds the sum;
- ``gather_blocks_(t, counts)``: in place, every member's block from its member;
- ``reduce_to_leader_(t)``: full-precision float32, in place, the sum onto member 0 (the
  unit's *leader*; the others keep partial sums), for a compressor that needs whole tensors;
- ``broadcast_from_leader_(t)``: in place, member 0's ``t`` on every member. By default these
  two are ``reduce_scatter_sum_`` and ``gather_blocks_`` with one non-empty block, member 0's;
  ``ViewComm`` chooses a chain, a tree or a split by the cost model (``collectives/funnel.py``);
- ``begin_tiered(description)``: called once, on every rank, before a tiered reduction;
- ``prepare(groups)`` (where sub-groups must be made ahead, by every rank: ``TorchComm``):
  called with every sub-group the reduction will use, the same list on every rank.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..cluster import launch_env
from ..cluster.topology import Topology
from ..collectives import allgather as _allgather
from ..collectives import alltoall as _alltoall
from ..collectives import costs, doubling, funnel, halving_doubling, ring
from ..collectives.ops import ReduceOp, make_reducer
from ..pipeline import operations as ops

__all__ = ["Comm", "Loopback", "WorldComm", "ViewComm", "TorchComm", "chosen"]


class Comm:
    """Interface (see the module docstring)."""

    rank: int
    size: int

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        raise NotImplementedError

    def alltoall(self, send: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def placement(self) -> Topology | None:
        return None

    def sub(self, ranks: list[int]) -> "Comm":
        raise NotImplementedError

    def reduce_scatter_sum_(self, t: torch.Tensor, counts: list[int]) -> None:
        raise NotImplementedError

    def gather_blocks_(self, t: torch.Tensor, counts: list[int]) -> None:
        raise NotImplementedError

    def reduce_to_leader_(self, t: torch.Tensor) -> None:
        self.reduce_scatter_sum_(t, [t.numel()] + [0] * (self.size - 1))

    def broadcast_from_leader_(self, t: torch.Tensor) -> None:
        self.gather_blocks_(t, [t.numel()] + [0] * (self.size - 1))

    def begin_tiered(self, description: str) -> None:
        pass


class Loopback(Comm):
    """A Comm of one rank: every collective returns its input. What a compressor's own
    arithmetic costs, timed without the network (``auto.py``'s candidates, ``gradsync
    simulate``'s calibration)."""

    rank, size = 0, 1

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        pass

    def alltoall(self, send: torch.Tensor) -> torch.Tensor:
        return send.clone()

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        return mine.clone()


_SUM32 = make_reducer(ReduceOp.SUM, np.dtype(np.float32))


class ViewComm(Comm):
    """Some ranks of a World (a view of its communicator), inside one tiered reduction.

    Opens no collective of its own: ``WorldComm.begin_tiered`` opened one for the whole
    tiered reduction, and its sub-steps pair up their messages by the order in which every
    rank walks them (as the hierarchical allreduce's views do, ``collectives/hierarchical``).
    So it needs no description per call, and ranks that take part in different sub-steps
    (the owners of different blocks) never count their collectives differently.

    ``topology``: the job's, for the cost model's choices on the view's ranks, the same on
    every rank: each allreduce's algorithm (``SUB_ALLREDUCES``), the alltoall's (pairwise or
    Bruck's), the allgather's (the ring or Bruck's) and the funnel's schedule
    (``collectives/funnel.py``)."""

    def __init__(self, view, config, topology: Topology):
        self.view, self.config, self.topology = view, config, topology
        self.rank, self.size = view.rank, view.size

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        flat = t.numpy().reshape(-1)
        if self.size == 1 or flat.size == 0:
            return
        algorithm = self._chosen("allreduce", flat.nbytes)
        if algorithm == "doubling":
            doubling.allreduce(self.view, flat, _SUM32)
        elif algorithm == "halving_doubling":
            halving_doubling.allreduce(self.view, flat, _SUM32)
        else:
            ring.allreduce(self.view, flat, _SUM32, self.config.chunk_bytes)

    def alltoall(self, send: torch.Tensor) -> torch.Tensor:
        out = np.empty(send.numel(), dtype=np.uint8)
        wire = send.numpy()
        _alltoall.uniform(self.view, wire, out, self._chosen("alltoall", wire.nbytes))
        return torch.from_numpy(out)

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        n, block = self.size, mine.numel()
        out = np.empty(n * block, dtype=np.uint8)
        out[self.rank * block:(self.rank + 1) * block] = mine.numpy()
        if n > 1 and block:
            _allgather.uniform(self.view, out, self._chosen("allgather", out.nbytes),
                               self.config.chunk_bytes)
        return torch.from_numpy(out)

    def sub(self, ranks: list[int]) -> "ViewComm":
        return ViewComm(self.view.view(ranks), self.config, self.topology)

    def reduce_scatter_sum_(self, t: torch.Tensor, counts: list[int]) -> None:
        if self.size > 1:
            ring.reduce_scatter(self.view, t.numpy(), counts, _SUM32, self.config.chunk_bytes)

    def gather_blocks_(self, t: torch.Tensor, counts: list[int]) -> None:
        if self.size > 1:
            ring.allgather(self.view, t.numpy(), counts, self.config.chunk_bytes)

    def reduce_to_leader_(self, t: torch.Tensor) -> None:
        flat = t.numpy().reshape(-1)
        funnel.reduce(self.view, flat, _SUM32, self.config.chunk_bytes,
                      self.schedule_of(flat.nbytes))

    def broadcast_from_leader_(self, t: torch.Tensor) -> None:
        flat = t.numpy().reshape(-1)
        funnel.broadcast(self.view, flat, self.config.chunk_bytes,
                         self.schedule_of(flat.nbytes))

    def schedule_of(self, nbytes: int) -> str:
        """The funnel's schedule for ``nbytes`` on this view's ranks (``funnel.schedule``)."""
        return self._chosen("funnel", nbytes)

    def _chosen(self, what: str, nbytes: int) -> str:
        """The cost model's choice for ``what`` of ``nbytes`` on this view's ranks
        (``chosen``)."""
        return chosen(what, self.topology, self.view.ranks, nbytes, self.config.chunk_bytes)


def chosen(what: str, topology: Topology, ranks: Sequence[int], nbytes: int,
           chunk_bytes: int) -> str:
    """The cost model's choice for ``what`` (``"funnel"``, ``"allreduce"``, ``"alltoall"`` or
    ``"allgather"``) of ``nbytes`` on ``ranks`` of ``topology`` (the alltoall's and the
    allgather's ``nbytes``: all of their blocks), worked out once per topology, ranks and size
    (``_CHOSEN``): it depends on nothing else, so every rank makes the same."""
    key = (what, id(topology), tuple(ranks), nbytes, chunk_bytes)
    hit = _CHOSEN.get(key)
    if hit is not None and hit[0] is topology:
        return hit[1]
    fabric = costs.RankFabric(topology, ranks)
    if what == "funnel":
        choice = funnel.schedule(fabric, nbytes, chunk_bytes)
    elif what == "alltoall":
        choice = costs.cheapest_alltoall(fabric, nbytes)
    elif what == "allgather":
        choice = costs.cheapest_allgather(fabric, nbytes)
    else:
        choice = costs.cheapest(fabric, nbytes, SUB_ALLREDUCES)
    if len(_CHOSEN) >= 4096:  # a training job's buckets come in a few sizes
        _CHOSEN.clear()
    _CHOSEN[key] = (topology, choice)
    return choice


SUB_ALLREDUCES = ("doubling", "halving_doubling", "ring")
"""What ``ViewComm.allreduce_sum_`` chooses from, by the cost model on the view's ranks (the
planner's candidates less the two that only reorder or split a group across tiers: a
tiered reduction's sub-group already lies within one tier)."""

_CHOSEN: dict[tuple, tuple[Topology, str]] = {}
"""``chosen``'s choices by (what, topology's id, ranks, bytes, chunk_bytes), with
the topology they were made for (an id can be reused once it is gone): the cost model
enumerates every message of every step, which a step of training should not pay for each
bucket."""


class WorldComm(Comm):
    """On a gradsync World, from the thread that runs the World's collectives (the process
    set's controller runs a compressed allreduce as one operation, ``torch/requests.py``).

    ``name`` prefixes the sub-collectives' descriptions, so ranks that disagree fail at the
    first frame with both names in the report."""

    def __init__(self, world, name: str):
        self.world, self.name = world, name
        self.rank, self.size = world.rank, world.size
        self._calls = 0

    def _next(self, what: str) -> str:
        self._calls += 1
        return f"{self.name} #{self._calls} {what}"

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        flat = t.numpy().reshape(-1)
        ops.allreduce(self.world, flat, flat.dtype, ReduceOp.SUM,
                      name=self._next("allreduce"), shape=flat.shape)

    def alltoall(self, send: torch.Tensor) -> torch.Tensor:
        n = self.size
        block = send.numel() // n
        out = np.empty(send.numel(), dtype=np.uint8)
        world = self.world
        wire = send.numpy()
        how = chosen("alltoall", world.topology, range(n), wire.nbytes, world.config.chunk_bytes)
        # The choice in the description: ranks that chose differently fail at the first frame.
        world.comm.begin(f"compressed alltoall '{self._next('alltoall')}' uint8[{n}x{block}] "
                         f"by {how}", world.config.check_collectives)
        if n == 1:
            out[:] = wire
        else:
            _alltoall.uniform(world.comm, wire, out, how)
        return torch.from_numpy(out)

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        n, block = self.size, mine.numel()
        out = np.empty(n * block, dtype=np.uint8)
        out[self.rank * block:(self.rank + 1) * block] = mine.numpy()
        world = self.world
        how = chosen("allgather", world.topology, range(n), out.nbytes, world.config.chunk_bytes)
        # The choice in the description: ranks that chose differently fail at the first frame.
        world.comm.begin(f"compressed allgather '{self._next('allgather')}' uint8[{n}x{block}] "
                         f"by {how}", world.config.check_collectives)
        if n > 1 and block:
            _allgather.uniform(world.comm, out, how, world.config.chunk_bytes)
        return torch.from_numpy(out)

    def placement(self) -> Topology:
        return self.world.topology

    def begin_tiered(self, description: str) -> None:
        world = self.world
        world.comm.begin(f"tiered '{self._next('reduction')}' {description}",
                         world.config.check_collectives)

    def sub(self, ranks: list[int]) -> ViewComm:
        return ViewComm(self.world.comm.view(ranks), self.world.config, self.world.topology)


class TorchComm(Comm):
    """On a ``torch.distributed`` process group (``None``: the default group), any backend
    that has all_reduce, all_to_all_single and all_gather_single (all_gather_into_tensor before
    torch 2.13) for CPU tensors (gloo, gradsync).

    Tiers. ``placement()`` gathers every member's host name (``GRADSYNC_HOSTNAME``, else the
    system's) once, unless ``topology`` was given (to name groups of hosts); only for a group
    of every rank of the job (the default group, or one as large): the sub-groups are made by
    ``new_group``, which every rank of the job must call, in the same order. ``prepare``
    makes them all at once, from the list that ``tiers.subgroups`` derives from the
    placement alone (the same on every rank), once per process and set of ranks; ``sub``
    then finds them. Their reduce-scatter and block gather are full-precision all_reduces
    of the whole tensor (the block gather with zeros outside each member's block, which adds
    nothing): twice the bytes of a reduce-scatter on the fast tier, but every backend has
    all_reduce for every size, where gloo's reduce-scatter and all-gather want equal blocks."""

    def __init__(self, group=None, topology: Topology | None = None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if topology is not None and topology.size != self.size:
            raise ValueError(f"the topology places {topology.size} ranks but the group has "
                             f"{self.size}")
        self._topology = topology
        self._placed = False

    def placement(self) -> Topology | None:
        if not self._placed:
            self._placed = True
            if self.size != self.dist.get_world_size():
                self._topology = None  # (class docstring: sub-groups need every rank)
            elif self._topology is None:
                names: list = [None] * self.size
                self.dist.all_gather_object(names, launch_env.host_name(), group=self.group)
                self._topology = Topology.from_hosts(names)
        return self._topology

    def _global(self, ranks) -> tuple[int, ...]:
        dist = self.dist
        return tuple(r if self.group is None else dist.get_global_rank(self.group, r)
                     for r in ranks)

    def _where(self, ranks) -> tuple:
        # Keyed by the default group too: a job that re-initialises starts afresh.
        return (id(self.dist.group.WORLD), self.dist.get_backend(self.group),
                self._global(ranks))

    def prepare(self, groups: list[list[int]]) -> None:
        """Makes the sub-groups ``groups`` (this Comm's ranks) not made yet: every rank of
        the job calls it with the same list, and calls ``new_group`` for the same ones."""
        for ranks in groups:
            where = self._where(ranks)
            if where not in _SUBGROUPS:
                group = self.dist.new_group(list(where[2]), backend=where[1], sort_ranks=False)
                _SUBGROUPS[where] = group if self.rank in ranks else None

    def sub(self, ranks: list[int]) -> "TorchComm":
        group = _SUBGROUPS.get(self._where(ranks))
        if group is None:
            raise RuntimeError(f"no sub-group of ranks {list(ranks)} was prepared on rank "
                               f"{self.rank}")
        return TorchComm(group)

    def reduce_scatter_sum_(self, t: torch.Tensor, counts: list[int]) -> None:
        if self.size > 1:
            self.dist.all_reduce(t, group=self.group)

    def gather_blocks_(self, t: torch.Tensor, counts: list[int]) -> None:
        if self.size == 1:
            return
        lo = sum(counts[:self.rank])
        t[:lo] = 0.0
        t[lo + counts[self.rank]:] = 0.0
        self.dist.all_reduce(t, group=self.group)

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        self.dist.all_reduce(t, group=self.group)

    def alltoall(self, send: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(send)
        self.dist.all_to_all_single(out, send, group=self.group)
        return out

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.size * mine.numel(), dtype=mine.dtype)
        # torch 2.13 names it all_gather_single (all_gather_into_tensor warns it is deprecated);
        # the same backend call under either name.
        gather = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        gather(out, mine, group=self.group)
        return out


_SUBGROUPS: dict = {}
"""``TorchComm.prepare``'s groups by (default group, backend, global ranks), once per process;
None on a rank outside the group."""
