"""The operation pipeline: a collective from the caller's tensor to its algorithm, agreed first.

A call's arguments are checked and its result handed back once for both APIs (``arguments``,
over ``tensors``: user tensors as flat buffers); operations then run in issue order
(``engine``, the NumPy API's, inline or on its progress thread, a small allreduce prepared
once per distinct call included) or are first matched by name (the Horovod
API: ``agreement``, the pure table; ``ballot``, a cycle's vote; ``negotiation_wire``, the cycle
on the wire; ``negotiation``, the controller that runs the cycles; ``fusion``, the stage after
agreement that packs ready allreduces into one collective); ``operations`` is each collective
as one function over a World. It stands on the collectives, the transport's frames
and the watchers; ``gradsync/job.py`` pairs an Engine with its World.
"""

__all__: list[str] = []
