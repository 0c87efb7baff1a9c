"""examples/train_digits.py through the real launcher: it must train to its target accuracy.

The example exits 1 when the final test accuracy is below ``--target``; these tests hold it to
that contract both ways and check the accuracy it prints.
"""

import re
from pathlib import Path

import pytest

from harness import launch

pytestmark = pytest.mark.multiprocess

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "train_digits.py")


def final_accuracy(output: str) -> float:
    found = re.findall(r"final test accuracy ([0-9.]+)", output)
    assert len(found) == 1, output  # printed once, by rank 0
    return float(found[0])


def test_two_ranks_reach_97_percent():
    result = launch(2, EXAMPLE, timeout=180)
    assert result.returncode == 0, result
    assert final_accuracy(result.output) >= 0.97, result
    epochs = re.findall(r"epoch +(\d+) +loss ([0-9.]+) +test accuracy", result.output)
    assert [int(e) for e, _ in epochs] == list(range(1, 21)), result
    assert float(epochs[-1][1]) < float(epochs[0][1]), result  # the loss went down


@pytest.mark.slow  # over 15 s on 2 cores: the slow tier (docs/testing.md)
def test_three_ranks_with_fp16_compression_and_bf16_autocast():
    result = launch(3, EXAMPLE, "--compression", "fp16", "--amp", timeout=180)
    assert result.returncode == 0, result
    assert "compression fp16, bf16 autocast" in result.output, result
    assert final_accuracy(result.output) >= 0.97, result


@pytest.mark.slow  # the exit status path; the default tier trains to the target already
def test_exits_nonzero_below_target():
    result = launch(2, EXAMPLE, "--epochs", "1", "--target", "0.999", timeout=120)
    assert result.returncode == 1, result
    assert final_accuracy(result.output) < 0.999, result
    assert "BELOW TARGET" in result.output, result
