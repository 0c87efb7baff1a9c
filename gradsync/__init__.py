"""gradsync: distributed deep-learning training.

    import gradsync as gs
    gs.init()
    y = gs.allreduce(x, op=gs.Sum)

See the README for the launcher (``gradsync run -np N ...``) and the configuration table.
"""

from .api import *  # noqa: F401,F403
from .api import __all__ as _api_all
from .collectives.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .config import Config
from .errors import (AuthenticationError, CollectiveMismatchError, ConfigError, GradsyncError,
                     GradsyncTimeoutError, PeerLostError, ProtocolError)
from .pipeline.engine import Handle

from ._torch_hook import install as _install_torch_backend

__version__ = "0.1.0"

_install_torch_backend()  # the torch.distributed backend "gradsync" (without importing torch)

__all__ = list(_api_all) + [
    "Sum", "Average", "Min", "Max", "Product", "Adasum", "ReduceOp", "Config", "Handle",
    "GradsyncError", "ConfigError", "PeerLostError", "CollectiveMismatchError",
    "GradsyncTimeoutError", "AuthenticationError", "ProtocolError", "__version__",
]
