"""Parameter-server training on one-sided memory regions (Project Adam's design).

    gradsync run -np 4 --servers 2 python train.py

The last ``servers`` ranks of the job serve (``gradsync.init()`` on them runs the server and
exits when the workers are done); the others train through a ``ParameterClient``::

    import gradsync.ps
    ps = gradsync.ps.ParameterClient(model, optimizer="sgd", lr=0.1, mode="backup")
    ...
    loss.backward()
    ps.step()

Modes (``consistency.py``): ``sync``, ``backup`` (first k of N gradients per round),
``async`` and ``ssp`` (bounded staleness). With ``--ps-replicas R`` each shard lives on R
servers, a primary and its backups (``replication.py``); a lost server costs no acknowledged
update and a replacement joins with a copy (``join.py``). See docs/ps.md.
"""

from .client import ParameterClient
from .consistency import MODES

__all__ = ["ParameterClient", "MODES"]
