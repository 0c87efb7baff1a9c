"""Horovod's build and runtime queries (``hvd.mpi_built()`` ...), answered for gradsync.

Horovod scripts and Horovod's own tests branch on these: ``if hvd.nccl_built(): ...`` picks a
GPU path, ``if not hvd.mpi_enabled(): skip``. Each answer here is the truth about gradsync,
not about some Horovod build, so a script takes the branch that matches what will run:
gradsync moves CPU tensors over its own TCP and shared-memory transports, with no MPI, Gloo,
NCCL, oneCCL, DDL, CUDA or ROCm underneath. docs/torch.md ("Build queries") lists the answers
and what they make Horovod's test suite do.
"""

from __future__ import annotations

__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
           "nccl_built", "ccl_built", "ddl_built", "cuda_built", "rocm_built"]


def mpi_built() -> bool:
    """False: gradsync does not link MPI (it can adopt an mpirun job's ranks, not use MPI)."""
    return False


def mpi_enabled() -> bool:
    """False: no MPI communicator carries gradsync's control or data messages."""
    return False


def mpi_threads_supported() -> bool:
    """Raises ValueError, as Horovod does whenever MPI is not enabled."""
    raise ValueError("gradsync does not use MPI, so MPI multi-threading support does not "
                     "apply (hvd.mpi_enabled() is False); mpi4py may be used beside gradsync")


def gloo_built() -> bool:
    """False: gradsync has its own transports and collectives, not Gloo's."""
    return False


def gloo_enabled() -> bool:
    """False: Gloo is not used at runtime either."""
    return False


def nccl_built() -> int:
    """0 (Horovod returns the NCCL version code, or 0 without NCCL): gradsync is CPU-only."""
    return 0


def ccl_built() -> bool:
    """False: no Intel oneCCL."""
    return False


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def cuda_built() -> bool:
    """False: gradsync reduces CPU tensors only; a CUDA tensor raises TypeError."""
    return False


def rocm_built() -> bool:
    """False: no ROCm either."""
    return False

