"""Pure logic: the server-side optimizers against torch.optim, stripe by stripe."""

import io

import numpy as np
import pytest
import torch

from gradsync.ps.optim import SGD, Adam, make

SIZE = 1000
# Uneven stripes in a shuffled order: each stripe's result must depend only on its own slice.
STRIPES = [(500, 1000), (0, 7), (7, 500)]

CASES = [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.3)),
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("adam", dict()),
    ("adam", dict(lr=1e-2, weight_decay=0.1)),
    ("adam", dict(lr=1e-2, amsgrad=True)),
    ("adam", dict(lr=1e-2, betas=(0.3, 0.6), weight_decay=0.1, amsgrad=True)),  # lerp weight >= 0.5
]
IDS = [name + "-" + ("-".join(f"{k}={v}" for k, v in hyper.items()) or "default")
       for name, hyper in CASES]


def _data(steps, seed=0):
    rng = np.random.default_rng(seed)
    params = rng.standard_normal(SIZE).astype(np.float32)
    return params, [rng.standard_normal(SIZE).astype(np.float32) for _ in range(steps)]


def _run(opt, params, grads):
    for grad in grads:
        opt.begin_step()
        for lo, hi in STRIPES:
            opt.update(params[lo:hi], grad[lo:hi], lo, hi)


def _torch_run(name, hyper, params, grads):
    tensor = torch.tensor(params, requires_grad=True)
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[name]([tensor], **hyper)
    for grad in grads:
        tensor.grad = torch.from_numpy(grad.copy())
        opt.step()
    return tensor.detach().numpy()


@pytest.mark.parametrize("name, hyper", CASES, ids=IDS)
def test_matches_torch_optim(name, hyper):
    params, grads = _data(steps=5)
    expected = _torch_run(name, hyper, params, grads)
    opt = make(name, SIZE, **hyper)
    _run(opt, params, grads)
    assert opt.step_count == 5
    np.testing.assert_allclose(params, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name, hyper", CASES, ids=IDS)
def test_resume_from_state_dict_is_exact(name, hyper):
    params, grads = _data(steps=8, seed=1)
    uninterrupted = params.copy()
    _run(make(name, SIZE, **hyper), uninterrupted, grads)

    first = make(name, SIZE, **hyper)
    _run(first, params, grads[:5])
    state = first.state_dict()
    _run(first, params.copy(), grads[5:6])  # the snapshot must not see later updates
    resumed = make(name, SIZE, **{**hyper, "lr": 0.5})  # the snapshot's hyperparameters win
    resumed.load_state_dict(state)
    assert resumed.hyper == first.hyper and resumed.step_count == 5
    _run(resumed, params, grads[5:])
    np.testing.assert_array_equal(params, uninterrupted)


def test_state_dict_survives_npz():
    params, grads = _data(steps=2)
    opt = Adam(SIZE, amsgrad=True)
    _run(opt, params, grads)
    file = io.BytesIO()
    np.savez(file, **opt.state_dict())
    file.seek(0)
    fresh = Adam(SIZE, amsgrad=True)
    fresh.load_state_dict(dict(np.load(file)))
    assert fresh.step_count == 2 and fresh.hyper == opt.hyper
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        np.testing.assert_array_equal(fresh.state_dict()[key], opt.state_dict()[key])


def test_make_is_case_insensitive():
    assert isinstance(make("Adam", 4), Adam) and isinstance(make("SGD", 4, lr=0.1), SGD)


@pytest.mark.parametrize("name, hyper, match", [
    ("rmsprop", dict(lr=0.1), "rmsprop"),
    ("sgd", dict(lr=-0.1), "lr: -0.1"),
    ("sgd", dict(lr=float("nan")), "lr: nan"),
    ("sgd", dict(), "requires.*lr"),
    ("sgd", dict(lr=0.1, momentum=-0.5), "momentum: -0.5"),
    ("sgd", dict(lr=0.1, weight_decay=-1), "weight_decay: -1"),
    ("sgd", dict(lr=0.1, nesterov=True), "nesterov.*momentum=0.0"),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov="yes"), "nesterov.*'yes'"),
    ("sgd", dict(lr=0.1, beta=0.9), "unknown hyperparameter.*beta"),
    ("adam", dict(betas=(1.0, 0.999)), r"betas\[0\]: 1.0"),
    ("adam", dict(betas=(0.9, -0.1)), r"betas\[1\]: -0.1"),
    ("adam", dict(betas=0.9), "betas must be a pair"),
    ("adam", dict(eps=-1e-8), "eps: -1e-08"),
    ("adam", dict(lr="0.1"), "lr must be a real number"),
])
def test_bad_optimizer_or_hyperparameter(name, hyper, match):
    with pytest.raises(ValueError, match=match):
        make(name, 10, **hyper)


def test_load_rejects_mismatched_state():
    state = SGD(10, lr=0.1, momentum=0.9).state_dict()
    with pytest.raises(ValueError, match=r"'momentum_buffer' must be float32 of shape \(11,\)"):
        SGD(11, lr=0.1, momentum=0.9).load_state_dict(state)
    with pytest.raises(ValueError, match="for optimizer 'sgd', not 'adam'"):
        Adam(10).load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing keys \['momentum_buffer'\]"):
        SGD(10, lr=0.1).load_state_dict({k: v for k, v in state.items() if k != "momentum_buffer"})


def test_update_checks_stripe_and_order():
    opt, params = SGD(10, lr=0.1), np.zeros(10, np.float32)
    with pytest.raises(RuntimeError, match="before begin_step"):
        opt.update(params[:5], params[:5], 0, 5)
    opt.begin_step()
    with pytest.raises(ValueError, match=r"stripe \[5, 11\) is not inside the shard \[0, 10\)"):
        opt.update(params[5:], params[5:], 5, 11)
    with pytest.raises(ValueError, match="grad of stripe.*float64"):
        opt.update(params[:5], np.zeros(5), 0, 5)
