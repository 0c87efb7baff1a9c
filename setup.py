"""The compiled part of gradsync's build: everything else is declared in pyproject.toml.

gradsync's two C extensions, ``gradsync.collectives._shmfast`` (the shared-memory group's
one-step allreduce and the heartbeats' beater, ``collectives/_shmfast.c``) and
``gradsync.compress._quantfast`` (the quantizers' per-block arithmetic,
``compress/_quantfast.c``), are built here when the machine has a C compiler and Python's
headers, so ``pip install .`` and ``pip wheel .`` give a platform wheel that carries them.
They are optional: where one does not compile (no compiler, no ``Python.h``, not Linux
x86-64) setuptools prints one warning and the install goes on without it; at run time
gradsync then builds the module on first use into a per-user cache, or takes its Python path
(``gradsync/_native.py`` explains the order in which it looks).

Each module carries the hash of the source it was built from (``source_hash``), and gradsync
loads an installed module only when that hash matches the source beside it: an
in-place build of an editable install that the source has since moved past is refused and
rebuilt, never loaded stale. ``_native.source_hash`` computes the same hash; the two must agree
(tests/test_native_build.py checks it on a built wheel). That hash is why this is a setup.py
and not pyproject.toml's ``[tool.setuptools] ext-modules`` table, which cannot compute it.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCES = {"gradsync.collectives._shmfast": "gradsync/collectives/_shmfast.c",
           "gradsync.compress._quantfast": "gradsync/compress/_quantfast.c"}


def _hash(source: str) -> str:
    """The first 16 hex digits of the source's SHA-256, as _native.source_hash computes them."""
    return hashlib.sha256((Path(__file__).parent / source).read_bytes()).hexdigest()[:16]


setup(ext_modules=[Extension(
    name, [source],
    define_macros=[("GRADSYNC_SOURCE_HASH", f'"{_hash(source)}"')],
    # The flags of the first-use build (_native._FLAGS); Python's own CFLAGS come first.
    extra_compile_args=["-O2", "-fno-strict-aliasing"],
    optional=True,
) for name, source in SOURCES.items()])
