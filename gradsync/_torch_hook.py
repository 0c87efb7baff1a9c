"""Registers the torch.distributed backend "gradsync" without importing torch at import time.

``import gradsync`` must stay cheap (the launcher and the CLI never need torch, whose import
takes seconds), yet ``import gradsync`` alone must make ``init_process_group("gradsync")`` work,
whichever of the two a script imports first. So: if ``torch.distributed`` is already imported,
register now; otherwise put a finder on ``sys.meta_path`` that waits for ``torch.distributed``
to be imported, lets it load normally, then registers and removes itself.

Where gradsync is installed as a package, torch itself usually got there first: its
``torch.backends`` entry point (``_gradsync_torch_backend.autoload``, a top-level module so
that it costs torch's import nothing) registers the same backend, with the same devices and
options, at the end of ``import torch``; ``register`` then finds it registered and returns.
This hook remains for source trees and for ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

__all__ = ["install", "register"]

_TARGET = "torch.distributed"
NAME = "gradsync"


def _create(options, backend_options=None):
    # Imported on first use: torch imports torch.distributed while torch itself is still
    # half-initialised, too early for gradsync.torch (torch.autograd is not there yet).
    from .torch.backend.group import create

    return create(options, backend_options)


def register() -> None:
    """Registers the backend "gradsync" for CPU tensors with torch.distributed. Idempotent."""
    import torch.distributed as dist

    if not dist.is_available() or NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])


def _register() -> None:
    register()


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Registers the backend now if torch.distributed is loaded, else when it is."""
    module = sys.modules.get(_TARGET)
    if module is not None and hasattr(module, "Backend"):
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
