"""torch's entry point for gradsync: the backend "gradsync" in every process, no import needed.

torch (2.5 and later) ends ``import torch`` by loading every entry point of the group
``torch.backends`` and calling it (``torch._import_device_backends``; switched off by
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). gradsync's package metadata declares one::

    [project.entry-points."torch.backends"]
    gradsync = "_gradsync_torch_backend:autoload"

so that ``torch.distributed.init_process_group("gradsync")`` works in any process where gradsync
is installed (Ray Train's workers, Lightning, a torchrun script) without ``import gradsync``.

This runs inside *every* ``import torch`` on the machine, used or not, so it must cost nothing:
it is a top-level module of its own, because loading ``gradsync._torch_hook`` would first run
``gradsync/__init__.py`` (the whole API, NumPy, the engine). It only adds a name to
torch.distributed's table of backends (torch has imported ``torch.distributed`` by then); the
process group's code is imported by the first ``init_process_group("gradsync")``, never before.
An exception here would make torch's import itself fail, so none escapes: a failure becomes a
warning, and ``import gradsync`` (``gradsync._torch_hook``) still registers the backend.
"""

from __future__ import annotations

import warnings

__all__ = ["autoload"]

NAME = "gradsync"


def _create(options, backend_options=None):
    # The first init_process_group("gradsync") pays for gradsync's import, here and only here.
    from gradsync.torch.backend.group import create

    return create(options, backend_options)


def autoload() -> None:
    """Registers the backend "gradsync" for CPU tensors unless it is registered. Never raises."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or NAME.upper() in dist.Backend._plugins:
            return
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
    except Exception as err:  # noqa: BLE001 (raising would break every `import torch`)
        warnings.warn(f"gradsync: the torch.distributed backend {NAME!r} was not registered at "
                      f"torch's import ({type(err).__name__}: {err}); `import gradsync` "
                      f"registers it", RuntimeWarning, stacklevel=2)
