"""``python -m gradsync.ps``: the parameter-server entry point, as ``gradsync run`` starts it.

``gradsync run -np N --servers S python train.py`` starts the N workers with the user's
command and each of the S servers with this one (the job's Python interpreter, ``-m
gradsync.ps``, no arguments): a server needs nothing from the training script. It learns its
place from the launcher's ``GRADSYNC_*`` identity (``launch_env``), its settings from the
``GRADSYNC_*`` variables (``config``), and the model (sizes, optimizer, hyper-parameters, mode)
from the first worker's hello (``server.py``). So the script is not run on a server at all:
nothing it does before ``gradsync.init()`` (imports, data loading, prints) happens there.

Settings a script passes to ``gradsync.init(**settings)`` are the workers' alone; a server
takes its own (``timeout``, ``connect_timeout``, ``transport``, ``heartbeat_*``,
``ps_replicas``, ``log_level``) from the environment, which ``gradsync run -x`` and
``--log-level`` set for every rank.

Under launchers that start every rank from the same script (torchrun, srun, mpirun with
``GRADSYNC_SERVERS`` exported), the servers cannot be started apart; there ``gradsync.init()``
on a server rank calls the same ``serve_rank`` and ends the process (``api.py``).
"""

from __future__ import annotations

from ..cluster.launch_env import detect
from ..config import load_config
from ..errors import ConfigError
from .server import serve_rank


def main() -> int:
    """Serves as this launch's parameter server; returns the process's exit status."""
    config = load_config()  # also sets up logging (logs.configure)
    env = detect()
    if not env.is_server:
        raise ConfigError(f"python -m gradsync.ps runs a parameter server, but rank {env.rank} "
                          f"of {env.size} is no server (GRADSYNC_SERVERS={env.servers}: the "
                          f"last {env.servers} ranks serve); gradsync run --servers S starts "
                          "the servers with it")
    return serve_rank(config, env)


if __name__ == "__main__":
    raise SystemExit(main())
