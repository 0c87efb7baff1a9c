"""When the compiled kernel is built: before ``init()``'s connect deadline, never inside it.

Run by tests/test_native_build.py at 2 ranks forked from one process (tests/forked_jobs.py)
with an empty cache and a slow ``$CC``. Each rank records its compiles and whether
``World._connect`` (where the connect deadline runs) was on the stack at the time; the
installed module is hidden, so the cache's first-use build is what runs. Prints "native
<compiles> <inside> <fast>".
"""

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs
from gradsync import _native, job
from gradsync.connect.world import World

compiles, inside, connecting = [], [], []
compile_, connect_ = _native._compile, World._connect.__func__


def counted_compile(*args):
    compiles.append(1)
    inside.append(bool(connecting))
    return compile_(*args)


def marked_connect(cls, *args):
    connecting.append(1)
    try:
        return connect_(cls, *args)
    finally:
        connecting.pop()


_native._installed = lambda name: None  # an editable install's in-place module: not this test's
_native._compile = counted_compile
World._connect = classmethod(marked_connect)
gs.init()
data = np.full(8, gs.rank() + 1.0, dtype=np.float32)
gs.allreduce_(data, name="x", op=gs.Sum)
assert data.tolist() == [3.0] * 8, data
print(f"native {len(compiles)} {sum(inside)} {job.world().shm_group.fast}", flush=True)
gs.shutdown()
