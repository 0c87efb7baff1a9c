"""Local SGD and DiLoCo, streaming included: synchronise every H steps, not every step.

Each worker takes H *inner* steps with its own optimizer on its own data, touching the
network not at all; then the workers agree on an *outer gradient*, the distance each one
travelled since the last agreement, averaged over ranks::

    delta     = anchor - theta                   (per rank: anchor is the last synced point)
    delta_bar = mean over ranks of delta         (one allreduce, or int8 with error feedback)
    buf       = mu * buf + delta_bar             (outer momentum)
    anchor    = anchor - lr * (delta_bar + mu * buf)    (Nesterov; without it: lr * buf)
    theta     = anchor                           (every rank starts the next window there)

Outer lr 1 without momentum makes ``anchor - delta_bar`` the mean of the ranks' parameters:
plain local SGD (parameter averaging every H steps); DiLoCo (Douillard et al., 2023) uses
Nesterov momentum (lr 0.7, mu 0.9 in the paper) on top. H = 1, lr 1, mu 0 is synchronous
parameter averaging, to float rounding (``anchor - mean(anchor - theta)`` is not
``mean(theta)`` bit for bit).

**Streaming** (Douillard et al., 2025). The parameters are cut into F *fragments* (runs of
whole parameters in the order given, of about equal size). Fragment i is synced at the steps
where ``step % H == offset_i`` with ``offset_i = (i + 1) * H // F mod H``, so fragments take
turns and the bytes of one window are spread over it. A fragment's sync is *started* then
(its delta is taken, the reduction runs in the background) and *lands* ``delay`` inner steps
later: the reduction overlaps those steps. When it lands, the outer step runs on the
fragment's anchor, and the fragment's parameters become ``mix * theta + (1 - mix) * anchor``
(mix 0, the default: the new anchor; the paper's alpha), or, with ``carry=True``, the new
anchor plus what they moved since the sync started: the inner steps taken while the bytes
were on the wire are kept, not overwritten, and go into the fragment's next outer gradient
(delayed averaging, as in overlap local SGD; ranks then differ by those steps, as they do
mid-window anyway). Worked example, H = 4, F = 2,
delay 1: fragment 0 starts at steps 2, 6, 10 and lands at 3, 7, 11; fragment 1 starts at 4,
8 and lands at 5, 9. With F = 1 and delay 0 this is DiLoCo as above.

**Same order on every rank.** Syncs start at steps fixed by the schedule and land at their
start step plus ``delay``, never "when the bytes happen to arrive": landing waits for the
reduction if it is late. Reductions run one at a time, in the order they started, on one
background thread (a ``Comm``: in-memory, ``TorchComm`` on a torch.distributed group) or on
the Horovod API's controller (asynchronous collectives), so every rank issues the same
collectives in the same order and a run with fixed seeds is reproducible bit for bit.
Inner steps issue no collective here, but the group given to ``TorchComm`` must not carry
the script's own collectives while a sync is in flight (give DiLoCo a group of its own:
``dist.new_group()``).

**State** (``state_dict``, the elastic handler in ``elastic.py``): the step counter,
the anchors, the momentum buffers, the compressor's residuals and the syncs in flight. A
sync in flight is first waited for, and kept as its result (to be applied at its landing
step); after a fault its delta is kept instead and reduced again (``_orphan``).
"""

from __future__ import annotations

import concurrent.futures
import time

import torch

from .base import ReducingCompressor
from .comm import Comm

__all__ = ["DiLoCo", "fragments_of"]


def fragments_of(numels: list[int], count: int) -> list[list[int]]:
    """Cuts parameters (their sizes, in order) into ``count`` runs of about equal size: the
    parameter indices of each, every run holding at least one parameter."""
    n = len(numels)
    if not 1 <= count <= n:
        raise ValueError(f"{count} fragments of {n} parameters: need 1 to {n}")
    total, runs, start, done = sum(numels), [], 0, 0
    for i in range(count):
        last = n - (count - i - 1)  # leave one parameter to each fragment still to come
        done += numels[start]
        end, target = start + 1, total * (i + 1) / count
        # Take the next parameter while the run ends nearer its share with it than without.
        while end < last and done + numels[end] / 2 <= target:
            done += numels[end]
            end += 1
        runs.append(list(range(start, end)))
        start = end
    return runs


