"""Which samples make which batch, which data server prepares it and which worker gets it.

Every data server and every worker computes the same *plan* of an epoch from the same few
numbers, so nothing about the assignment travels on the wire:

1. **Order.** The epoch's order is a permutation of the ``samples`` ids drawn from the seed
   and the epoch (``order``): the same seed gives the same order whatever the number of
   servers and workers.
2. **Partition.** Sample ``i`` belongs to data server ``i % servers``, every epoch, so a
   server decodes (and caches, ``cache.py``) the same samples each epoch. Each server takes
   its own samples in the epoch's order, leaves out those already ``done`` (a resumed epoch),
   and cuts them into batches of ``batch_size``; its last batch may be short.
3. **Interleave.** The servers' batches are dealt round by round: batch 0 of server 0, of
   server 1, ..., then batch 1 of each, skipping servers that have run out. The position in
   that sequence is the batch's *index* in the epoch.
4. **Deal.** Batch ``g`` goes to worker ``g % workers``.

A worked example: 10 samples, 2 servers, 2 workers, batches of 2, an order of
``[7 2 9 4 0 5 3 8 1 6]``. Server 0 owns the even ids and takes ``2 4 0 8 6``: batches
``[2 4] [0 8] [6]``; server 1 takes ``7 9 5 3 1``: ``[7 9] [5 3] [1]``. Interleaved:
``g0=[2 4]@s0 g1=[7 9]@s1 g2=[0 8]@s0 g3=[5 3]@s1 g4=[6]@s0 g5=[1]@s1``; worker 0 gets
g0, g2, g4 and worker 1 g1, g3, g5. Every sample is in exactly one batch and every batch goes
to exactly one worker: that is the exactly-once rule, and it holds for any ``done`` set,
which is how a resumed epoch (``Loader.load_state_dict``) serves only what is left.

**The global order** (``order="global"``). The plan above depends on the number of servers:
the interleave, not the permutation, decides which samples share a batch and which batch
comes first, so a job resumed or resized at other counts trains on another sequence. With
``order="global"`` the batches are cut from the permutation itself, and only the dealing
depends on the counts:

1. Leave out the ``done`` samples, keeping the permutation's order: the *rest*.
2. Batch ``g`` is ``rest[g * batch_size : (g + 1) * batch_size]`` (only the epoch's last
   batch may be short), its rows in the permutation's order.
3. Batch ``g`` goes to worker ``g % workers`` and is prepared by server ``g % servers``.

So batch ``g`` holds the same samples, in the same rows, at any number of workers and servers,
and a job of W workers trains, at its step ``k``, on batches ``k*W .. k*W + W-1``: samples
``[k*W*batch_size, (k+1)*W*batch_size)`` of the rest. A checkpoint taken between steps
(``Loader.state_dict``) marks a prefix of the permutation done, so the resumed job's rest is
the same permutation's suffix, cut at the same boundaries, whatever its counts. The price:
a server prepares whichever samples its batches hold, not a fixed share of the dataset, so its
cache (``cache.py``) no longer holds the same samples every epoch. The same example with
``order="global"``: ``g0=[7 2]@s0 g1=[9 4]@s1 g2=[0 5]@s0 g3=[3 8]@s1 g4=[1 6]@s0``; worker 0
gets g0, g2, g4 and worker 1 g1, g3; at 1 worker and 1 server the batches are the same.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["Batch", "ORDERS", "order", "plan", "worker_batches", "pack_mask", "unpack_mask",
           "STATE_VERSION"]

STATE_VERSION = 1
"""The version of the state dicts a Loader makes (``state_dict``) and reads: the epoch and a
``pack_mask`` of its delivered samples, with the Loader's samples, batch size and seed."""


ORDERS = ("servers", "global")
"""How batches are cut (the module docstring): ``servers``, each server's share cut on its own
and interleaved (a server prepares the same samples every epoch); ``global``, cut from the
permutation (the same batches at any number of workers and servers)."""


@dataclass(frozen=True)
class Batch:
    """One batch of an epoch's plan."""

    index: int
    """Position in the epoch's interleaved sequence of batches."""
    server: int
    """The data server that prepares it (owner of every sample in it)."""
    worker: int
    """The worker it is delivered to."""
    ids: np.ndarray
    """The sample ids, in the order the batch holds them."""


def order(samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's permutation of ``range(samples)``, fixed by ``seed`` and ``epoch``."""
    return np.random.default_rng([seed, epoch]).permutation(samples)


def plan(samples: int, batch_size: int, seed: int, epoch: int, servers: int, workers: int,
         done: np.ndarray | None = None, cut: str = "servers") -> list[Batch]:
    """The epoch's batches, in index order (see the module docstring).

    Args:
        samples: the dataset's length.
        batch_size: samples per batch (each server's last batch may have fewer).
        seed, epoch: fix the order.
        servers, workers: how many of each the job has.
        done: a boolean mask of ``samples`` entries; True samples are left out.
        cut: one of ``ORDERS``: how batches are cut from the order.
    """
    if cut not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {cut!r}")
    if batch_size < 1 or servers < 1 or workers < 1 or samples < 0:
        raise ValueError(f"need batch_size, servers, workers >= 1 and samples >= 0, got "
                         f"{batch_size}, {servers}, {workers}, {samples}")
    perm = order(samples, seed, epoch)
    if done is not None:
        if done.shape != (samples,):
            raise ValueError(f"the done mask has shape {done.shape}, the dataset {samples} "
                             "samples")
        perm = perm[~done[perm]]
    if cut == "global":
        return [Batch(g, g % servers, g % workers, perm[a:a + batch_size])
                for g, a in enumerate(range(0, len(perm), batch_size))]
    owner = perm % servers
    per_server = []
    for s in range(servers):
        mine = perm[owner == s]
        per_server.append([mine[a:a + batch_size] for a in range(0, len(mine), batch_size)])
    out: list[Batch] = []
    for k in range(max((len(b) for b in per_server), default=0)):
        for s in range(servers):
            if k < len(per_server[s]):
                g = len(out)
                out.append(Batch(g, s, g % workers, per_server[s][k]))
    return out


def worker_batches(batches: list[Batch], worker: int, server: int | None = None) -> list[Batch]:
    """The batches of ``worker`` in index order (only those of ``server`` when given)."""
    return [b for b in batches if b.worker == worker and (server is None or b.server == server)]


def pack_mask(mask: np.ndarray) -> str:
    """A boolean mask as compact text for a control message or a state dict."""
    return base64.b64encode(zlib.compress(np.packbits(mask).tobytes())).decode()


def unpack_mask(text: str, samples: int) -> np.ndarray:
    """The inverse of ``pack_mask``."""
    bits = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8)
    mask = np.unpackbits(bits, count=samples).astype(bool)
    if mask.shape != (samples,):
        raise ValueError(f"a done mask of {mask.size} samples for a dataset of {samples}")
    return mask
