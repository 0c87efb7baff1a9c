"""The job's store keeper (gradsync/run/keeper.py), exec'd on a socket the launcher binds (the
port known before torch is imported anywhere) or forked by a forkserver template: a child of
the launcher serves the store until its lifeline closes."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from gradsync.cluster.rendezvous import store_listener
from gradsync.run import keeper
from gradsync.run.processes import StartError

DEADLINE = 60

_KEEPERS = """
import json, os, socket, sys
from datetime import timedelta
if sys.argv[1] == "fork":  # kept by a forkserver template's children
    from gradsync.run.forkserver import Forkserver
    forks = Forkserver()
    forks.begin(dict(os.environ))
    kept, dropped = forks.keep_store("127.0.0.1"), forks.keep_store("127.0.0.1")
else:  # exec'd on sockets bound here
    from gradsync.run import keeper
    kept, dropped = keeper.spawn("127.0.0.1"), keeper.spawn("127.0.0.1")
    # Named before either serves, and reachable at once: a rank that connects early waits in
    # the socket's backlog until the keeper's store accepts it.
    socket.create_connection(("127.0.0.1", kept.port), timeout=5).close()
    kept.ready()
    dropped.ready()
from torch.distributed import TCPStore
client = TCPStore("127.0.0.1", kept.port, None, False, timedelta(seconds=10))
client.set("key", "value")
parents = [int(open(f"/proc/{k.process.pid}/stat").read().rsplit(")", 1)[1].split()[1])
           for k in (kept, dropped)]
print(json.dumps({"got": client.get("key").decode(), "mine": parents == [os.getpid()] * 2,
                  "serving": [kept.serving, dropped.serving],
                  "ports": [kept.port, dropped.port], "dropped": dropped.process.pid}),
      flush=True)
del client
kept.close()
if sys.argv[1] == "fork":
    forks.close()
print(json.dumps({"kept_status": kept.process.returncode}), flush=True)
os._exit(0)  # without closing the second keeper's lifeline: it closes with this process
"""


@pytest.mark.parametrize("how", ["exec", "fork"])
def test_a_keeper_serves_the_store_as_this_processs_child_until_its_lifeline_closes(how):
    result = subprocess.run([sys.executable, "-c", _KEEPERS, how], capture_output=True,
                            text=True, timeout=DEADLINE)
    assert result.returncode == 0, result
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert first["got"] == "value" and first["mine"] and first["serving"] == [True, True]
    assert second["kept_status"] == 0  # closed: it left at once, not killed
    kept_port, dropped_port = first["ports"]
    assert kept_port != dropped_port  # each keeper a store of its own
    with pytest.raises(ConnectionRefusedError):  # the closed keeper's store is gone
        socket.create_connection(("127.0.0.1", kept_port), timeout=5).close()
    # The other keeper saw its lifeline close when the process that held it ended.
    end = time.monotonic() + 10
    while _alive(first["dropped"]) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(first["dropped"])


def test_a_keeper_that_ends_without_serving_fails_the_start_with_the_stores_error():
    failed = keeper.spawn("127.0.0.1", executable="/bin/false")  # ends at once, says nothing
    with pytest.raises(StartError, match="cannot start the rendezvous store: the store keeper "
                                         r"ended \(exit status 1\)") as raised:
        failed.ready(timeout=DEADLINE)
    assert raised.value.status == 1 and not failed.serving
    failed.close()


def test_a_keeper_closed_before_it_serves_is_killed_at_once():
    # Every rank ended before the store served (``gradsync run true``): nothing depends on it,
    # so the launcher does not wait for its torch import.
    starting = keeper.spawn("127.0.0.1")
    began = time.monotonic()
    starting.close()
    assert starting.process.returncode == -9 and time.monotonic() - began < 5
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", starting.port), timeout=5).close()


def test_a_store_reached_by_name_or_ipv6_is_left_to_torchs_own_socket():
    # torch opens a dual-stack socket for those (rendezvous.host_store); the launcher then
    # hosts the store itself, as before.
    assert store_listener("localhost", 0) is None and store_listener("::1", 0) is None
    with pytest.raises(OSError, match="IPv4 addresses, not 'localhost'"):
        keeper.spawn("localhost")
    listener = store_listener("127.0.0.1", 0)
    assert listener is not None and listener.getsockname()[0] == "127.0.0.1"
    listener.close()


def test_a_keeper_finds_the_gradsync_its_launcher_imported(monkeypatch):
    # A program that put gradsync on sys.path itself, without PYTHONPATH, starts a launcher
    # whose keeper must import the same package: its folder goes first on the keeper's path.
    import gradsync

    home = os.path.dirname(os.path.dirname(os.path.abspath(gradsync.__file__)))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert keeper._env()["PYTHONPATH"] == home
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert keeper._env()["PYTHONPATH"] == os.pathsep.join([home, "/elsewhere"])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