class _Pending:
    """One fragment's sync between its start and its landing."""

    __slots__ = ("fragment", "start", "land", "delta", "future", "result", "seconds")

    def __init__(self, fragment: int, start: int, land: int, delta: torch.Tensor):
        self.fragment, self.start, self.land, self.delta = fragment, start, land, delta
        self.future = None  # the reduction in flight (None: done, or to be issued again)
        self.result: torch.Tensor | None = None
        self.seconds: float | None = None  # the reduction's own time, where the reducer tells


class _CommReducer:
    """Runs reductions on one background thread over a ``Comm``, in submission order, each
    timed on that thread by ``clock`` (``took``)."""

    def __init__(self, comm: Comm, compressor: ReducingCompressor | None,
                 clock=time.perf_counter):
        self.comm, self.compressor, self.clock = comm, compressor, clock
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, flat: torch.Tensor, shapes: list, key: str):
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco")
        return self._pool.submit(self._timed, flat, shapes, key)

    def _timed(self, flat, shapes, key) -> tuple[torch.Tensor, float]:
        begin = self.clock()
        out = self._reduce(flat, shapes, key)
        return out, self.clock() - begin

    def _reduce(self, flat, shapes, key):
        if self.compressor is not None:
            return self.compressor.reduce(flat, shapes, self.comm, key, average=True)
        out = flat.clone()
        self.comm.allreduce_sum_(out)
        return out.div_(self.comm.size)

    @staticmethod
    def wait(future) -> torch.Tensor:
        return future.result()[0]

    @staticmethod
    def took(future) -> float:
        """Seconds the reduction of ``future`` (done) took on the thread."""
        return future.result()[1]


# Reducers of the front doors above this package, by name (``comm="horovod"``): each front
# door registers its own when it is imported (``gradsync.torch`` registers "horovod"), so
# this package, which the front doors use, imports none of them.
_REDUCERS: dict = {}


def register_reducer(name: str, factory) -> None:
    """``factory(compressor, process_set)`` -> an object with ``start(flat, shapes, key)``
    (a handle) and ``wait(handle)`` (the averaged tensor), used for ``DiLoCo(comm=name)``."""
    _REDUCERS[name] = factory


def reducer_for(comm, compressor: ReducingCompressor | None = None, process_set=None,
                clock=time.perf_counter):
    """What reduces over ``comm`` (a ``Comm``, or a front door's name: ``"horovod"``),
    through ``compressor`` (None: a float32 average): ``start(flat, shapes, key)`` and
    ``wait(handle)``."""
    if isinstance(comm, str):
        if comm not in _REDUCERS:
            raise ValueError(f"comm={comm!r}: no such front door"
                             + ("; import gradsync.torch first" if comm == "horovod" else ""))
        return _REDUCERS[comm](compressor, process_set)
    if isinstance(comm, Comm) or all(hasattr(comm, a) for a in ("allreduce_sum_", "size")):
        return _CommReducer(comm, compressor, clock)
    raise TypeError(f"comm must be a gradsync.compress Comm or 'horovod', got {comm!r}")


