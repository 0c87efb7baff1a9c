"""gradsync as an installed package: one version, its files, and torch's entry point.

The entry point (``[project.entry-points."torch.backends"]`` in pyproject.toml, the module
``_gradsync_torch_backend``) lets ``init_process_group("gradsync")`` work without
``import gradsync``. torch finds it in the installed package's metadata, so the tests that
use it need gradsync installed (``pip install -e .``, which scripts/setup.sh runs): where the
metadata lacks it they fail and say so, rather than skip.
"""

import dataclasses
import importlib.metadata
import os
import re
import socket
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

import _gradsync_torch_backend
import gradsync
from gradsync.run import cli

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
REINSTALL = f"pip install --no-deps -e {ROOT} (scripts/setup.sh does)"


def _installed_entry_point() -> None:
    """Fails the test unless this Python's gradsync metadata declares the entry point."""
    try:
        importlib.metadata.distribution("gradsync")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"gradsync is not installed as a package, so torch cannot find its "
                    f"torch.backends entry point: {REINSTALL}")
    names = [e.value for e in importlib.metadata.entry_points(group="torch.backends")
             if e.name == "gradsync"]
    if names != ["_gradsync_torch_backend:autoload"]:
        pytest.fail(f"the installed gradsync's metadata has no torch.backends entry point "
                    f"(installed before pyproject.toml declared it?): {REINSTALL}")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADSYNC_", "TORCH_DEVICE_BACKEND"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def test_one_version():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == \
        {"attr": "gradsync.__version__"}
    assert gradsync.__version__.count(".") == 2


def test_gradsync_version_flag(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gradsync {gradsync.__version__}"


def test_license_typed_marker_and_classifiers():
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert (ROOT / "gradsync" / "py.typed").exists()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["gradsync"]
    classifiers = PYPROJECT["project"]["classifiers"]
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert "Typing :: Typed" in classifiers


def test_entry_point_is_declared_and_shipped():
    assert PYPROJECT["project"]["entry-points"]["torch.backends"] == \
        {"gradsync": "_gradsync_torch_backend:autoload"}
    assert PYPROJECT["tool"]["setuptools"]["py-modules"] == ["_gradsync_torch_backend"]


def test_installed_metadata_is_this_version():
    _installed_entry_point()
    assert importlib.metadata.version("gradsync") == gradsync.__version__


def test_autoload_never_raises(monkeypatch):
    """An exception would break every `import torch` on the machine: it becomes a warning."""
    import torch.distributed as dist

    def broken(*args, **kwargs):
        raise RuntimeError("no table")

    monkeypatch.setattr(dist.Backend, "_plugins", {})
    monkeypatch.setattr(dist.Backend, "register_backend", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _gradsync_torch_backend.autoload()
    assert any("was not registered at torch's import" in str(w.message) for w in caught)


def test_import_torch_registers_the_backend_and_loads_nothing_else():
    """torch's import registers "gradsync" without importing gradsync or starting a thread."""
    _installed_entry_point()
    probe = ("import sys, threading, torch, torch.distributed as d; "
             "print('GRADSYNC' in d.Backend._plugins, "
             "sorted(m for m in sys.modules if m.startswith('gradsync')), "
             "threading.active_count())")
    on = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                        env=_env(), timeout=120, cwd="/")
    assert on.returncode == 0, on.stderr[-3000:]
    assert on.stdout.split() == ["True", "[]", "1"], on.stdout + on.stderr[-3000:]
    off = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0"), timeout=120, cwd="/")
    assert off.stdout.split()[0] == "False", off.stdout + off.stderr[-3000:]


RANK = """
import sys
import torch
import torch.distributed as dist

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gradsync", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
assert dist.get_backend() == "gradsync", dist.get_backend()
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
assert t.tolist() == [3.0] * 5, t
dist.destroy_process_group()
print(f"rank {rank} ok")
"""


def test_init_process_group_gradsync_without_import_gradsync():
    """A torch.distributed script with no `import gradsync`, as Ray Train and Lightning run."""
    _installed_entry_point()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), port], env=_env(),
                              cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for rank in (0, 1)]
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("init_process_group('gradsync') did not finish within 120 s")
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0 and f"rank {rank} ok" in out, out[-3000:]


def test_configuration_page_lists_every_setting():
    """docs/configuration.md is the table of every setting (the README shows the usual few)."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", page, re.M))
    fields = {f.name for f in dataclasses.fields(gradsync.Config)}
    assert documented == fields, (sorted(fields - documented), sorted(documented - fields))


def test_readme_links_stay_inside_the_repository():
    """The README's relative links name files that exist; nothing points outside but installs."""
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        assert not target.startswith(("http", "/", "..")), target
        assert (ROOT / target).exists(), target
    assert "../" not in readme
