"""A worker of an elastic job whose generations the test publishes by hand, without the
launcher (tests/test_elastic.py, ``test_members_that_read_two_generations_form_the_newer_one``).

``init()`` joins the newest generation that lists ``$GRADSYNC_ELASTIC_ID``; the worker prints
``FORMED id=<worker> gen=<g> rank=<r> size=<n> sum=<s>``, ``s`` the sum of every rank's
``rank + 1`` (an allreduce over the World formed), and shuts down.
"""

import os

import common  # noqa: F401  (the deadline)
import numpy as np

import gradsync as gs
from gradsync.elastic import worker

gs.init()
total = gs.allreduce(np.array([gs.rank() + 1.0]), op=gs.Sum)
print(f"FORMED id={os.environ['GRADSYNC_ELASTIC_ID']} gen={worker._generation} "
      f"rank={gs.rank()} size={gs.size()} sum={float(total[0]):g}", flush=True)
gs.shutdown()
