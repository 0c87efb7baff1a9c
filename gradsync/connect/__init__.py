"""The connected job: the World, a host's shared memory, and the links to serving ranks.

``world`` (``World.connect``: the rendezvous' one-key address table, a pair per peer connected
on first use, groups, the failure records; the heartbeat started), ``_shm_setup`` (the byte
rings and the shared-memory group of a host's ranks, set up inside ``World.connect``) and
``server_links`` (a worker's connections to parameter and data servers, outside the World).
Above the collectives and the watchers, which a World holds; below the operation pipeline,
which runs on a World it is handed and is never imported from here.
"""

__all__: list[str] = []
