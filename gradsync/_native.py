"""gradsync's compiled fast paths: installed with the package, else built ahead or on first use.

gradsync has two C sources, each a CPython extension module: ``collectives/_shmfast.c`` (the
one-step shared-memory allreduce, and the heartbeats' beater that needs no GIL:
``beater.py``) and ``compress/_quantfast.c`` (the quantizers' per-block arithmetic:
``compress/quantized.py``). ``load`` finds each in this order:

1. **Installed**: ``pip install`` and ``pip wheel`` compile them when the machine has a C
   compiler and Python's headers (setup.py, optional extensions), so the package carries
   ``gradsync/collectives/_shmfast.<abi>.so`` (and ``compress/_quantfast``) and ``load``
   imports it. An editable install builds them in place, beside their sources.
2. **Cached**: otherwise (a checkout on ``PYTHONPATH``, an install made without a compiler)
   it is compiled with ``cc`` (or ``$CC``) against this Python's headers into a per-user
   cache, ``$XDG_CACHE_HOME/gradsync`` (default ``~/.cache/gradsync``, else a directory in
   the system's temporary directory), under a name keyed by a hash of the source, the Python
   version and the compile command; every later process, and every rank of every later job,
   loads it from there. ``gradsync build-native`` (``main``) does this ahead of time, for a
   container image, and says where the modules are.
3. **None**: where neither works (no compiler or no headers), one warning line says why and
   callers take their Python path, which computes the same bits (the tests cover both); the
   heartbeats are then sent by a Python thread, which a long hold of the GIL can silence, and
   the quantizers run as torch operations, several times slower.

Every module carries the hash of the source it was compiled from (``source_hash``, set by
setup.py and by the build here) and is loaded only when it matches the source beside it: an
editable install's in-place module that the source has since moved past is refused with a
warning and the cache's build is used instead, so a stale module never runs.

When it is built matters: ``World.connect`` calls ``load("_shmfast")`` before its connect
deadline starts, where a first-use compile (about a second, up to ``_COMPILE_TIMEOUT``) costs
no peer its window; ``ShmGroup``, made inside that window, asks with ``build=False`` and
never compiles. The quantizers load ``_quantfast`` at their first exchange (compression is
optional, and its collectives wait minutes, not a connect window): a first-use compile
delays that one exchange by about a second. Concurrent first uses (the ranks of one job
starting together) take an exclusive lock on the cache entry, so one compiles while the
others wait for it; a module is moved into place atomically once complete, so nobody ever
loads a half-written file.
"""

from __future__ import annotations

import argparse
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
from typing import Sequence

__all__ = ["load", "cache_dir", "source_hash", "main"]

log = logging.getLogger("gradsync")

_SOURCES = {"_shmfast": os.path.join(os.path.dirname(__file__), "collectives", "_shmfast.c"),
            "_quantfast": os.path.join(os.path.dirname(__file__), "compress", "_quantfast.c")}
_PACKAGES = {"_shmfast": "gradsync.collectives", "_quantfast": "gradsync.compress"}
_FLAGS = ["-O2", "-fPIC", "-shared", "-fno-strict-aliasing"]
_SLOWER = {"_shmfast": "slower for small allreduces and with heartbeats that a long hold of "
                       "the GIL can silence",
           "_quantfast": "int8, int4 and bf16 compression several times slower"}
_COMPILE_TIMEOUT = 120.0
_loaded: dict = {}  # (name, compiler) -> module or None: what load() answered in this process
_warned: set = set()  # (name, why) already warned about in this process


