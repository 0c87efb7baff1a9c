"""Where the compiled kernel comes from (gradsync/_native.py, setup.py), and when it is built.

An install with a compiler carries the module (a wheel built here holds it); ``load`` prefers
that installed module, refuses one built from another source and rebuilds into the cache;
``init()`` compiles before its connect deadline starts, never inside it; ``gradsync
build-native`` builds it ahead and says where it is. The compiled road itself is tested in
tests/test_shm_fast.py.
"""

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from gradsync import _native
from gradsync.run import cli
import forked_jobs

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has loaded nothing yet, with an empty cache and a package directory of
    its own (``tmp_path / "pkg"``, holding a copy of the source) where an install would put
    the module."""
    package = tmp_path / "pkg"
    package.mkdir()
    source = package / "_shmfast.c"
    shutil.copy(_native._SOURCES["_shmfast"], source)
    monkeypatch.setattr(_native, "_SOURCES", {"_shmfast": str(source)})
    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.setattr(_native, "_warned", set())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    return package


def _install(package: Path) -> Path:
    """Compiles the module into ``package`` as setup.py would: named for the package, carrying
    the hash of the source beside it."""
    path = package / f"_shmfast{SUFFIX}"
    _native._compile(["cc"], _native._FLAGS + [
        f'-DGRADSYNC_SOURCE_HASH="{_native.source_hash("_shmfast")}"',
        f"-I{sysconfig.get_paths()['include']}", str(package / "_shmfast.c")], str(path))
    return path


def _counting(monkeypatch) -> list:
    compiles = []
    compile_ = _native._compile
    monkeypatch.setattr(_native, "_compile", lambda *a: (compiles.append(a), compile_(*a))[1])
    return compiles


def test_source_hash_is_setup_pys():
    for name, folder in (("_shmfast", "collectives"), ("_quantfast", "compress")):
        text = (ROOT / "gradsync" / folder / f"{name}.c").read_bytes()
        assert _native.source_hash(name) == hashlib.sha256(text).hexdigest()[:16]
        assert f"gradsync/{folder}/{name}.c" in (ROOT / "setup.py").read_text()
    assert "hexdigest()[:16]" in (ROOT / "setup.py").read_text()  # the same digest there


def test_installed_module_is_preferred(fresh, monkeypatch, tmp_path):
    installed = _install(fresh)
    compiles = _counting(monkeypatch)
    module = _native.load("_shmfast")
    assert module.__file__ == str(installed) and compiles == []
    assert module.source_hash == _native.source_hash("_shmfast")
    assert not (tmp_path / "cache").exists()  # the cache was not even looked at
    assert _native.load("_shmfast", build=False) is module


def test_stale_installed_module_is_refused_and_rebuilt(fresh, monkeypatch, tmp_path, caplog):
    installed = _install(fresh)
    with open(fresh / "_shmfast.c", "a") as f:
        f.write("/* the source moved on since the install */\n")
    compiles = _counting(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        module = _native.load("_shmfast")
    assert module.__file__.startswith(str(tmp_path / "cache" / "gradsync")), module.__file__
    assert module.source_hash == _native.source_hash("_shmfast") and len(compiles) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(installed) in lines[0] and "another" in lines[0], lines
    assert "gradsync.collectives._shmfast" not in sys.modules  # the refused one stays unseen


def test_load_only_never_compiles(fresh, monkeypatch, caplog):
    monkeypatch.setattr(_native, "_installed", lambda name: None)
    compiles = _counting(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        assert _native.load("_shmfast", build=False) is None
        assert _native.load("_shmfast", build=False) is None
    lines = [r.getMessage() for r in caplog.records]
    assert compiles == [] and len(lines) == 1 and "build-native" in lines[0], lines
    built = _native.load("_shmfast")  # the miss was not remembered: this one builds
    assert built is not None and len(compiles) == 1
    monkeypatch.setattr(_native, "_loaded", {})  # a new process finds it in the cache
    assert _native.load("_shmfast", build=False).__file__ == built.__file__
    assert len(compiles) == 1


@pytest.mark.multiprocess
def test_init_compiles_before_its_connect_deadline(tmp_path):
    # The compiler takes longer than the whole connect window: built inside it, init fails.
    slow_cc = tmp_path / "slow-cc"
    slow_cc.write_text('#!/bin/sh\nsleep 5\nexec cc "$@"\n')
    slow_cc.chmod(0o755)
    # Two ranks forked from one process that imported torch and gradsync (and loaded no
    # compiled module: each rank's init() loads it, as a rank started alone does).
    result = forked_jobs.job(2, "native_build.py", timeout=90, lean=True, env={
        "CC": str(slow_cc), "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "GRADSYNC_CONNECT_TIMEOUT": "4"})
    assert result.returncode == 0, result.output
    reports = re.findall(r"native (\d+) (\d+) (\w+)", result.output)
    assert len(reports) == 2, result.output
    # one rank compiled, the other waited on the cache's lock and loaded that build; nobody
    # compiled inside World._connect; both groups are on the compiled road
    assert sorted(int(c) for c, _, _ in reports) == [0, 1], reports
    assert [(inside, fast) for _, inside, fast in reports] == [("0", "True")] * 2, reports


def test_build_native_command(fresh, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(_native, "_installed", lambda name: None)
    assert cli.main(["build-native"]) == 0
    out = capsys.readouterr().out.strip()
    path = out.split(" from ")[-1]
    assert out.startswith("_shmfast: loaded (cached) from ") and os.path.exists(path), out
    assert path.startswith(str(tmp_path / "cache"))
    # no compiler and nothing built: it says so and fails, so an image build stops there
    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cli.main(["build-native"]) == 1
    assert capsys.readouterr().out.strip() == \
        "_shmfast: not available; gradsync takes its Python path"


def test_build_native_command_in_a_process(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gradsync", "build-native"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    # an editable install's in-place modules where there are, else builds in the cache
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, done.stdout
    for name, line in zip(("_shmfast", "_quantfast"), lines):
        match = re.fullmatch(rf"{name}: loaded \((installed|cached)\) from (\S+)", line)
        assert match and os.path.exists(match[2]), done.stdout


def _wheel(tmp_path: Path, env: dict) -> tuple[Path, str]:
    """Builds gradsync's wheel from a copy of the sources (so that nothing lands in the work
    tree); returns it and pip's verbose output."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "gradsync", src / "gradsync",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE",
                 "_gradsync_torch_backend.py"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "wheel"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps",
                           "--no-build-isolation", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels = list(out.glob("gradsync-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], done.stdout + done.stderr


MODULES = {"_shmfast": "gradsync/collectives", "_quantfast": "gradsync/compress"}


@pytest.mark.slow
def test_wheel_holds_the_compiled_modules(tmp_path):
    wheel, _ = _wheel(tmp_path, {})
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        for name, folder in MODULES.items():
            built = [n for n in names if re.fullmatch(rf"{folder}/{name}\..*\.so", n)]
            assert built == [f"{folder}/{name}{SUFFIX}"], names
            assert f"{folder}/{name}.c" in names  # the hash check needs its source
            archive.extract(built[0], tmp_path / "unpacked")
            path = str(tmp_path / "unpacked" / built[0])
            qualified = f"{folder.replace('/', '.')}.{name}"
            loader = importlib.machinery.ExtensionFileLoader(qualified, path)
            module = _native._exec(importlib.util.spec_from_file_location(
                qualified, path, loader=loader))
            assert module.source_hash == _native.source_hash(name)  # setup.py's hash is ours
    assert not wheel.name.endswith("-none-any.whl"), wheel.name  # a platform wheel


@pytest.mark.slow
def test_wheel_without_a_compiler_is_pure_python_with_one_warning_a_module(tmp_path):
    wheel, output = _wheel(tmp_path, {"CC": "/nonexistent/cc"})
    with zipfile.ZipFile(wheel) as archive:
        assert not [n for n in archive.namelist() if n.endswith(".so")]
    for name, folder in MODULES.items():
        qualified = f"{folder.replace('/', '.')}.{name}"
        warnings = re.findall(rf'building extension "{qualified}" failed', output)
        assert len(warnings) == 1, output[-3000:]
