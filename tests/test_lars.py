"""LARS and LARC (gradsync/torch/lars.py) against updates worked by hand, in one process.

A weight W = [[3, 4]] (norm 5) with gradient [[0.6, 0.8]] (norm 1), weight decay 0.1,
trust 0.02: the trust ratio is 0.02 * 5 / (1 + 0.1 * 5) = 1/15, and the decayed gradient
[[0.9, 1.2]]. A bias b = [1, -1] with gradient [0.5, 0.5] is excluded (one dimension): its
step is plain SGD with weight decay, [0.6, 0.4] times the learning rate.
"""

from __future__ import annotations

import pytest
import torch

from gradsync.torch import LARS


def make(lr: float, clip: bool, momentum: float = 0.0):
    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))
    b = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    w.grad = torch.tensor([[0.6, 0.8]])
    b.grad = torch.tensor([0.5, 0.5])
    inner = torch.optim.SGD([w, b], lr=lr, momentum=momentum, weight_decay=0.1)
    return w, b, LARS(inner, trust=0.02, clip=clip, eps=0.0)


@pytest.mark.parametrize("clip, lr, want_w", [
    # LARS: the decayed gradient times 1/15 = [[0.06, 0.08]], at lr 0.5.
    (False, 0.5, [[3 - 0.5 * 0.06, 4 - 0.5 * 0.08]]),
    # LARC: the rate is min(1/15, 0.5) = 1/15, so the step is [[0.06, 0.08]] (1/15 / 0.5
    # = 2/15 of the decayed gradient at lr 0.5).
    (True, 0.5, [[3 - 0.06, 4 - 0.08]]),
    # LARC below the trust-based rate: 1/15 / 0.01 > 1 is clipped to 1: plain SGD at 0.01.
    (True, 0.01, [[3 - 0.01 * 0.9, 4 - 0.01 * 1.2]]),
])
def test_update_matches_the_hand_computed_one(clip, lr, want_w):
    w, b, opt = make(lr, clip)
    opt.step()
    assert torch.allclose(w, torch.tensor(want_w), atol=1e-6), w
    assert torch.allclose(b, torch.tensor([1 - lr * 0.6, -1 - lr * 0.4]), atol=1e-6), b
    # The group's weight decay is back (folded into the gradient for that one step).
    assert opt.param_groups[0]["weight_decay"] == 0.1


def test_momentum_accumulates_the_scaled_gradient():
    w, b, opt = make(0.5, clip=False, momentum=0.9)
    opt.step()
    assert torch.allclose(opt.state[w]["momentum_buffer"], torch.tensor([[0.06, 0.08]]))
    # Second step, same gradient: ratio 0.02 * |W1| / (1 + 0.1 |W1|), buffer 0.9 b1 + g2.
    w1 = w.detach().clone()
    w.grad = torch.tensor([[0.6, 0.8]])
    b.grad = torch.tensor([0.5, 0.5])
    opt.step()
    ratio = 0.02 * float(w1.norm()) / (1 + 0.1 * float(w1.norm()))
    g2 = ratio * (torch.tensor([[0.6, 0.8]]) + 0.1 * w1)
    want = w1 - 0.5 * (0.9 * torch.tensor([[0.06, 0.08]]) + g2)
    assert torch.allclose(w, want, atol=1e-6)


def test_local_rates_and_zero_tensors():
    w, b, opt = make(0.5, clip=False)
    rates = opt.local_rates()
    assert set(map(id, rates)) == {id(w)}  # the bias is excluded
    assert rates[w] == pytest.approx(1 / 15)
    with torch.no_grad():
        w.zero_()  # no weights yet: the plain rate
    assert opt.local_rates()[w] == 1.0
    everything = LARS(opt.optimizer, trust=0.02, exclude=None)
    assert set(map(id, everything.local_rates())) == {id(w), id(b)}


def test_shares_state_and_groups_with_the_wrapped_optimizer():
    w, b, opt = make(0.5, clip=True, momentum=0.9)
    opt.step()
    saved = opt.state_dict()
    assert saved["param_groups"] == opt.optimizer.state_dict()["param_groups"]
    opt.load_state_dict(saved)
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    scheduler = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)  # warm-up from lr/4
    w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    opt.step()
    scheduler.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)


def test_arguments_are_checked():
    with pytest.raises(TypeError):
        LARS([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(ValueError, match="trust"):
        LARS(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), trust=0)