def cache_dir() -> str:
    """Where compiled modules are kept for this user."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gradsync")


def source_hash(name: str) -> str:
    """The hash of module ``name``'s C source that a module built from it carries (setup.py
    computes the same: the first 16 hex digits of the source's SHA-256)."""
    with open(_SOURCES[name], "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def load(name: str, compiler: "str | None" = None, build: bool = True):
    """The compiled module ``name``: installed, cached, or built now; None where there is none.

    Where it returns None, one warning says why, once per process and module.

    Args:
        name: a module of ``_SOURCES`` (``"_shmfast"``, ``"_quantfast"``).
        compiler: the compile command (default ``$CC``, else ``cc``); for tests.
        build: False only loads (the installed or an already cached module) and never
            compiles: for callers inside a deadline, after an earlier ``load`` had the
            chance to build. Its misses are not remembered, so a later ``load`` may build.
    """
    key = (name, compiler)
    if key in _loaded:
        return _loaded[key]
    try:
        module = _installed(name) or _from_cache(name, compiler, build)
        if module is None and not build:
            _warn(name, f"compiled {name} not built yet (`gradsync build-native` builds it); "
                        "using the Python path")
            return None
    except (OSError, subprocess.SubprocessError, ImportError, ValueError) as exc:
        reason = str(exc).strip().splitlines()
        _warn(name, f"compiled {name} unavailable "
                    f"({reason[0] if reason else type(exc).__name__}); using the Python path, "
                    f"{_SLOWER.get(name, 'slower')}: install a C compiler and Python's headers "
                    f"(Debian/Ubuntu: apt-get install gcc python3-dev), then run "
                    f"`gradsync build-native` (docs/troubleshooting.md)")
        if not build:
            return None
        module = None
    _loaded[key] = module
    return module


def _warn(name: str, message: str) -> None:
    if (name, message) not in _warned:
        _warned.add((name, message))
        log.warning("gradsync: %s", message)


def _checked(name: str, module, path: str):
    """``module`` if it was built from the current source, else None with a warning."""
    built_from = getattr(module, "source_hash", "")
    if built_from == source_hash(name):
        return module
    _warn(name, f"{path} was built from another {name}.c (hash {built_from or 'none'}, the "
                f"source's is {source_hash(name)}): not loaded; reinstall gradsync (`pip "
                "install -e .` for an editable install) or delete it")
    return None


def _exec(spec):
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # A single-phase extension's import also registers it in sys.modules; take it out, so a
    # refused module stays unseen and the next search looks at the files, not at this one.
    if sys.modules.get(spec.name) is module:
        del sys.modules[spec.name]
    return module


def _installed(name: str):
    """The module the package was installed with (setup.py built it), if current; else None."""
    # Beside its source, where setup.py puts it (an editable install too): a search of the
    # files only, so a module loaded from the cache under the same name is not taken for it.
    spec = importlib.machinery.PathFinder.find_spec(f"{_PACKAGES[name]}.{name}",
                                                    [os.path.dirname(_SOURCES[name])])
    if spec is None or not isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
        return None
    return _checked(name, _exec(spec), spec.origin)


def _from_cache(name: str, compiler: "str | None", build: bool):
    """The module from the per-user cache, compiled into it first where ``build`` allows."""
    source = _SOURCES[name]
    with open(source, "rb") as f:
        text = f.read()
    include = sysconfig.get_paths()["include"]
    command = shlex.split(compiler or os.environ.get("CC") or "cc")
    flags = _FLAGS + [f'-DGRADSYNC_SOURCE_HASH="{source_hash(name)}"']
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    digest = hashlib.sha256(b"\0".join(
        [text, sys.version.encode(), suffix.encode(), include.encode(),
         " ".join(command + flags).encode()])).hexdigest()[:20]
    lock = None
    for directory in (cache_dir(), os.path.join(tempfile.gettempdir(), f"gradsync-{os.getuid()}")):
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            status = os.stat(directory)
            if status.st_uid != os.getuid() or status.st_mode & 0o022:
                continue  # a module others can write into is not one to load
            path = os.path.join(directory, f"{name}-{digest}{suffix}")
            if not build:
                if os.path.exists(path):  # complete: modules are moved into place whole
                    break
                continue
            lock = open(path + ".lock", "a")
            break
        except OSError:
            continue
    else:
        if not build:
            return None
        raise OSError(f"no private writable cache directory for the compiled {name} "
                      f"(tried {cache_dir()} and one in {tempfile.gettempdir()})")
    if lock is not None:
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the ranks of one job start together: one compiles
            if not os.path.exists(path):
                _compile(command, flags + [f"-I{include}", source], path)
    qualified = f"{_PACKAGES[name]}.{name}"
    loader = importlib.machinery.ExtensionFileLoader(qualified, path)
    return _checked(name, _exec(importlib.util.spec_from_file_location(
        qualified, path, loader=loader)), path)


def _compile(command: list, arguments: list, path: str) -> None:
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        done = subprocess.run(command + arguments + ["-o", partial],
                              capture_output=True, text=True, timeout=_COMPILE_TIMEOUT)
        if done.returncode:
            said = (done.stderr or done.stdout).strip()
            if "Python.h" in said:
                raise OSError(f"Python's headers are missing (no Python.h in "
                              f"{sysconfig.get_paths()['include']})")
            raise OSError(f"{' '.join(command)} failed: {said[:500]}")
        os.replace(partial, path)
    except FileNotFoundError as exc:
        raise OSError(f"no C compiler ({command[0]}: {exc.strerror})") from None
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def main(argv: "Sequence[str] | None" = None) -> int:
    """``gradsync build-native``: builds (or finds) the compiled modules and says where they
    are; 0 when every one loaded, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="gradsync build-native",
        description="Build gradsync's compiled shared-memory allreduce and quantizer kernels "
                    "ahead of their first use (for a container image or a shared checkout) and "
                    "print where they are. An install made with a C compiler already carries "
                    "them; otherwise they are built "
                    f"into this user's cache ({cache_dir()}, $XDG_CACHE_HOME/gradsync). $CC "
                    "names the compiler (default cc).")
    parser.parse_args(argv)
    logging.basicConfig(format="%(message)s")  # the reason of a failure, one line
    missing = 0
    for name in _SOURCES:
        module = load(name)
        if module is None:
            print(f"{name}: not available; gradsync takes its Python path")
            missing += 1
        else:
            where = "installed" if module.__file__.startswith(os.path.dirname(__file__)) \
                else "cached"
            print(f"{name}: loaded ({where}) from {module.__file__}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
