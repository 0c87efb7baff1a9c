"""Which processes ran the user's script: ``roles_record.py DIR``.

Every process that runs this script writes ``DIR/<pid>`` holding its ``GRADSYNC_RANK``, before
anything else, so that a test can tell which ranks ran it (tests/test_roles.py): under
``gradsync run --servers S`` only the workers do. A worker then reaches the servers through a
``ParameterClient`` of a one-layer model and closes it, so that the servers end at once.
"""

import common  # noqa: F401  (deadline)

import os
import sys

with open(os.path.join(sys.argv[1], str(os.getpid())), "w") as record:
    record.write(os.environ.get("GRADSYNC_RANK", os.environ.get("RANK", "?")))

import torch  # noqa: E402

import gradsync.ps  # noqa: E402

client = gradsync.ps.ParameterClient(torch.nn.Linear(2, 1), optimizer="sgd", lr=0.1)
client.close()
