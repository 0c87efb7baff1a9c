"""The job before it is connected: who started this rank, where the ranks meet, where they are.

The bottom floor of the runtime (docs/internals.md, "Layout"): ``launch_env`` reads which
launcher started this process (``gradsync run``, torchrun, SLURM, mpirun) and what it says
about the job; ``rendezvous`` is the store where the ranks meet (torch's TCPStore: addresses,
the job's secret, barriers, the abort record); ``topology`` holds the hosts, groups and tiers
between them. They import nothing of gradsync but ``errors``, so everything stands on them:
the transport and the collectives' planner, the watchers, the launcher, ``gradsync simulate``.
"""

__all__: list[str] = []
