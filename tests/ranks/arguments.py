"""Both APIs reject the same bad arguments, with the same error, before anything is exchanged.

Run by tests/test_arguments.py through ``gradsync run -np N``. The NumPy API (``gradsync``) and
the Horovod API (``gradsync.torch``) share their checks (``gradsync/pipeline/arguments.py``); each
case here is asked of both. Every rank rejects locally, so the job goes on: a collective after the
rejected calls still works.
"""

import sys

import common  # noqa: F401  (deadline)
import numpy as np
import torch

import gradsync as gs
import gradsync.torch as hvd

hvd.init()
R, N = gs.rank(), gs.size()
rows = torch.ones(N, 2)
APIS = {"gradsync": gs, "hvd": hvd}
# (case, call(api), words of the ValueError)
CASES = [
    ("float list splits", lambda api: api.alltoall(rows, splits=[1.0] * N), "must hold integers"),
    ("numpy float splits", lambda api: api.alltoall(rows, splits=np.ones(N)),
     "must hold integers"),
    ("torch float splits", lambda api: api.alltoall(rows, splits=torch.ones(N)),
     "must hold integers"),
    ("long splits", lambda api: api.alltoall(rows, splits=[0] * N + [N]),
     "one non-negative entry per rank"),
    ("negative splits", lambda api: api.alltoall(rows, splits=[N + 1, -1] + [0] * (N - 2)),
     "one non-negative entry per rank"),
    ("uneven rows", lambda api: api.alltoall(torch.ones(N + 1, 2)) if N > 1 else
     api.alltoall(torch.ones(())), "alltoall"),
    ("scalar alltoall", lambda api: api.alltoall(torch.tensor(1.0)), "at least one dimension"),
    ("scalar allgather", lambda api: api.allgather(torch.tensor(1.0)), "at least one dimension"),
    ("fractional root", lambda api: api.broadcast(torch.ones(2), 0.5), "root_rank 0.5"),
    ("root outside", lambda api: api.broadcast(torch.ones(2), N), f"root_rank {N}"),
]

wrong = []
for case, call, words in CASES:
    for api_name, api in APIS.items():
        try:
            call(api)
        except ValueError as exc:
            if words not in str(exc):
                wrong.append(f"{case} ({api_name}): {exc}")
        except Exception as exc:  # noqa: BLE001  (any other outcome is the failure reported)
            wrong.append(f"{case} ({api_name}): {type(exc).__name__}: {exc}")
        else:
            wrong.append(f"{case} ({api_name}): accepted")
if wrong:
    print(f"rank {R}: " + "\n".join(wrong), flush=True)
    sys.exit(1)
# Whole-number splits of any integer kind are accepted alike, and nothing was exchanged above.
for api_name, api in APIS.items():
    for splits in ([1] * N, np.ones(N, np.int64), torch.ones(N, dtype=torch.int32)):
        received, counts = api.alltoall(rows * (R + 1), splits=splits)
        if counts.tolist() != [1] * N or received[:, 0].tolist() != [r + 1.0 for r in range(N)]:
            print(f"rank {R}: {api_name} alltoall {splits!r} gave {received}, {counts}")
            sys.exit(1)
print(f"arguments ok {R}", flush=True)
hvd.shutdown()
