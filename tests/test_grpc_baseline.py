"""The gRPC parameter-server baseline: exact SGD over gRPC, big messages, the server process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import grpc  # the test extra installs it; missing, the run must fail

from gradsync.bench.grpc_ps import GrpcClient, GrpcParameterServer  # noqa: E402


@pytest.fixture
def server():
    ps = GrpcParameterServer(1000, lr=0.5)
    yield ps
    ps.stop()


def _client(ps: GrpcParameterServer, n: int) -> GrpcClient:
    return GrpcClient(f"127.0.0.1:{ps.port}", n, timeout=10)


def test_pull_returns_initial_zeros(server):
    with _client(server, 1000) as c:
        out = np.full(1000, 7.0, dtype=np.float32)
        assert c.pull(out) is out
        np.testing.assert_array_equal(out, 0)
        assert c.step == 0


def test_pushes_from_two_clients_apply_sgd_exactly(server):
    # Small integers times lr = 0.5 are exact in float32, whatever the order of the pushes.
    grads = [np.arange(1000, dtype=np.float32) % 7, (np.arange(1000, dtype=np.float32) % 5) - 2]
    c0, c1 = _client(server, 1000), _client(server, 1000)
    try:
        c0.push(grads[0])
        c1.push(grads[1].reshape(10, 100))          # any shape with the right size
        expected = -0.5 * (grads[0] + grads[1])
        for c in (c0, c1):
            out = c.pull(np.empty((100, 10), dtype=np.float32))
            np.testing.assert_array_equal(out.reshape(-1), expected)
            assert c.step == 2
        assert server.pushes == 2
        np.testing.assert_array_equal(server.params, expected)
    finally:
        c0.close()
        c1.close()


def test_wrong_sizes_are_rejected(server):
    with _client(server, 1000) as c:
        with pytest.raises(ValueError, match="999"):
            c.push(np.zeros(999, dtype=np.float32))
        with pytest.raises(ValueError, match="1001"):
            c.pull(np.zeros(1001, dtype=np.float32))
    # A client that disagrees with the server about the model size gets INVALID_ARGUMENT.
    with _client(server, 10) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.push(np.zeros(10, dtype=np.float32))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert server.pushes == 0


def test_5mib_model_round_trips():
    # Over gRPC's default 4 MiB receive limit: only passes if the size options are applied.
    n = (5 << 20) // 4
    grad = (np.arange(n, dtype=np.float32) % 11) - 5
    ps = GrpcParameterServer(n, lr=0.5)
    try:
        with GrpcClient(f"127.0.0.1:{ps.port}", n, timeout=10) as c:
            c.push(grad)
            out = c.pull(np.empty(n, dtype=np.float32))
            np.testing.assert_array_equal(out, -0.5 * grad)
            assert c.step == 1
    finally:
        ps.stop()


def test_server_process_serves_and_exits_on_sigterm(tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradsync.bench.grpc_ps", "--elements", "1000", "--lr", "0.5",
         "--port-file", str(port_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            assert proc.poll() is None, f"server exited early:\n{proc.communicate()[0]}"
            assert time.monotonic() < deadline, "server wrote no port file within 20 s"
            time.sleep(0.05)
        port = int(port_file.read_text())
        with GrpcClient(f"127.0.0.1:{port}", 1000, timeout=10) as c:
            c.push(np.full(1000, 2.0, dtype=np.float32))
            np.testing.assert_array_equal(c.pull(np.empty(1000, dtype=np.float32)), -1.0)
            assert c.step == 1
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert not [p for p in os.listdir(tmp_path) if p != "port"], "temporary file left behind"
