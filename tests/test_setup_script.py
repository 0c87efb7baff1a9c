"""scripts/setup_current.py: when ``scripts/setup.sh`` may skip pip, and when it must not."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup_current.py"
spec = importlib.util.spec_from_file_location("setup_current", SCRIPT)
assert spec is not None and spec.loader is not None
setup_current = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup_current)


def _check(extras: str, pin: str = "torch==2.13.0") -> int:
    return subprocess.run([sys.executable, str(SCRIPT), "check", extras, pin]).returncode


def test_a_set_of_extras_never_installed_from_these_files_is_not_current():
    # No stamp line was ever written for it (nor for a pin that is not installed), so pip runs.
    assert _check("test,no-such-extra") == 1
    assert _check("test", "torch==0.0.1") == 1


def test_the_stamp_follows_every_input_and_the_environment_follows_the_requirements(
        tmp_path, monkeypatch):
    for name in setup_current.INPUTS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    monkeypatch.setattr(setup_current, "ROOT", tmp_path)
    before = setup_current._digest("test", "torch==2.13.0")
    assert setup_current._digest("test,ecosystem", "torch==2.13.0") != before
    for name in setup_current.INPUTS:  # each file the installs depend on moves the stamp
        path = tmp_path / name
        text = path.read_bytes()
        path.write_bytes(text + b"\n")
        assert setup_current._digest("test", "torch==2.13.0") != before, name
        path.write_bytes(text)
    assert setup_current._digest("test", "torch==2.13.0") == before
    # gradsync is not installed from the copy: not current, whatever the stamp says.
    assert not setup_current._installed("test", "torch==2.13.0")


def test_a_requirement_gone_from_the_environment_means_installing(monkeypatch):
    import importlib.metadata as md

    real = md.version

    def version(name: str) -> str:
        if name == "pytest-xdist":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(setup_current.md, "version", version)
    monkeypatch.setattr(setup_current, "_digest", lambda extras, pin: "current")
    monkeypatch.setattr(setup_current, "_stamp", lambda: _Stamp("current\n"))
    assert setup_current.main(["check", "test", "torch==2.13.0"]) == 1
    monkeypatch.setattr(setup_current.md, "version", real)
    assert setup_current.main(["check", "test", "torch==2.13.0"]) == 0  # the same, all there


class _Stamp:
    def __init__(self, text: str):
        self.text = text

    def read_text(self) -> str:
        return self.text
