"""The testbed: what the tools (``gradsync bench``, ``gradsync simulate``) and the tests stand on.

``netns`` (emulated hosts on one Linux machine: a network namespace per host, links shaped by
``tc``, ranks started torchrun-style in their host's namespace, and an ssh stand-in for
launchers that reach hosts by name), ``models`` (the networks ``bench train`` times and
``simulate`` predicts), ``rows`` (``--json``, one meaning in every command).

A leaf of the tools: it imports the runtime's launch pieces (``gradsync/run``) and nothing of
``bench`` or ``simulate``, and nothing the ranks load imports it. ``bench`` and ``simulate``
import each other's nothing; what both need lives here (``tests/test_structure.py`` pins it).
"""
