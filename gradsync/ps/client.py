"""The worker's side of parameter-server training: ``ParameterClient``.

    ps = gradsync.ps.ParameterClient(model, optimizer="sgd", lr=0.1, momentum=0.9, mode="sync")
    for x, y in batches:
        loss_fn(model(x), y).backward()
        ps.step()          # push the gradients, wait as the mode says, pull the parameters

The client lays every parameter end to end in one flat float32 buffer and makes the model's
float32 parameters views of it, so ``pull`` reads the servers' regions straight into the
model; gradients likewise live in one flat buffer (``p.grad`` are views of it) that ``push``
writes straight into this worker's slots on the servers. Server ``s`` owns the slice
``bounds[s]:bounds[s+1]`` of both (sharding.py). Each server has its own request thread here,
so pushes and pulls to several servers are in flight together.

The servers learn the model from the first worker's ``hello``; every worker must build the
same model with the same settings (a difference is a CollectiveMismatchError naming it).
Worker 0's initial parameters are what training starts from (as ``broadcast_parameters`` does
in allreduce training), unless ``restore`` names a checkpoint that ``save`` wrote.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import time
from typing import Any

import numpy as np

from ..errors import ConfigError, PeerLostError
from ..transport import region_peer
from . import factors as fc
from .consistency import MODES
from .replication import Beats, Views, abandon, wait_watched

log = logging.getLogger("gradsync.ps")

__all__ = ["ParameterClient"]


def _parameters(model) -> list:
    items = model.named_parameters() if hasattr(model, "named_parameters") else model
    out = []
    for i, item in enumerate(items):
        name, p = item if isinstance(item, tuple) else (f"param.{i}", item)
        if p.requires_grad:
            out.append((name, p))
    if not out:
        raise ValueError("the model has no parameter that requires a gradient")
    return out


class ParameterClient:
    """Trains ``model`` through the job's parameter servers.

    Args:
        model: an ``nn.Module``, or an iterable of parameters or ``(name, parameter)`` pairs.
        optimizer: the servers' optimizer, ``"sgd"`` or ``"adam"``; its hyperparameters
            (``lr``, ``momentum``, ``weight_decay``, ``betas``, ...) go in ``**hyper``.
        mode: ``"sync"``, ``"backup"``, ``"async"`` or ``"ssp"`` (see ``consistency.py``).
        backup: ``backup`` mode's gradients per round: an int k, or a fraction of the workers
            (default 0.75, Project Adam's choice), rounded up.
        staleness: ``ssp`` mode's bound s (default 3).
        factor_fc: a batch size K: send the factors of the gradients of ``nn.Linear`` weights
            for which K*(M+N) < M*N instead of the gradients (``factors.py``).
        restore: a directory written by ``save``: the servers start from it.
        **hyper: the optimizer's hyperparameters, ``lr`` included.
    """

    def __init__(self, model, optimizer: str = "sgd", mode: str = "sync",
                 backup: float | None = None, staleness: int | None = None,
                 factor_fc: int | None = None, restore: str | None = None, **hyper):
        from .. import api, job
        from ..cluster.launch_env import detect
        from ..connect.server_links import connect_servers, open_store

        api.init()  # on a server rank this serves and exits; on a worker it returns
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        env, config = detect(), job.world().config
        if env.servers == 0:
            raise ConfigError("this job has no parameter servers: start it with "
                              "'gradsync run -np N --servers S ...' or set GRADSYNC_SERVERS=S "
                              "on every rank (the last S ranks serve)")
        self.rank, self.workers, self.servers = env.rank, env.workers, env.servers
        self.replicas = config.ps_replicas
        if self.servers % self.replicas:
            raise ConfigError(f"{self.servers} parameter servers cannot hold "
                              f"{self.replicas} copies of each shard: GRADSYNC_PS_REPLICAS "
                              f"must divide GRADSYNC_SERVERS")
        self.shards = self.servers // self.replicas
        self.mode = mode
        self.params = _parameters(model)
        numels = [p.numel() for _, p in self.params]
        spec: dict[str, Any] = {"names": [n for n, _ in self.params], "numels": numels,
                "optimizer": optimizer.lower(), "hyper": _jsonable(hyper), "mode": mode,
                "restore": restore, "factored": self._factored(model, factor_fc)}
        if mode == "backup":
            k = 0.75 if backup is None else backup
            spec["backup"] = int(k) if isinstance(k, int) else max(1, math.ceil(k * self.workers))
        if mode == "ssp":
            spec["staleness"] = 3 if staleness is None else int(staleness)
        self.spec = spec

        # One connection to every server, copies included (server_links.py: the set-up that
        # data-server workers share).
        store = open_store(config, env)
        self.endpoint, peers = connect_servers(config, env, store, "ps", self.workers,
                                               self.servers, "parameter server")
        self.copies: dict[int, region_peer.RemotePeer] = dict(enumerate(peers))  # by server
        self._closed = self._left = False
        try:
            # Each shard's view (replication.py): its primary takes the pushes and pulls.
            self.views = [Views(store, k, self.servers, self.replicas, config.connect_timeout)
                          for k in range(self.shards)]
            self.view = [v.first for v in self.views]
            self.peers = [self.copies[v.primary] for v in self.view]
            self._beats = Beats(store.clone_private(), config.heartbeat_timeout) \
                if self.replicas > 1 else None
            self._store, self._deadline = store, config.connect_timeout
            self._start(spec, numels)
        except BaseException:
            # Not a member of training: drop the connections without a goodbye, so that the
            # servers (and through them the other workers) see this worker as lost.
            for peer in self.copies.values():
                peer.close()
            self.endpoint.close()
            self._closed = True
            raise
        atexit.register(self.close)

    def _start(self, spec: dict, numels: list[int]) -> None:
        """hello (the servers set up), map their regions, worker 0's initial parameters,
        ready (everyone has mapped), and the first pull."""
        self._buffers(numels)
        everyone = list(self.copies.values())  # every copy of every shard, by server
        replies = region_peer.wait([p.call_async("hello", spec=spec) for p in everyone])
        self.bounds = [tuple(replies[s]["bounds"]) for s in range(self.shards)]
        for peer in everyone:
            peer.refresh()
        self._layouts = [fc.layout(spec["factored"], numels, lo, hi) for lo, hi in self.bounds]
        self._fbuf = [np.zeros(fc.slot_floats(lay), np.float32) for lay in self._layouts]
        if self.rank == 0 and not replies[0]["restored"]:
            # ``params`` is fenced (server.py): the write carries the view it is meant for.
            lo_hi = [self.bounds[r["shard"]] for r in replies]
            region_peer.wait([peer.region("params").write_async(
                self.flat[lo:hi], fence=self.view[r["shard"]].epoch)
                for peer, (lo, hi), r in zip(everyone, lo_hi, replies)])
        ready = region_peer.wait([p.call_async("ready") for p in everyone])
        self.tags = [r["version"] for r in ready][:self.shards]
        self._seq = max(r["seq"] for r in ready)  # a restored clock goes on, not from 0
        self.applied = True
        self.bytes_pushed = 0
        self._version = np.zeros(self.servers, np.int64)
        self.pull()

    # ------------------------------------------------------------------ set-up
    def _factored(self, model, rows: int | None) -> list[dict]:
        """The Linear weights worth factoring at batch size ``rows``, with capture hooks."""
        self._inputs: dict[int, object] = {}
        self._errors: dict[int, object] = {}
        self._seen: dict[int, int] = {}
        if not rows or not hasattr(model, "modules"):
            return []
        import torch

        index = {id(p): i for i, (_, p) in enumerate(self.params)}
        out = []
        for module in model.modules():
            if not isinstance(module, torch.nn.Linear) or id(module.weight) not in index:
                continue
            m, n = module.weight.shape
            if rows * (m + n) >= m * n:
                continue
            i = index[id(module.weight)]
            out.append({"tensor": i, "out": m, "in": n, "max_rows": rows})
            module.register_forward_hook(self._capture(i, m, n))
        return out

    def _capture(self, i: int, m: int, n: int):
        """A forward hook keeping the layer's input x and, through a hook on its output, the
        error delta that backward brings back to it."""
        def keep_error(grad):
            self._errors[i] = grad.detach().reshape(-1, m).float().numpy()

        def hook(module, args, output):
            if not output.requires_grad:
                return  # a forward that backward never sees (evaluation under no_grad)
            self._seen[i] = self._seen.get(i, 0) + 1
            self._inputs[i] = args[0].detach().reshape(-1, n).float().numpy()
            output.register_hook(keep_error)
        return hook

    def _buffers(self, numels: list[int]) -> None:
        import torch

        total = sum(numels)
        self.flat = np.zeros(total, np.float32)
        self.gflat = np.zeros(total, np.float32)
        self._views = []
        at = 0
        with torch.no_grad():
            for (_, p), n in zip(self.params, numels):
                pv = torch.from_numpy(self.flat[at:at + n]).view(p.shape)
                gv = torch.from_numpy(self.gflat[at:at + n]).view(p.shape)
                pv.copy_(p.detach().float())
                aliased = p.dtype == torch.float32 and p.device.type == "cpu"
                if aliased:
                    # The model reads the flat buffer itself: a pull needs no further copy.
                    p.data = pv
                    p.grad = gv
                self._views.append((p, pv, gv, aliased))
                at += n

    # ------------------------------------------------------------------ training
    def push(self) -> bool:
        """Sends this step's gradients; returns when the mode lets this worker go on.

        Raises:
            PeerLostError: a server died, or (``sync``) another worker did.

        Returns:
            Whether every server applied them (False: ``backup`` dropped a late gradient).
        """
        self._gather()
        self._seq += 1  # numbers this push on every shard (a retry after a failover repeats it)
        replies = self._each(self._push_to, "push")
        self.tags = [r["version"] for r in replies]
        self.applied = all(r["applied"] for r in replies)
        self._inputs.clear()
        self._errors.clear()
        self._seen.clear()
        return self.applied

    def _push_to(self, s: int) -> dict:
        peer, (lo, hi), layers = self.peers[s], self.bounds[s], self._layouts[s]
        slot = peer.region(f"grad.{self.rank}")
        if not layers:
            slot.write(self.gflat[lo:hi])
            self.bytes_pushed += (hi - lo) * 4
            return self._answer(s, peer.call("push", tag=self.tags[s], seq=self._seq,
                                             epoch=self.view[s].epoch))
        inputs = {i: x for i, x in self._inputs.items() if self._seen.get(i) == 1}
        rows = fc.pack(layers, self._fbuf[s], inputs, self._errors)
        region = peer.region(f"factors.{self.rank}")
        for a, b in fc.sent_floats(layers, rows):
            region.write(self._fbuf[s][a:b], a * 4)
            self.bytes_pushed += (b - a) * 4
        # The dense part: everything but the weights whose factors went instead.
        at = lo
        for layer, k in sorted(zip(layers, rows), key=lambda lk: lk[0].a):
            if k != fc.DENSE:
                if layer.a > at:
                    slot.write(self.gflat[at:layer.a], (at - lo) * 4)
                    self.bytes_pushed += (layer.a - at) * 4
                at = layer.b
        if hi > at:
            slot.write(self.gflat[at:hi], (at - lo) * 4)
            self.bytes_pushed += (hi - at) * 4
        return self._answer(s, peer.call("push", tag=self.tags[s], rows=rows, seq=self._seq,
                                         epoch=self.view[s].epoch))

    def _answer(self, s: int, reply: dict) -> dict:
        if "stale" in reply:  # that server is no longer shard s's primary
            raise _Stale(f"parameter server {self.view[s].primary} refused a push of view "
                         f"{self.view[s].epoch} of shard {s} (it knows view {reply['stale']})")
        return reply

    def pull(self) -> None:
        """Reads the newest parameters of every server into the model."""
        self._each(self._pull_from, "pull")
        import torch

        with torch.no_grad():
            for p, pv, _, aliased in self._views:
                if not aliased:
                    p.copy_(pv)

    def _pull_from(self, s: int) -> None:
        peer, (lo, hi) = self.peers[s], self.bounds[s]
        if self.mode != "sync":
            # Another worker's update may have landed since our push returned: the version
            # read *before* the parameters is one they are at least as new as, so it is the
            # honest tag for the gradient computed on them (staleness is then not overcounted,
            # and backup does not drop a gradient whose round is still open).
            peer.region("meta").read(self._version[s:s + 1], 0)
            self.tags[s] = int(self._version[s])
        peer.region("params").read(self.flat[lo:hi])

    def _each(self, fn, what: str) -> list:
        """``fn(s)`` for every server: on each server's own request thread, so that they run
        together; with one server on this thread (the hand-off would only add latency)."""
        if self.replicas > 1:
            return self._each_replicated(fn, what)
        if len(self.peers) == 1:
            return [fn(0)]
        return region_peer.wait([peer.submit(lambda s=s: fn(s), f"{what} server {s}")
                             for s, peer in enumerate(self.peers)])

    # ------------------------------------------------------------------ failover
    def _each_replicated(self, fn, what: str) -> list:
        """``_each`` with copies: each shard's request goes to its primary on that peer's
        thread while this thread watches the primaries' beats; a primary lost (closed
        connection, silence, a refusal naming a newer view) is replaced by the shard's next
        view, and the request (the whole push, gradient included) goes again to the new
        primary, which answers a push it already applied without applying it again."""
        beats = self._beats
        assert beats is not None  # there are copies (replicas > 1), so their beats are watched
        handles = {s: self.peers[s].submit(lambda s=s: fn(s), f"{what} shard {s}")
                   for s in range(self.shards)}
        out = [None] * self.shards
        for s in range(self.shards):
            for attempt in range(self.replicas * 4):
                view, peer = self.view[s], self.peers[s]
                try:
                    out[s] = wait_watched(handles[s], beats, view.primary,
                                          self.workers + view.primary,
                                          lambda peer=peer: abandon(peer))
                    break
                except _Stale as exc:
                    self._failover(s, None, str(exc))
                except PeerLostError as exc:
                    if exc.peer != self.workers + view.primary:
                        raise  # another worker was lost (sync): not the server's failure
                    self._failover(s, view.primary, str(exc))
                handles[s] = self.peers[s].submit(lambda s=s: fn(s), f"{what} shard {s}")
            else:
                raise PeerLostError(f"shard {s}: {self.replicas * 4} failovers in one {what}; "
                                    f"giving up (views up to {self.view[s].epoch})")
        return out

    def _copy(self, server: int):
        """The connection to ``server``, made now for a replacement that joined (join.py)."""
        if server not in self.copies:
            rank = self.workers + server
            info = json.loads(self._store.get(f"ps/server/{server}", self._deadline))
            self.copies[server] = self.endpoint.connect(
                rank, info["addr"], info["port"], time.monotonic() + self._deadline,
                f"parameter server {server} (rank {rank})")
            if self._left:  # it must not wait for (or count as lost) a worker that left
                self.copies[server].call("bye")
        return self.copies[server]

    def _failover(self, s: int, lost: int | None, why: str) -> None:
        """Moves shard ``s`` to its newest view, first proposing one without ``lost``."""
        view = self.view[s]
        newest = self.views[s].newest(view)
        if lost is not None and newest.epoch == view.epoch:
            newest = self.views[s].propose(view, lost, f"worker {self.rank}: {why}")
        for server in set(view.members) - set(newest.members):
            peer = self.copies.pop(server, None)
            if peer is not None:
                abandon(peer)
        self.view[s], self.peers[s] = newest, self._copy(newest.primary)
        log.warning("worker %d: shard %d now at view %d, primary server %d (%s)", self.rank,
                    s, newest.epoch, newest.primary, why)

    def step(self) -> bool:
        """``push``, ``pull``, then zero the gradients (as ``optimizer.step(); zero_grad()``).

        Returns what ``push`` returned."""
        applied = self.push()
        self.pull()
        self.gflat[:] = 0
        return applied

    def _gather(self) -> None:
        """Makes ``gflat`` hold this step's gradients, wherever autograd left them."""
        with __import__("torch").no_grad():
            for p, _, gv, aliased in self._views:
                g = p.grad
                if g is None:
                    gv.zero_()
                elif not (aliased and g.data_ptr() == gv.data_ptr()):
                    gv.copy_(g)
                    if aliased:
                        p.grad = gv

    # ------------------------------------------------------------------ the servers
    def stats(self) -> list[dict]:
        """Each shard's primary's counters: version, applied, dropped, max_staleness,
        max_clock_gap, clocks, live and lost workers."""
        return region_peer.wait([p.call_async("stats") for p in self.peers])

    def replica_stats(self) -> dict[int, dict]:
        """Every copy's counters, by server, for the members of each shard's newest view
        (they agree on ``version``, ``clocks`` and a digest of the parameters once no update
        is in flight)."""
        for s in range(self.shards):
            self.view[s] = self.views[s].newest(self.view[s])
        servers = sorted({m for v in self.view for m in v.members})
        for server in servers:
            self._copy(server)
        return dict(zip(servers, region_peer.wait(
            [self.copies[s].call_async("stats") for s in servers])))

    def save(self, directory: str) -> None:
        """Each server writes its shard, optimizer state and clock to ``directory`` (call it
        from one worker; the files are ``server-<s>.npz``)."""
        region_peer.wait([p.call_async("save", directory=directory) for p in self.peers])

    def leave(self) -> None:
        """Tells the servers this worker pushes no more, so that rounds stop counting on it
        (``sync``, ``backup``) and the slowest-worker bound ignores it (``ssp``), as Horovod's
        ``join`` does. ``pull``, ``stats`` and ``save`` still work; ``close`` follows."""
        if self._left:
            return
        self._left = True
        # Every copy: a backup that becomes primary must not wait for this worker either.
        handles = {s: p.call_async("bye") for s, p in self.copies.items()}
        if self.replicas == 1:
            region_peer.wait(list(handles.values()))
            return
        beats = self._beats
        assert beats is not None  # there are copies, so their beats are watched
        for s, h in handles.items():
            try:  # a copy that is gone or silent does not need the goodbye
                wait_watched(h, beats, s, self.workers + s,
                             lambda peer=self.copies[s]: abandon(peer))
            except PeerLostError:
                pass

    def close(self) -> None:
        """``leave``, then disconnect (the servers end when every worker has)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.leave()
        except Exception:  # a server that is already gone does not need the goodbye
            pass
        for peer in self.copies.values():
            peer.close()
        self.endpoint.close()
        if self.replicas > 1:
            try:  # a joined copy no worker connected to ends on this count
                self._store.add("ps/closed", 1)
            except Exception:  # the store is gone: the job is ending anyway
                pass


class _Stale(Exception):
    """A server refused a push: the shard has a newer view."""


def _jsonable(hyper: dict) -> dict:
    out = {}
    for k, v in hyper.items():
        out[k] = list(v) if isinstance(v, tuple) else v
    try:
        json.dumps(out)
    except TypeError as exc:
        raise TypeError(f"optimizer hyperparameters must be numbers or lists: {exc}") from None
    return out
