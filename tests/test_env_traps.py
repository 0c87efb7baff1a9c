"""The environment traps users hit, each a one-line error or warning naming its fix:
a small /dev/shm, an unsupported platform, ssh that wants a password, a firewall."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
from types import SimpleNamespace

import pytest

from gradsync.config import Config
from gradsync.connect import _shm_setup
from gradsync.errors import ConfigError, GradsyncTimeoutError
from gradsync.run.processes import Ssh
from gradsync.transport import shm

MiB = 1 << 20


def fake_statvfs(size: int, free: int):
    return lambda path: SimpleNamespace(f_blocks=size // 4096, f_bavail=free // 4096,
                                        f_frsize=4096)


# ---------------------------------------------------------------- /dev/shm
def test_host_bytes_counts_every_ring_and_the_allreduce_segment():
    ring = shm.ring_bytes()
    host, rank0 = _shm_setup.host_bytes(4, 1 << 20, group=True)
    segment = host - 12 * ring
    assert segment >= 8 * MiB  # 2 slots of 1 MiB per rank, and the control lines
    assert rank0 == 3 * ring + segment
    assert _shm_setup.host_bytes(4, 1 << 20, group=False) == (12 * ring, 3 * ring)
    assert _shm_setup.host_bytes(8, 1 << 20, group=True)[0] > 64 * MiB  # Docker's default


def test_a_dev_shm_smaller_than_the_host_needs_names_the_fix(monkeypatch):
    monkeypatch.setattr(os, "statvfs", fake_statvfs(64 * MiB, 64 * MiB))
    with pytest.raises(ConfigError) as info:
        _shm_setup.check_room(8, 40 * MiB, 240 * MiB)
    message = str(info.value)
    assert "\n" not in message
    assert "holds 64 MiB but the 8 ranks on this host need 240 MiB" in message
    assert "--shm-size" in message and "GRADSYNC_TRANSPORT=tcp" in message


def test_too_little_room_left_names_the_fix(monkeypatch):
    monkeypatch.setattr(os, "statvfs", fake_statvfs(1024 * MiB, 10 * MiB))
    with pytest.raises(ConfigError, match="has 10 MiB free but this rank needs 40 MiB"):
        _shm_setup.check_room(8, 40 * MiB, 240 * MiB)
    _shm_setup.check_room(2, 8 * MiB, 16 * MiB)  # fits: no error


def test_connect_stops_before_making_any_segment(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "statvfs", fake_statvfs(64 * MiB, 64 * MiB))
    made = []
    monkeypatch.setattr(shm, "create_segment", lambda *a: made.append(a))
    env = SimpleNamespace(rank=0, size=8, hostname="h", job_id="j", store_addr="127.0.0.1",
                          store_port=1)
    peers = [SimpleNamespace(rank=r, pid=100 + r) for r in range(8)]
    with pytest.raises(ConfigError, match="the 8 ranks on this host need"):
        _shm_setup.connect(Config(), env, None, peers, {}, set(range(1, 8)), 0.0)
    assert made == []


# ---------------------------------------------------------------- platform
def test_an_unsupported_platform_falls_back_to_tcp_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(_shm_setup.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(_shm_setup, "_warned_platform", False)
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        assert _shm_setup.usable(Config()) is False
        assert _shm_setup.usable(Config()) is False
    assert len(caplog.records) == 1
    assert "aarch64" in caplog.records[0].getMessage()
    assert "over TCP" in caplog.records[0].getMessage()
    with pytest.raises(ConfigError, match="GRADSYNC_TRANSPORT=shm.*aarch64"):
        _shm_setup.usable(Config(transport="shm"))


def test_x86_64_linux_uses_shared_memory(monkeypatch):
    monkeypatch.setattr(_shm_setup.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(_shm_setup.sys, "platform", "linux")
    assert _shm_setup.platform_problem() is None and _shm_setup.usable(Config()) is True


# ---------------------------------------------------------------- ssh
@pytest.mark.parametrize("stderr, fix", [
    ("user@b: Permission denied (publickey,password).", "ssh-copy-id b"),
    ("Host key verification failed.", "ssh-keyscan b"),
    ("ssh: connect to host b port 22: Connection timed out", "a firewall"),
])
def test_ssh_failures_name_their_fix(stderr, fix):
    proc = subprocess.Popen(["sh", "-c", f"echo '{stderr}' >&2; exit 255"],
                            stderr=subprocess.PIPE)
    proc.wait(10)
    try:
        message = Ssh().probe_error("b", proc)
    finally:
        proc.stderr.close()
    assert fix in message and "\n" not in message
    assert stderr in message  # ssh's own words stay


def test_ssh_never_prompts():
    assert "BatchMode=yes" in Ssh().argv("b", "true")


# ---------------------------------------------------------------- firewall
def test_an_unreachable_store_names_the_port_to_open():
    from gradsync.cluster.rendezvous import Store
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(GradsyncTimeoutError) as info:
        Store("127.0.0.1", port, False, "job", 1.0, 2)
    assert f"is TCP port {port} of 127.0.0.1 open to this host" in str(info.value)


def test_the_peer_hint_names_the_ports_and_the_interface_option():
    from gradsync.connect.world import firewall_hint
    hint = firewall_hint("node2")
    assert "node2" in hint and "--network-interface" in hint
    low, high = hint.split("TCP ports ")[1].split(" ")[0].split("-")
    assert 0 < int(low) < int(high) < 65536


@pytest.mark.multiprocess
def test_a_job_on_an_unsupported_platform_runs_over_tcp():
    import forked_jobs  # ranks forked from one process: the platform is each rank's own

    result = forked_jobs.job(3, "platform_fallback.py", timeout=60, lean=True)
    assert result.returncode == 0, result
    assert result.output.count("ok") == 3, result
    assert result.output.count("shared-memory transport is not available") == 3, result
