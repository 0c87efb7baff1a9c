"""The gRPC parameter-server baseline: tensors as protobuf ``bytes``, one RPC per push or pull.

gradsync's parameter server moves tensors through one-sided memory regions: a worker writes its
gradient straight into memory the server registered, and reads the parameters straight out of
it. "RPC considered harmful" (Xue et al., SoCC 2019) measured how much that saves against what
most parameter servers of the time did: send every tensor through an RPC framework, carried in
a serialised message. This module is that peer, built the way a careful user would build it
with stock gRPC and protobuf, so that a benchmark can put it beside gradsync in the same run:

    service gradsync_bench.ParameterServer {
      rpc Push(Tensor) returns (Empty);   // params -= lr * grad, under a lock
      rpc Pull(Empty) returns (Tensor);   // a consistent snapshot, step = updates applied
    }
    message Tensor { bytes data = 1; uint64 step = 2; }   // data: little-endian float32
    message Empty {}

Where the copies happen. A ``bytes`` field cannot borrow a numpy array's memory, so every hop
that a real gRPC PS makes is a copy, and this baseline makes exactly those, no more:

    push  worker:  grad.tobytes()            array -> Python bytes
                   SerializeToString()       bytes -> protobuf wire format
                   gRPC send                 -> HTTP/2 DATA frames (16 KiB by default) -> TCP
          server:  gRPC receive              TCP -> reassembled message
                   Tensor.FromString(), .data  wire format -> message -> Python bytes
                   np.frombuffer             no copy: a read-only view of those bytes
                   params -= lr * grad       the update itself (in place, scratch reused)
    pull  server:  params.tobytes()          the snapshot, taken under the lock
                   Tensor(data=...), SerializeToString()
                   gRPC send / receive       HTTP/2 and TCP, as above
          worker:  FromString(), .data, np.frombuffer, then one copy into the caller's ``out``

gradsync's one-sided path makes none of the serialising copies and no framing: that difference
is what the benchmark measures. To keep the comparison fair the baseline is tuned the way one
would tune it in production: the server runs in its own process (``python -m
gradsync.bench.grpc_ps``), so its GIL is not shared with the workers; the message-size limits
(4 MiB to receive by default) are raised to fit the model; the server reuses one scratch buffer
for ``lr * grad`` instead of allocating per push; compression stays off (gradients do not
compress, and it would only add CPU time).

The message classes are built at import time from a ``FileDescriptorProto`` written in code,
so neither ``protoc`` nor ``grpcio-tools`` is needed; the service is registered with
``grpc.method_handlers_generic_handler`` and called through ``channel.unary_unary``, which is
exactly what the generated ``*_pb2_grpc.py`` stubs do.

    python -m gradsync.bench.grpc_ps --elements 4194304 --lr 0.01 --port-file /tmp/ps.port
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["Tensor", "Empty", "GrpcParameterServer", "GrpcClient", "serve_forever", "main"]

_PACKAGE = "gradsync_bench"
_SERVICE = f"{_PACKAGE}.ParameterServer"
_PUSH = f"/{_SERVICE}/Push"
_PULL = f"/{_SERVICE}/Pull"
_DTYPE = np.dtype("<f4")
_DEFAULT_MAX_MESSAGE = 4 << 20   # gRPC's default receive limit


def _build_messages():
    """Builds ``Tensor`` and ``Empty`` from a descriptor written in code (no protoc)."""
    f = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name=f"{_PACKAGE}/grpc_ps.proto", package=_PACKAGE, syntax="proto3")
    tensor = proto.message_type.add(name="Tensor")
    tensor.field.add(name="data", number=1, type=f.TYPE_BYTES, label=f.LABEL_OPTIONAL)
    tensor.field.add(name="step", number=2, type=f.TYPE_UINT64, label=f.LABEL_OPTIONAL)
    proto.message_type.add(name="Empty")
    # A private pool: the default one is process-wide, and a second import of this module
    # (``python -m`` runs it as ``__main__`` beside the package copy) would collide there.
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.Tensor")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.Empty")))


Tensor, Empty = _build_messages()


def _channel_options(num_elements: int) -> "list[tuple[str, int]]":
    """Message-size limits that fit one model message: twice its bytes plus 1 MiB of slack."""
    limit = max(_DEFAULT_MAX_MESSAGE, 2 * num_elements * _DTYPE.itemsize + (1 << 20))
    if limit >= 1 << 31:
        raise ValueError(f"a model of {num_elements} float32 elements needs messages of "
                         f"{limit} bytes, over gRPC's 2 GiB limit")
    return [("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit)]


def _check_elements(num_elements: int) -> None:
    if not isinstance(num_elements, int) or num_elements < 0:
        raise ValueError(f"num_elements must be a non-negative int, got {num_elements!r}")


class GrpcParameterServer:
    """A gRPC parameter server over one flat float32 model, applying plain SGD.

    Serves on ``host`` at an ephemeral port (``port``) from the moment it is constructed.

    Args:
        num_elements: Model size in float32 elements; the parameters start at zero.
        lr: Learning rate of the SGD update ``params -= lr * grad``.
        host: Address to listen on.
        max_workers: Threads of the server's pool, i.e. RPCs handled at once.

    Attributes:
        port: The TCP port the server listens on.
        params: The live parameters (float32, updated in place by every push).
        pushes: Number of pushes applied so far (also the ``step`` that a pull returns).
    """

    def __init__(self, num_elements: int, lr: float = 0.01, host: str = "127.0.0.1",
                 max_workers: int = 8) -> None:
        _check_elements(num_elements)
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self.params = np.zeros(num_elements, dtype=_DTYPE)
        self.pushes = 0
        self._lr = np.float32(lr)
        self._nbytes = self.params.nbytes
        self._scratch = np.empty_like(self.params)   # lr * grad, reused under the lock
        self._lock = threading.Lock()
        handlers = {
            "Push": grpc.unary_unary_rpc_method_handler(
                self._push, request_deserializer=Tensor.FromString,
                response_serializer=Empty.SerializeToString),
            "Pull": grpc.unary_unary_rpc_method_handler(
                self._pull, request_deserializer=Empty.FromString,
                response_serializer=Tensor.SerializeToString),
        }
        self._server = grpc.server(ThreadPoolExecutor(max_workers=max_workers),
                                   options=_channel_options(num_elements))
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        bind = f"[{host}]:0" if ":" in host else f"{host}:0"
        self.port = self._server.add_insecure_port(bind)
        if not self.port:   # older grpcio returns 0 instead of raising
            raise OSError(f"gRPC server could not bind {bind}")
        self._server.start()

    def _push(self, request, context):
        data = request.data
        if len(data) != self._nbytes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"push of {len(data)} bytes, but the model has {self._nbytes}")
        grad = np.frombuffer(data, dtype=_DTYPE)
        with self._lock:
            np.multiply(grad, self._lr, out=self._scratch)
            self.params -= self._scratch
            self.pushes += 1
        return Empty()

    def _pull(self, request, context):
        # The copy under the lock is the consistency point: a pull never sees half a push.
        with self._lock:
            data = self.params.tobytes()
            step = self.pushes
        return Tensor(data=data, step=step)

    def stop(self, grace: "float | None" = None) -> None:
        """Stops serving; with ``grace``, lets RPCs in flight finish for that many seconds."""
        self._server.stop(grace).wait()

    def __enter__(self) -> "GrpcParameterServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class GrpcClient:
    """A worker's connection to a :class:`GrpcParameterServer`.

    Args:
        address: ``host:port`` of the server.
        num_elements: Model size in float32 elements; must match the server's.
        timeout: Seconds each RPC may take (including waiting for the server to be reachable)
            before it fails with ``grpc.RpcError``; None waits forever.

    Attributes:
        step: The server's update count in the snapshot of the last pull (0 before any).
    """

    def __init__(self, address: str, num_elements: int, *, timeout: "float | None" = 60.0) -> None:
        _check_elements(num_elements)
        self.num_elements = num_elements
        self.step = 0
        self._timeout = timeout
        self._channel = grpc.insecure_channel(address, options=_channel_options(num_elements))
        self._push = self._channel.unary_unary(
            _PUSH, request_serializer=Tensor.SerializeToString,
            response_deserializer=Empty.FromString)
        self._pull = self._channel.unary_unary(
            _PULL, request_serializer=Empty.SerializeToString,
            response_deserializer=Tensor.FromString)
        self._empty = Empty()

    def push(self, grad: np.ndarray) -> None:
        """Sends ``grad`` (any shape, ``num_elements`` values, cast to float32) to be applied."""
        if grad.size != self.num_elements:
            raise ValueError(f"push of {grad.size} elements, but the model has "
                             f"{self.num_elements}")
        data = np.asarray(grad, dtype=_DTYPE).tobytes()
        # wait_for_ready: a worker that starts before the server waits instead of failing.
        self._push(Tensor(data=data), timeout=self._timeout, wait_for_ready=True)

    def pull(self, out: np.ndarray) -> np.ndarray:
        """Fills ``out`` (``num_elements`` values, any shape) with the parameters; returns it."""
        if out.size != self.num_elements:
            raise ValueError(f"pull into {out.size} elements, but the model has "
                             f"{self.num_elements}")
        reply = self._pull(self._empty, timeout=self._timeout, wait_for_ready=True)
        params = np.frombuffer(reply.data, dtype=_DTYPE)
        if params.size != self.num_elements:
            raise ValueError(f"server sent {params.size} elements, but the model has "
                             f"{self.num_elements}")
        np.copyto(out, params.reshape(out.shape))
        self.step = reply.step
        return out

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> "GrpcClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write_atomically(path: str, text: str) -> None:
    """Writes ``path`` through a temporary file and a rename, so a reader sees all or nothing."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".grpc_ps.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def serve_forever(num_elements: int, lr: float, host: str, ready_file: str) -> None:
    """Serves until SIGTERM or SIGINT; writes the port to ``ready_file`` once it is serving.

    Must run in the main thread (it installs the signal handlers).
    """
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = GrpcParameterServer(num_elements, lr=lr, host=host)
        try:
            _write_atomically(ready_file, f"{server.port}\n")
            # The kernel delivers a stop signal to any thread that does not block it (gRPC's,
            # OpenBLAS's): one caught by another thread only flags it for this one, which
            # would sleep on in an endless wait. Woken each second, it runs the handler.
            while not stopping.wait(1.0):
                pass
        finally:
            server.stop(grace=1.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradsync.bench.grpc_ps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, required=True, help="model size in float32 elements")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port-file", required=True,
                   help="file to write the port to once serving (written atomically)")
    args = p.parse_args(argv)
    if args.elements < 0:
        p.error(f"--elements must be non-negative, got {args.elements}")
    serve_forever(args.elements, args.lr, args.host, args.port_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
