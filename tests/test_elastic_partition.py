"""Fencing a partitioned host: it comes back after the elastic job went on without it.

The job has two hosts: ``localhost`` (3 workers) and a network namespace joined to this
machine's by a veth pair (1 worker), named by its address (so that the store's address is the
veth's end on this side, which both reach), whose worker starts through an ssh stand-in
(``ip netns exec``). At its 4th step that worker cuts its own link (``ip link set
down``). The others find it silent (heartbeat timeout 3 s), the launcher "kills" it, and they
go on at size 3; once they have (their new generation's rank 0 makes a file), the cut worker's
link comes back up (tests/ranks/elastic_redo.py). The stand-in, like ssh over a cut link, passes
the launcher's stop on only once the link has been up for a while (a lifeline relay in a
session of its own), so the worker is still running when the link returns. It must end with
``ExcludedError`` naming the generation and the reason, and the survivors must end exactly as
a replay of the run without it (3 updates at size 4, the rest at size 3).

Needs root (``ip netns``, veth); skipped with the reason otherwise. Slow tier.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from harness import MARK, launch, worker_results

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# The ssh stand-in for the host $PART_ADDR: ``true`` (the launcher's check) and the worker's
# command run in the namespace $PART_NS. The worker's stdin (its lifeline, after the secret)
# comes through a relay in a session of its own, so that the launcher's SIGKILL of this
# process does not reach it: on EOF the relay keeps the lifeline open while the link is down
# and 15 s after it is up again, as a stop sent over ssh would arrive only after the
# partition (TCP retransmits). As ssh does, the stand-in ends when the command ends, with
# its status, whether or not its stdin has closed: the launcher keeps a rank's lifeline open
# until the rank ends, so a relay that read it to its end before it looked at the command
# outlived a rank that ended by itself (a replicated server's replacement on that host), and
# the launcher stopped it as a server still running 10 s after the last worker.
STAND_IN = r'''#!{python}
import os, subprocess, sys, threading, time

ns, dev = os.environ["PART_NS"], os.environ["PART_DEV"]
if sys.argv[1] == "--relay":
    keep = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "{mark}") if k in os.environ}
    child = subprocess.Popen(["ip", "netns", "exec", ns, "env", "-i",
                              *[f"{k}={v}" for k, v in keep.items()], "sh", "-c", sys.argv[2]],
                             stdin=subprocess.PIPE)
    closed = threading.Event()  # the launcher closed the lifeline

    def forward():
        try:
            while chunk := os.read(0, 4096):
                child.stdin.write(chunk)
                child.stdin.flush()
        except (OSError, ValueError):  # the command ended: nobody reads its stdin
            return
        closed.set()

    def link_up():
        state = subprocess.run(["ip", "netns", "exec", ns, "cat",
                                f"/sys/class/net/{dev}/operstate"], capture_output=True,
                               text=True).stdout.strip()
        return state == "up"

    threading.Thread(target=forward, daemon=True).start()
    up_since = None
    while child.poll() is None:
        if closed.is_set():
            up_since = (up_since or time.monotonic()) if link_up() else None
            if up_since is not None and time.monotonic() - up_since > 15:
                child.stdin.close()
                break
        time.sleep(0.2)
    sys.exit(child.wait())
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in ("-o", "-p") else args[1:]
host, command = args[0], " ".join(args[1:])
if host != os.environ["PART_ADDR"]:
    sys.exit(255)
if command == "true":
    sys.exit(subprocess.call(["ip", "netns", "exec", ns, "true"]))
relay = subprocess.Popen([sys.executable, __file__, "--relay", command],
                         start_new_session=True)
sys.exit(relay.wait())
'''


def _ip(*args, ns=None):
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    subprocess.run(cmd, check=True, capture_output=True)


def _names(ns: str, address: str, gateway: str) -> None:
    """The namespace's /etc/hosts and /etc/resolv.conf (``ip netns exec`` mounts
    /etc/netns/NS/FILE over /etc/FILE), as gradsync.testbed.netns gives its emulated hosts.

    Its only route leads to this machine, which forwards nothing, so a DNS query from it is
    dropped: with the machine's resolv.conf every look-up that /etc/hosts does not answer
    waits out the resolver's timeouts, 10 s (measured here: one ``getnameinfo`` of the
    gateway's address in such a namespace took 10.2 s). torch's store client looks up the
    names of its connection's addresses, and each such wait stalled the namespace's rank (its
    log: "The hostname of the client socket cannot be retrieved. err=-3", a look-up that
    timed out). So the file names both ends of the veth (in the IPv4-mapped form too, which
    the store looks up), and the resolver asks the namespace's own loopback, where nothing
    listens: a look-up the file does not answer is refused at once. The machine's own lines
    are kept, so every name it resolves from the file resolves the same in the namespace."""
    folder = os.path.join("/etc/netns", ns)
    os.makedirs(folder, exist_ok=True)
    with open("/etc/hosts") as machine:
        lines = machine.read().rstrip("\n") + "\n"
    with open(os.path.join(folder, "hosts"), "w") as f:
        f.write(lines + "::ffff:127.0.0.1 localhost\n"
                + "".join(f"{ip} {name}\n::ffff:{ip} {name}\n"
                          for ip, name in ((address, "partitioned"), (gateway, "gateway"))))
    with open(os.path.join(folder, "resolv.conf"), "w") as f:
        f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


@pytest.fixture
def parthost():
    """A namespace joined to this one by a veth pair: (namespace, its device, its address,
    the gateway: this side's address). Its names are answered at once (``_names``)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns, veth) to emulate a partitioned host")
    tag = os.getpid() % 250 + 1
    ns, outer, inner = f"gspart-{os.getpid()}", f"gspo{os.getpid()}", f"gspi{os.getpid()}"
    gateway, address = f"10.217.{tag}.1", f"10.217.{tag}.2"
    _ip("netns", "add", ns)
    try:
        _names(ns, address, gateway)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("addr", "add", f"{gateway}/30", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("addr", "add", f"{address}/30", "dev", inner, ns=ns)
        _ip("link", "set", inner, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("route", "add", "default", "via", gateway, ns=ns)
        yield ns, inner, address, gateway
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", outer], capture_output=True)
        shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)


def test_a_partitioned_host_that_reconnects_is_fenced_and_told_it_was_excluded(
        tmp_path, parthost):
    ns, dev, address, gateway = parthost
    stand_in = tmp_path / "ssh"
    stand_in.write_text(STAND_IN.replace("{python}", sys.executable).replace("{mark}", MARK))
    stand_in.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"localhost:3\n{address}:1\n")
    mark = tmp_path / "excluded"
    result = launch(
        4, "elastic_redo.py", "partition", "3", "3", "3", timeout=300,
        env={"GRADSYNC_HEARTBEAT_TIMEOUT": "3", "GRADSYNC_HEARTBEAT_INTERVAL": "0.5",
             "STALE_MARK": str(mark), "PART_NS": ns, "PART_DEV": dev,
             "PART_GW": gateway, "PART_ADDR": address},
        launcher_args=("--min-np", "2", "--host-discovery-script", f"cat {hosts}",
                       "--ssh-command", str(stand_in), "-x", "GS_TEST_DEADLINE", "-x",
                       "STALE_MARK", "-x", "PART_DEV", "-x", "PART_GW"))
    assert result.returncode == 0, result
    assert mark.exists(), result
    excluded = mark.read_text()
    assert excluded.startswith(f"EXCLUDED excluded from the job at generation 0: worker "
                               f"{address}[3] (rank 3 of generation 0) sent no heartbeats and "
                               "was killed"), (excluded, result)
    found = worker_results(result.output)
    assert sorted(found) == ["localhost[0]", "localhost[1]", "localhost[2]"], result
    assert len({r["hash"] for r in found.values()}) == 1, result
    assert all(float(r["refdiff"]) < 1e-5 for r in found.values()), result
    assert set(re.findall(r"PLAN (.*)", result.output)) == {
        "action=go_on updates=3 lost=0"}, result
