"""The native beater (gradsync/liveness/beater.py, collectives/_shmfast.c): it beats while the GIL
is held, never after ``remove`` returns, never into a descriptor the process reuses; ``close``
ends its thread, and a child of ``fork`` releases it without the thread it does not have."""

import ctypes
import os
import socket
import time

import numpy as np
import pytest

from gradsync import _native
from gradsync.liveness import beater

BEAT = b"\x01"


@pytest.fixture
def beats():
    """A running beater every 20 ms (built here if this machine has not built it yet)."""
    if _native.load("_shmfast") is None:
        pytest.skip("no compiled module on this machine (no C compiler): the Python beats")
    made = beater.start(0.02)
    yield made
    made.close()


def _rounds(beats, n: int, seconds: float = 10.0) -> None:
    """Returns once the beater has made ``n`` more rounds."""
    target = beats.rounds + n
    deadline = time.monotonic() + seconds
    while beats.rounds < target:
        assert time.monotonic() < deadline, f"fewer than {n} rounds in {seconds}s"
        time.sleep(0.005)


def _unread(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    got = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except BlockingIOError:
            return got
        if not chunk:
            return got
        got += chunk


def test_it_beats_on_sockets_and_words_while_the_gil_is_held(beats):
    ours, theirs = socket.socketpair()
    words = np.zeros(4, np.int64)
    try:
        beats.add_socket(ours.fileno(), BEAT)
        beats.add_word(words, 2)
        before = beats.rounds
        # ctypes.pythonapi is a PyDLL: the call keeps the GIL for its 0.5 s.
        ctypes.pythonapi.usleep(500_000)
        made = beats.rounds - before
        # 25 rounds at 20 ms; a crowded machine delays some of them
        assert made >= 5, made
        got = _unread(theirs)
        assert set(got) == {BEAT[0]} and len(got) >= made, got
        assert words[2] >= made and words[[0, 1, 3]].tolist() == [0, 0, 0], words
    finally:
        ours.close()
        theirs.close()


def test_nothing_is_written_once_remove_returns(beats):
    ours, theirs = socket.socketpair()
    words = np.zeros(1, np.int64)
    try:
        on_socket = beats.add_socket(ours.fileno(), BEAT)
        on_word = beats.add_word(words, 0)
        # The first beat at once (a crowded machine may let the next round come before this
        # read: CI saw two).
        got = _unread(theirs)
        assert got and set(got) == {BEAT[0]}, got
        beats.remove(on_socket)
        beats.remove(on_word)
        beats.remove(on_word)  # twice: harmless
        counted = int(words[0])
        _rounds(beats, 5)
        assert _unread(theirs) == b"" and words[0] == counted
    finally:
        ours.close()
        theirs.close()


def test_a_closed_sockets_number_reused_gets_no_beat(beats):
    # The rule is remove, then close; closed first, the beater writes its own duplicate, the
    # old socket, never the new one that took the number.
    ours, theirs = socket.socketpair()
    number = ours.fileno()
    ident = beats.add_socket(number, BEAT)
    ours.close()
    theirs.close()
    reused, peer = socket.socketpair()
    try:
        assert number in (reused.fileno(), peer.fileno())  # the lowest free numbers
        _rounds(beats, 5)
        assert _unread(reused) == b"" and _unread(peer) == b""
    finally:
        beats.remove(ident)
        reused.close()
        peer.close()


def _beaters() -> int:
    """This process's threads named as the beater names its own (``gs-beater``): counting every
    thread would count the others this process starts and ends meanwhile."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "gs-beater"
        except FileNotFoundError:  # a thread that ended while listed
            pass
    return count


def test_close_ends_the_thread_and_the_beater_takes_nothing_new():
    if _native.load("_shmfast") is None:
        pytest.skip("no compiled module on this machine (no C compiler): the Python beats")
    ours, theirs = socket.socketpair()
    try:
        before = _beaters()
        beats = beater.start(0.02)
        assert _beaters() == before + 1
        beats.add_socket(ours.fileno(), BEAT)
        beats.close()
        assert _beaters() == before  # joined: it beats no more
        rounds = beats.rounds
        _unread(theirs)
        beats.close()  # twice: harmless
        assert beats.rounds == rounds and _unread(theirs) == b""
        with pytest.raises(ValueError, match="closed"):
            beats.add_socket(ours.fileno(), BEAT)
    finally:
        ours.close()
        theirs.close()


def test_a_forked_child_releases_the_beater_without_its_thread(beats):
    # The child has no beater thread (nor, perhaps, a usable copy of its mutex): it releases
    # the targets and closes without them, and refuses a target that nothing would beat.
    ours, theirs = socket.socketpair()
    ident = beats.add_socket(ours.fileno(), BEAT)
    pid = os.fork()
    if pid == 0:  # the child: refuse a new target, release, close, done
        status = 1
        try:
            try:
                beats.add_socket(ours.fileno(), BEAT)  # nothing would beat it here
                status = 2
            except ValueError:
                beats.remove(ident)
                beats.close()
                status = 0
        finally:
            os._exit(status)
    try:
        deadline = time.monotonic() + 10
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, done
        _unread(theirs)
        _rounds(beats, 3)  # the parent's beater goes on
        assert _unread(theirs).startswith(BEAT)
    finally:
        beats.remove(ident)
        ours.close()
        theirs.close()