class DiLoCo:
    """Local SGD / DiLoCo / streaming DiLoCo around an inner optimizer (module docstring).

    Call ``step()`` where ``inner.step()`` was called: it takes the inner step, then starts
    and lands the outer syncs that the schedule puts at this step. Build it once the
    parameters are equal on every rank (``hvd.broadcast_parameters``, or the elastic state's
    first sync, which sends rank 0's anchors too): each rank's anchors start as its own
    parameters, and the outer step keeps ranks equal only from equal anchors.

    Args:
        params: the model's parameters (or the model), in the same order on every rank.
        inner: the inner optimizer (any ``torch.optim.Optimizer`` over ``params``), or None
            where the caller steps the parameters itself and calls only ``outer_step``
            (``compression="auto"``'s local SGD, ``auto_local.py``).
        sync_every: H, inner steps per window.
        outer_lr: the outer learning rate (1 with ``outer_momentum=0``: local SGD).
        outer_momentum: the outer momentum mu (0: none).
        nesterov: Nesterov momentum (DiLoCo's choice) rather than heavy ball.
        fragments: F, fragments synced in turn (1: all parameters at once).
        delay: inner steps between a fragment's start and its landing (0: at once; less
            than H // F, so that a fragment lands before the next one starts).
        mix: the share of the local parameters kept when a fragment lands (0: replaced by
            the new anchor).
        carry: with ``delay``, a fragment that lands becomes the new anchor plus the inner
            steps taken since its sync started (rather than ``mix``'s blend): no step's work
            is lost to the overlap.
        compressor: a ``ReducingCompressor`` for the outer gradient (``Int8()``: with error
            feedback); None: a float32 allreduce.
        comm: a ``Comm`` (``TorchComm(group)``, an in-memory one in tests), or ``"horovod"``
            for the Horovod API's collectives (``process_set``, default all ranks).
        name: prefixes the collectives' names and the compressor's keys.
        clock: times each reduction on the reducer's thread (``_Pending.seconds``), over a
            ``Comm`` (the Horovod API's collectives are not timed).
    """

    def __init__(self, params, inner: torch.optim.Optimizer | None, *, sync_every: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 fragments: int = 1, delay: int = 0, mix: float = 0.0, carry: bool = False,
                 compressor: ReducingCompressor | None = None, comm="horovod",
                 process_set=None, name: str = "diloco", clock=time.perf_counter):
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        self.params = [p for p in params]
        for what, value in (("sync_every", sync_every), ("fragments", fragments),
                            ("delay", delay)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{what} must be an int, got {value!r}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1, got {sync_every}")
        if not 1 <= fragments <= sync_every:
            raise ValueError(f"fragments must be 1 to sync_every={sync_every}, got {fragments}")
        if not 0 <= delay < max(1, sync_every // fragments):
            raise ValueError(f"delay must be 0 to {max(1, sync_every // fragments) - 1} "
                             f"(sync_every // fragments - 1), got {delay}")
        if not 0.0 <= mix < 1.0 or outer_lr <= 0 or not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"need 0 <= mix < 1, outer_lr > 0, 0 <= outer_momentum < 1; got "
                             f"mix={mix}, outer_lr={outer_lr}, outer_momentum={outer_momentum}")
        if carry and mix:
            raise ValueError(f"carry keeps the inner steps taken in flight; mix blends them "
                             f"away: give one, got carry=True and mix={mix}")
        if compressor is not None and not getattr(compressor, "owns_reduction", False):
            raise TypeError(f"compressor must be a gradsync.compress compressor (Int8(), ...), "
                            f"got {compressor!r}")
        self.inner, self.sync_every, self.fragments = inner, sync_every, fragments
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.delay, self.mix, self.compressor, self.name = delay, mix, compressor, name
        self.carry = bool(carry)
        self._reducer = reducer_for(comm, compressor, process_set, clock)
        self.groups = fragments_of([p.numel() for p in self.params], fragments)
        self.offsets = [((i + 1) * sync_every // fragments) % sync_every
                        for i in range(fragments)]
        self.step_count = 0
        self.anchors = [p.detach().clone() for p in self.params]
        self.momenta = [torch.zeros_like(p) for p in self.params]
        self.pending: list[_Pending] = []
        self.landed: list[tuple[int, int]] = []  # (step, fragment) of each landing: 16 B a sync

    # --------------------------------------------------------------------------- stepping
    def step(self, closure=None):
        """The inner step, then this step's outer syncs (module docstring)."""
        inner = self._inner()
        loss = inner.step(closure) if closure is not None else inner.step()
        self.outer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._inner().zero_grad(set_to_none=set_to_none)

    def _inner(self) -> torch.optim.Optimizer:
        if self.inner is None:
            raise RuntimeError("this DiLoCo has no inner optimizer: step the parameters "
                               "yourself and call outer_step()")
        return self.inner

    def outer_step(self) -> None:
        """Counts an inner step taken, lands the syncs due, starts the syncs scheduled."""
        self._reissue()
        self.step_count += 1
        t = self.step_count
        for fragment, offset in enumerate(self.offsets):
            if t % self.sync_every == offset:
                self._start(fragment, t, self.delay)
        self._land_due()

    # A caller keeping its own schedule (``auto_local.LocalSGD``: auto's windows) counts the
    # steps with ``tick`` and starts the syncs with ``sync_now``; ``outer_step``, which
    # starts them by ``sync_every``, is then not called.
    def tick(self) -> list[float | None]:
        """Counts an inner step taken and lands the syncs due, starting none: the seconds
        each landed reduction took (None where the reducer does not time them)."""
        self._reissue()
        self.step_count += 1
        return self._land_due()

    def sync_now(self, delay: int = 0) -> list[float | None]:
        """Starts every fragment's sync at this step, landing ``delay`` ticks later (0: now,
        and then returns the seconds each reduction took, as ``tick``)."""
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise ValueError(f"delay must be an int >= 0, got {delay!r}")
        if any(p.land > self.step_count for p in self.pending):
            raise RuntimeError("sync_now: a sync is still in flight")
        for fragment in range(self.fragments):
            self._start(fragment, self.step_count, delay)
        return self._land_due()

    def _land_due(self) -> list[float | None]:
        """Lands the syncs due at this step: the seconds each reduction took (None where the
        reducer does not time them)."""
        due = [p for p in self.pending if p.land <= self.step_count]
        for pending in due:
            self._land(pending)
        return [p.seconds for p in due]

    def _key(self, fragment: int) -> str:
        return f"{self.name}.fragment{fragment}"

    def _start(self, fragment: int, t: int, delay: int) -> None:
        members = self.groups[fragment]
        with torch.no_grad():
            delta = torch.cat([(self.anchors[i] - self.params[i].detach()).reshape(-1).float()
                               for i in members])
        pending = _Pending(fragment, t, t + delay, delta)
        self._issue(pending)
        self.pending.append(pending)

    def _issue(self, pending: _Pending) -> None:
        shapes = [tuple(self.params[i].shape) for i in self.groups[pending.fragment]]
        pending.future = self._reducer.start(pending.delta, shapes, self._key(pending.fragment))

    def _wait(self, pending: _Pending) -> None:
        if pending.future is not None:
            result = self._reducer.wait(pending.future)
            took = getattr(self._reducer, "took", None)
            pending.seconds = None if took is None else took(pending.future)
            pending.future, pending.result = None, result.reshape(-1).float()

    def _land(self, pending: _Pending) -> None:
        self._wait(pending)
        self.pending.remove(pending)
        result = pending.result
        assert result is not None  # _wait has just landed it
        mu, lr, offset = self.outer_momentum, self.outer_lr, 0
        carry = self.carry and pending.land > pending.start
        with torch.no_grad():
            for i in self.groups[pending.fragment]:
                anchor, param = self.anchors[i], self.params[i]
                n = anchor.numel()
                g = result[offset:offset + n].view(anchor.shape).to(anchor.dtype)
                moved = pending.delta[offset:offset + n].view(anchor.shape)
                offset += n
                if mu:
                    buf = self.momenta[i].mul_(mu).add_(g)
                    update = g.add(buf, alpha=mu) if self.nesterov else buf
                else:
                    update = g
                anchor.sub_(update, alpha=lr)
                if carry:
                    # theta - theta_start + new anchor, where theta_start = old anchor - moved
                    # and new anchor = old anchor - lr * update.
                    param.add_(moved.to(param.dtype)).sub_(update, alpha=lr)
                elif self.mix:
                    param.mul_(self.mix).add_(anchor, alpha=1.0 - self.mix)
                else:
                    param.copy_(anchor)
        self.landed.append((self.step_count, pending.fragment))

    def use_comm(self, comm) -> None:
        """Reduces over ``comm`` from now on (a torch.distributed group formed again after a
        fault: ``TorchComm(new_group)``); the syncs in flight are orphaned (``_orphan``)."""
        if not isinstance(self._reducer, _CommReducer):
            raise TypeError("use_comm is for a DiLoCo over a Comm; the Horovod API's follows "
                            "the job's re-formations by itself")
        self._orphan()
        self._reducer = _CommReducer(comm, self.compressor, self._reducer.clock)

    def finish(self) -> None:
        """Lands every sync in flight now (at the end of training)."""
        for pending in list(self.pending):
            self._land(pending)

    # --------------------------------------------------------------------------- state
    def settle(self) -> None:
        """Waits for the reductions in flight (their results are kept, applied at their
        landing step): the state then holds nothing that a background thread still writes."""
        for pending in self.pending:
            self._wait(pending)

    def _orphan(self) -> None:
        """After a fault: the reductions in flight belong to a world that is gone. Their
        deltas are kept and reduced again, by every member of the new world, at the next
        step: the fragment in flight is the only work redone."""
        for pending in self.pending:
            if pending.future is not None:
                pending.future = None
                pending.result = None
        # A reduction cut by a fault has failed, or waits in a collective that will fail, so
        # it writes nothing more. One that could still complete (its peers alive) might write
        # a compressor tensor of the state loaded next: wait for it first (``settle``).
        if isinstance(self._reducer, _CommReducer) and self._reducer._pool is not None:
            self._reducer._pool.shutdown(wait=False)
            self._reducer._pool = None

    def _reissue(self) -> None:
        for pending in self.pending:
            if pending.future is None and pending.result is None:
                self._issue(pending)

    def state_dict(self) -> dict:
        """The outer state (copies); waits for the syncs in flight first."""
        self.settle()
        return {"settings": self._settings(), "step": self.step_count,
                "anchors": [a.clone() for a in self.anchors],
                "momenta": [m.clone() for m in self.momenta],
                "pending": [{"fragment": p.fragment, "start": p.start, "land": p.land,
                             "delta": p.delta.clone(),
                             "result": None if p.result is None else p.result.clone()}
                            for p in self.pending],
                "compressor": None if self.compressor is None else self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Takes a ``state_dict()`` back (the model's parameters are the caller's to load)."""
        if state.get("settings") != self._settings():
            raise ValueError(f"a DiLoCo state of {state.get('settings')} cannot be loaded into "
                             f"{self._settings()}")
        self._orphan()
        shapes = [tuple(p.shape) for p in self.params]
        if [tuple(a.shape) for a in state["anchors"]] != shapes:
            raise ValueError("the DiLoCo state's anchors do not match the parameters' shapes")
        self.step_count = int(state["step"])
        self.anchors = [a.clone() for a in state["anchors"]]
        self.momenta = [m.clone() for m in state["momenta"]]
        self.pending = []
        for p in state["pending"]:
            land = int(p["land"])
            pending = _Pending(int(p["fragment"]), int(p.get("start", land - self.delay)), land,
                               p["delta"].clone())
            pending.result = None if p["result"] is None else p["result"].clone()
            self.pending.append(pending)
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])

    def _settings(self) -> dict:
        return {"sync_every": self.sync_every, "fragments": self.fragments,
                "groups": [list(g) for g in self.groups], "delay": self.delay,
                "compressor": None if self.compressor is None else self.compressor.describe()}

    def elastic_handler(self, bcast_object=None):
        """The handler an elastic ``State`` uses for this value (``elastic.py``)."""
        from .elastic import DiLoCoHandler

        return DiLoCoHandler(self, bcast_object)
