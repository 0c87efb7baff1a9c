"""How the pieces road writes a slot (transport/segment_stores.py): the trial schedule, the
switch both ways, the modes, and the streaming copy of _shmfast.c itself."""

from __future__ import annotations

import numpy as np
import pytest

from gradsync import _native
from gradsync.config import STREAM_MODES, ConfigError, load_config
from gradsync.transport.segment_stores import MARGIN, MODES, PERIOD, WINDOW, Stores


def _copy(dst, src):
    dst[...] = src


def _run(stores: Stores, pieces: int, seconds) -> list[bool]:
    """``pieces`` full pieces; ``seconds(streamed)`` is what each takes. Returns the ways."""
    ways = []
    for _ in range(pieces):
        way = stores.stream_now()
        ways.append(way)
        stores.record(seconds(way))
    return ways


def test_each_period_times_a_window_the_way_in_force_then_one_the_other_way():
    s = Stores(_copy)
    ways = _run(s, 2 * PERIOD, lambda streamed: 1.0)  # a tie: the way in force stays
    for start in (0, PERIOD):
        assert ways[start:start + WINDOW] == [False] * WINDOW
        assert ways[start + WINDOW:start + 2 * WINDOW] == [True] * WINDOW
        assert not any(ways[start + 2 * WINDOW:start + PERIOD])
    assert [t[2] for t in s.trials] == [False, False] and not s.streaming


def test_the_other_way_wins_only_by_more_than_the_margin():
    near = Stores(_copy)
    _run(near, 2 * WINDOW, lambda streamed: (1 - MARGIN / 2) if streamed else 1.0)
    assert not near.streaming
    s = Stores(_copy)
    _run(s, 2 * WINDOW, lambda streamed: 0.3 if streamed else 1.0)  # the slow state
    assert s.streaming and s.trials == [(1.0, 0.3, True)]
    # in force now: the periods' trials time the ordinary way, and bring it back once the
    # state is over (the handover through the caches fast again)
    ways = _run(s, PERIOD, lambda streamed: 0.3 if streamed else 1.0)
    assert s.streaming and ways == [True] * (PERIOD - WINDOW) + [False] * WINDOW
    _run(s, PERIOD, lambda streamed: 0.3 if streamed else 0.15)
    assert not s.streaming and s.trials[-1] == (0.3, 0.15, True)


def test_a_window_is_judged_by_its_median_piece():
    s = Stores(_copy)
    times = iter([1.0] * WINDOW + [0.5] * (WINDOW - 3) + [50.0] * 3)  # 3 pieces preempted
    _run(s, 2 * WINDOW, lambda streamed: next(times))
    assert s.streaming


@pytest.mark.parametrize("mode", ["never", "always"])
def test_never_and_always_measure_nothing(mode):
    s = Stores(_copy, mode)
    assert _run(s, 2 * PERIOD, lambda streamed: 0.1 if streamed != (mode == "always") else 1.0) \
        == [mode == "always"] * (2 * PERIOD)
    assert s.trials == [] and not s.measuring and (s.copy is None) == (mode == "never")


def test_without_the_compiled_copy_nothing_streams():
    for mode in MODES:
        s = Stores(None, mode)
        assert not s.measuring and not s.streaming and not s.stream_now()


def test_the_setting():
    assert MODES == STREAM_MODES
    assert load_config(environ={"GRADSYNC_SHM_STREAM": "never"}).shm_stream == "never"
    assert load_config(environ={}).shm_stream == "auto"
    with pytest.raises(ConfigError, match="shm_stream"):
        load_config(environ={"GRADSYNC_SHM_STREAM": "sometimes"})
    with pytest.raises(ValueError, match="shm_stream"):
        Stores(_copy, "sometimes")


def test_the_streaming_copy_copies_every_byte_at_any_alignment():
    module = _native.load("_shmfast")
    assert module is not None, "the compiled module did not build (gradsync build-native)"
    src = np.random.default_rng(0).integers(0, 256, 1 << 17, dtype=np.uint8)
    for n in (0, 1, 15, 16, 17, 63, 64, 65, 127, 4096 + 7, 1 << 16):
        for at in (0, 1, 8, 15, 16, 33):
            for src_at in (0, 5):
                dst = np.zeros(n + 128, np.uint8)
                module.stream(dst[at:at + n], src[src_at:src_at + n])
                assert np.array_equal(dst[at:at + n], src[src_at:src_at + n]), (n, at, src_at)
                assert not dst[:at].any() and not dst[at + n:].any(), (n, at)
    with pytest.raises(ValueError, match="5 bytes into 4"):
        module.stream(np.zeros(4, np.uint8), np.zeros(5, np.uint8))
    with pytest.raises((ValueError, BufferError), match="contiguous"):
        module.stream(np.zeros(8, np.uint8)[::2], np.zeros(4, np.uint8))
    with pytest.raises((BufferError, TypeError)):  # a destination that is not writable
        module.stream(b"abcd", np.zeros(4, np.uint8))
