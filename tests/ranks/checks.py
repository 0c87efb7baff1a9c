"""How rank scripts check what they see: the first wrong result ends the rank, naming it.

A rank script compares every result with a reference and exits non-zero at the first
difference, with one line that says which rank saw what (``rank 2: allreduce float16: got
[...] want [...]``). The launcher forwards that line and ends the job with the rank's status
(1, as ``sys.exit`` with a message gives), which is what the tests read; scripts that report
how many checks they made print ``count`` at their end, and the tests look for that line.

Usage, once the rank is known::

    C = Checks(rank)
    fail, raises = C.fail, C.raises
"""

from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["Checks"]


class Checks:
    """The checks of one rank.

    Attributes:
        count: checks made so far by ``raises``, ``equal`` and ``near`` (and by a
            script's own checks that add to it).
    """

    def __init__(self, rank, label: str = "rank"):
        """Args:
            rank: the rank named in every failure.
            label: the word before it (``"FAIL worker"`` for a parameter-server worker).
        """
        self.prefix = f"{label} {rank}"
        self.count = 0

    def fail(self, message: str) -> NoReturn:
        """Ends the rank: ``<label> <rank>: message`` on stderr, exit status 1."""
        sys.exit(f"{self.prefix}: {message}")

    def raises(self, what: str, exc: type, fn) -> str:
        """Calls ``fn``, which must raise ``exc``; returns the exception's message.

        Any other exception, or none, is a failure of ``what``."""
        self.count += 1
        try:
            fn()
        except exc as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - reported as the failure it is
            self.fail(f"{what}: raised {type(e).__name__}({e}), not {exc.__name__}")
        self.fail(f"{what}: did not raise {exc.__name__}")

    def dtype(self, what: str, got, dtype) -> None:
        """``got`` (a tensor) has ``dtype``."""
        if got.dtype != dtype:
            self.fail(f"{what}: dtype {got.dtype} != {dtype}")

    def equal(self, what: str, got, want, exact: bool = True) -> None:
        """``got`` is a tensor of ``want``'s shape and values: bitwise, or within 1% when not
        ``exact`` (reduced precision)."""
        import torch

        self.count += 1
        if not isinstance(got, torch.Tensor):
            self.fail(f"{what}: got a {type(got).__name__}, not a tensor")
        want = torch.as_tensor(want)
        if got.shape != want.shape:
            self.fail(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        ok = (torch.equal(got.double(), want.double()) if exact else
              torch.allclose(got.double(), want.double(), rtol=1e-2, atol=1e-2))
        if not ok:
            self.fail(f"{what}: got {got.flatten()[:6].tolist()} want "
                      f"{want.flatten()[:6].tolist()}")

    def near(self, what: str, got, want, tol: float = 0.0) -> None:
        """``got`` is a tensor of ``want``'s shape, off by at most ``tol`` relative to the
        largest magnitude of ``want`` (and at least to 1)."""
        import torch

        self.count += 1
        want = torch.as_tensor(want)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            self.fail(f"{what}: got {got!r}, want shape {tuple(want.shape)}")
        diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        if diff > tol * max(1.0, want.double().abs().max().item() if want.numel() else 0.0):
            self.fail(f"{what}: off by {diff}: got {got.flatten()[:6].tolist()} want "
                      f"{want.flatten()[:6].tolist()}")
