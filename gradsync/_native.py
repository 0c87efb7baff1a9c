"""gradsync's compiled fast paths: built on first use with the system C compiler, cached.

gradsync ships C sources (today one: ``collectives/_shmfast.c``, the one-step shared-memory
allreduce) and no binaries. The first process that wants one compiles it with ``cc`` (or
``$CC``) against this Python's headers into a per-user cache,
``$XDG_CACHE_HOME/gradsync`` (default ``~/.cache/gradsync``, else a directory in the system's
temporary directory), under a name keyed by a hash of the source, the Python version and the
compile command; every later process, and every rank of every later job, loads the cached
module. So an editable install, a source install and a plain checkout on ``PYTHONPATH`` all
get it with nothing to do at install time, a change of the source rebuilds it, and a machine
without a compiler or without Python's headers keeps working: ``load`` returns None, one
warning line says why, and callers take their Python path (which the tests cover too).

Concurrent first uses (the ranks of one job starting together) take an exclusive lock on the
cache entry, so one compiles while the others wait for it; a module is moved into place
atomically once complete, so nobody ever loads a half-written file.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile

__all__ = ["load", "cache_dir"]

log = logging.getLogger("gradsync")

_SOURCES = {"_shmfast": os.path.join(os.path.dirname(__file__), "collectives", "_shmfast.c")}
_FLAGS = ["-O2", "-fPIC", "-shared", "-fno-strict-aliasing"]
_COMPILE_TIMEOUT = 120.0
_loaded: dict = {}


def cache_dir() -> str:
    """Where compiled modules are kept for this user."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gradsync")


def load(name: str, compiler: "str | None" = None):
    """The compiled module ``name`` (building it the first time), or None where it cannot be
    built here; in that case one warning says why, once per process and module.

    Args:
        name: a module of ``_SOURCES`` (``"_shmfast"``).
        compiler: the compile command (default ``$CC``, else ``cc``); for tests.
    """
    key = (name, compiler)
    if key not in _loaded:
        try:
            _loaded[key] = _build_and_import(name, compiler)
        except (OSError, subprocess.SubprocessError, ImportError, ValueError) as exc:
            reason = str(exc).strip().splitlines()
            log.warning("gradsync: compiled %s unavailable (%s); using the Python path",
                        name, reason[0] if reason else type(exc).__name__)
            _loaded[key] = None
    return _loaded[key]


def _build_and_import(name: str, compiler: "str | None"):
    source = _SOURCES[name]
    with open(source, "rb") as f:
        text = f.read()
    include = sysconfig.get_paths()["include"]
    command = shlex.split(compiler or os.environ.get("CC") or "cc")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    digest = hashlib.sha256(b"\0".join(
        [text, sys.version.encode(), suffix.encode(), include.encode(),
         " ".join(command + _FLAGS).encode()])).hexdigest()[:20]
    lock = None
    for directory in (cache_dir(), os.path.join(tempfile.gettempdir(), f"gradsync-{os.getuid()}")):
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            status = os.stat(directory)
            if status.st_uid != os.getuid() or status.st_mode & 0o022:
                continue  # a module others can write into is not one to load
            path = os.path.join(directory, f"{name}-{digest}{suffix}")
            lock = open(path + ".lock", "a")
            break
        except OSError:
            continue
    if lock is None:
        raise OSError(f"no private writable cache directory for the compiled {name} "
                      f"(tried {cache_dir()} and one in {tempfile.gettempdir()})")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of one job start together: one compiles
        if not os.path.exists(path):
            partial = f"{path}.{os.getpid()}.tmp"
            try:
                done = subprocess.run(command + _FLAGS + [f"-I{include}", source, "-o", partial],
                                      capture_output=True, text=True, timeout=_COMPILE_TIMEOUT)
                if done.returncode:
                    raise OSError(f"{' '.join(command)} failed: "
                                  f"{(done.stderr or done.stdout).strip()[:500]}")
                os.replace(partial, path)
            except FileNotFoundError as exc:
                raise OSError(f"no C compiler ({command[0]}: {exc.strerror})") from None
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
    spec = importlib.util.spec_from_file_location(
        f"gradsync.collectives.{name}", path,
        loader=importlib.machinery.ExtensionFileLoader(f"gradsync.collectives.{name}", path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
