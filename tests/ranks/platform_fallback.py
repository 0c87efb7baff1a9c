"""A job on a platform without gradsync's shared-memory transport (the machine is made to
report aarch64): the ranks of one host connect over TCP and reduce right. Prints "ok"."""

import common  # noqa: F401  (the deadline)

import numpy as np

import gradsync as gs
from gradsync import job
from gradsync.connect import _shm_setup
from gradsync.transport.tcp import TcpPair

_shm_setup.platform.machine = lambda: "aarch64"
gs.init()
world = job.world()
pairs = world.comm.pairs
assert world.shm_group is None, "a shared-memory group on a platform without one"
assert all(isinstance(p, TcpPair) for r, p in pairs.items() if r != gs.rank()), pairs
x = np.arange(1000, dtype=np.float32) + gs.rank()
gs.allreduce_(x, op=gs.Sum)
n = gs.size()
assert np.array_equal(x, n * np.arange(1000, dtype=np.float32) + n * (n - 1) / 2), x[:4]
gs.shutdown()
print("ok")
