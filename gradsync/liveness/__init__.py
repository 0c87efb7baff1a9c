"""The watchers: a lost peer is an error, not a hang; a stuck or slow job says who.

``heartbeat`` (a rank alive but silent is a lost rank: beats on links between ring neighbours),
``beater`` (those beats sent by a native thread that needs no GIL), ``abort_watch`` (the abort
record, watched by one blocked store request), ``stall`` (who has not arrived in a collective,
with their stacks), ``pace`` (each rank's steps and time blocked in collectives) and
``straggler_watch`` (stragglers named from those paces). They stand on the rendezvous' store
and the transport's sockets and import nothing of the World or the pipeline they watch over:
those call them, never the other way (tests/test_structure.py). The flight recorder they read
stays at the package's top level, where users call it (``gradsync.flight_recorder``).
"""

__all__: list[str] = []
