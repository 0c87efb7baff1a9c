"""Compression on the slow tier through both front doors on two emulated hosts of two ranks
(tests/ranks/compress_tiers.py): shared memory inside a host, TCP between, the Horovod API's
World and a DDP hook's groups (gloo and gradsync) each placing the ranks by host name."""

import pytest

from harness import spawn


@pytest.mark.multiprocess
@pytest.mark.slow  # 4 ranks, 2 emulated hosts, 3 kinds of group: 25 s on a loaded machine
def test_slow_tier_compression_on_both_front_doors():
    ranks = spawn(4, "compress_tiers.py", timeout=150,
                  per_rank_env=lambda r: {"GRADSYNC_HOSTNAME": f"host-{'aabb'[r]}"})
    for r in ranks:
        assert r.returncode == 0, r
        assert "count 17" in r.output, r
