"""Server-side optimizers: torch.optim's SGD and Adam applied to a flat float32 NumPy shard.

A parameter server owns a *shard*: one flat float32 array that holds a contiguous slice of all
the model's parameters laid end to end. An *update* applies one flat gradient of the same size.
The server does not update the whole shard at once. So that workers can keep pushing and pulling
other parts of the shard while an update runs, it works *stripe by stripe*. A *stripe* is a
contiguous slice ``[lo, hi)`` of the shard (about 1 MiB), updated while the server holds that
stripe's lock. The optimizer therefore only ever sees ``params[lo:hi]`` and ``grad[lo:hi]``, and
it updates them together with the same slice of its own *state* (the momentum buffer or Adam's
moments), which it keeps as float32 arrays the size of the shard.

One update of a 10-element shard cut into the stripes [0, 4) and [4, 10)::

    opt = make("adam", 10, lr=1e-3)
    opt.begin_step()                              # step count becomes 1 for the whole update
    opt.update(shard[4:10], grad[4:10], 4, 10)    # stripes in any order, on any thread,
    opt.update(shard[0:4], grad[0:4], 0, 4)       # each stripe exactly once per update

The arithmetic repeats torch.optim's single-tensor code one operation at a time, in float32, with
every scalar rounded to float32 the way torch rounds it. The results therefore match torch to
within float32 rounding: torch's vectorised kernels fuse some multiply-adds, while NumPy rounds
after each operation. A run resumed from ``state_dict`` matches an uninterrupted run bit for bit.
"""

from __future__ import annotations

import inspect
import numbers
import operator
import threading
from typing import Any, Mapping

import numpy as np

__all__ = ["ServerOptimizer", "SGD", "Adam", "make"]


class ServerOptimizer:
    """Base of the shard optimizers: step count, state arrays, stripe checks and checkpoints.

    A subclass sets ``name`` and implements ``_validate`` (checks and normalises the
    hyperparameters), ``_state_names`` (the state arrays those hyperparameters need),
    ``_constants`` (the per-update scalars) and ``_update`` (the math on one stripe).

    Attributes:
        name: the name ``make`` knows the optimizer by.
        size: the number of elements in the shard.
        hyper: the validated hyperparameters, keyed by constructor argument. Treat this as
            read-only; use ``load_state_dict`` to change it.
    """

    name: str = ""

    def __init__(self, size: int, **hyper: Any) -> None:
        self.size = operator.index(size)
        if self.size < 0:
            raise ValueError(f"shard size must be >= 0, got {size}")
        self.hyper = self._validate(hyper)
        # All state is allocated here rather than on first use. Stripes update concurrently, so
        # lazy allocation under per-stripe locks would let two stripes each allocate a buffer.
        self._state = {n: np.zeros(self.size, np.float32) for n in self._state_names(self.hyper)}
        self._step = 0
        self._consts: Any = None  # set by begin_step; None means that update() is not allowed yet
        self._local = threading.local()

    @property
    def step_count(self) -> int:
        """How many updates have begun so far (torch's ``state["step"]``)."""
        return self._step

    def begin_step(self) -> None:
        """Start an update. Call this once before the update's first stripe, and never while a
        stripe is being updated."""
        # The step count belongs to the update, not to a stripe. Adam's bias correction and
        # SGD's "the first step copies the gradient" rule must see the same step in every
        # stripe, so the count advances here, once, and the scalars derived from it are
        # computed once too, rather than once per stripe.
        self._step += 1
        self._consts = self._constants(self._step)

    def update(self, params: np.ndarray, grad: np.ndarray, lo: int, hi: int) -> None:
        """Update the stripe ``[lo, hi)`` in place, using the same slice of the optimizer state.

        Args:
            params: the shard's float32 slice ``[lo, hi)``. It is written in place.
            grad: the gradient's float32 slice ``[lo, hi)``. It is only read.
            lo: where the stripe starts in the shard.
            hi: where the stripe ends in the shard (exclusive).

        Raises:
            ValueError: the stripe lies outside the shard, or an array's dtype or shape is wrong.
            RuntimeError: ``begin_step`` was not called since construction or the last load.
        """
        if self._consts is None:
            raise RuntimeError(f"{type(self).__name__}.update() called before begin_step()")
        lo, hi = operator.index(lo), operator.index(hi)
        if not 0 <= lo <= hi <= self.size:
            raise ValueError(f"stripe [{lo}, {hi}) is not inside the shard [0, {self.size})")
        for what, a in (("params", params), ("grad", grad)):
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (hi - lo,):
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(f"{what} of stripe [{lo}, {hi}) must be float32 of shape "
                                 f"({hi - lo},), got {got}")
        self._update(params, grad, lo, hi)

    def state_dict(self) -> dict[str, Any]:
        """Return a snapshot to resume from exactly: name, step, hyperparameters and state arrays.

        The arrays are copies. That way the snapshot stays fixed while later updates change the
        live state, for example while a checkpoint is being written in the background.
        """
        state: dict[str, Any] = {"name": self.name, "step": self._step, **self.hyper}
        state.update((n, a.copy()) for n, a in self._state.items())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a ``state_dict`` taken from an optimizer of the same kind and shard size.

        The snapshot's hyperparameters replace this optimizer's. The next update must begin
        with ``begin_step``.

        Raises:
            ValueError: the snapshot belongs to another optimizer, has missing or unexpected
                keys, has a bad hyperparameter or step, or holds a state array that is not
                float32 of shape ``(size,)``.
        """
        # np.load of an np.savez checkpoint turns scalars into 0-d arrays, so unwrap those.
        state = {k: v.item() if isinstance(v, np.ndarray) and v.ndim == 0 else v
                 for k, v in state.items()}
        if state.get("name") != self.name:
            raise ValueError(f"state is for optimizer {state.get('name')!r}, not {self.name!r}")
        missing = sorted(set(self.hyper) - set(state))
        if missing:
            raise ValueError(f"{self.name} state lacks hyperparameter(s) {missing}")
        hyper = self._validate({k: state[k] for k in self.hyper})
        names = self._state_names(hyper)
        expected = {"name", "step", *hyper, *names}
        if set(state) != expected:
            raise ValueError(f"{self.name} state has missing keys {sorted(expected - set(state))} "
                             f"and unexpected keys {sorted(set(state) - expected)}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"state step must be an integer >= 0, got {step!r}")
        arrays = {}
        for n in names:
            a = state[n]
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (self.size,):
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(f"state array {n!r} must be float32 of shape ({self.size},) "
                                 f"to match this shard, got {got}")
            arrays[n] = a.copy()
        # Commit only after every check has passed, so a rejected state leaves this optimizer
        # unchanged.
        self.hyper, self._state, self._step, self._consts = hyper, arrays, int(step), None

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Return two float32 work arrays of length ``n``, private to the calling thread."""
        # Several threads may update stripes of one update at the same time (NumPy ufuncs
        # release the GIL), so each thread gets its own work space. It grows to the largest
        # stripe seen, and after that an update allocates nothing.
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.shape[1] < n:
            buf = self._local.buf = np.empty((2, n), np.float32)
        return buf[0, :n], buf[1, :n]

    def _validate(self, hyper: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _state_names(self, hyper: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def _constants(self, step: int) -> Any:
        return step

    def _update(self, params: np.ndarray, grad: np.ndarray, lo: int, hi: int) -> None:
        raise NotImplementedError


class SGD(ServerOptimizer):
    """torch.optim.SGD on a shard: weight decay, then momentum (optionally Nesterov), then the step.

    As in torch, the first step sets the momentum buffer to the gradient without dampening.
    """

    name = "sgd"

    def __init__(self, size: int, *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(size, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)

    def _validate(self, hyper: dict[str, Any]) -> dict[str, Any]:
        lr, momentum = _real("lr", hyper["lr"], 0.0), _real("momentum", hyper["momentum"], 0.0)
        dampening = _real("dampening", hyper["dampening"], None)  # torch does not bound it
        weight_decay = _real("weight_decay", hyper["weight_decay"], 0.0)
        nesterov = _flag("nesterov", hyper["nesterov"])
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"nesterov=True requires momentum > 0 and dampening == 0, got "
                             f"momentum={momentum}, dampening={dampening}")
        return {"lr": lr, "momentum": momentum, "dampening": dampening,
                "weight_decay": weight_decay, "nesterov": nesterov}

    def _state_names(self, hyper: dict[str, Any]) -> list[str]:
        return ["momentum_buffer"] if hyper["momentum"] != 0 else []

    def _update(self, params: np.ndarray, grad: np.ndarray, lo: int, hi: int) -> None:
        h = self.hyper
        d, tmp = self._scratch(hi - lo)
        if h["weight_decay"] != 0:  # torch: grad = grad + weight_decay * param
            np.multiply(params, h["weight_decay"], out=d)
            np.add(d, grad, out=d)
            grad = d
        if h["momentum"] != 0:
            buf = self._state["momentum_buffer"][lo:hi]
            if self._consts == 1:  # torch's "buffer is None": the first step copies the gradient
                np.copyto(buf, grad)
            else:  # buf = momentum * buf + (1 - dampening) * grad
                buf *= h["momentum"]
                if h["dampening"] == 0:  # torch multiplies by exactly 1.0; skip that pass
                    buf += grad
                else:
                    np.multiply(grad, 1 - h["dampening"], out=tmp)
                    buf += tmp
            if h["nesterov"]:  # grad + momentum * buf
                np.multiply(buf, h["momentum"], out=tmp)
                np.add(grad, tmp, out=d)
                grad = d
            else:
                grad = buf
        np.multiply(grad, h["lr"], out=tmp)
        params -= tmp


class Adam(ServerOptimizer):
    """torch.optim.Adam on a shard: L2 weight decay added to the gradient, bias-corrected moments,
    and optionally AMSGrad's running maximum of the second moment."""

    name = "adam"

    def __init__(self, size: int, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        super().__init__(size, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad)

    def _validate(self, hyper: dict[str, Any]) -> dict[str, Any]:
        try:
            beta1, beta2 = hyper["betas"]
        except (TypeError, ValueError):
            raise ValueError(
                f"betas must be a pair (beta1, beta2), got {hyper['betas']!r}") from None
        betas = (_real("betas[0]", beta1, 0.0, 1.0), _real("betas[1]", beta2, 0.0, 1.0))
        return {"lr": _real("lr", hyper["lr"], 0.0), "betas": betas,
                "eps": _real("eps", hyper["eps"], 0.0),
                "weight_decay": _real("weight_decay", hyper["weight_decay"], 0.0),
                "amsgrad": _flag("amsgrad", hyper["amsgrad"])}

    def _state_names(self, hyper: dict[str, Any]) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hyper["amsgrad"] else [])

    def _constants(self, step: int) -> tuple[float, float, np.float32]:
        beta1, beta2 = self.hyper["betas"]
        step_size = self.hyper["lr"] / (1 - beta1**step)  # in float64, as torch computes it
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        return -step_size, bias_correction2_sqrt, np.float32(1 - beta1)

    def _update(self, params: np.ndarray, grad: np.ndarray, lo: int, hi: int) -> None:
        h = self.hyper
        neg_step_size, bias_correction2_sqrt, weight = self._consts
        exp_avg, exp_avg_sq = self._state["exp_avg"][lo:hi], self._state["exp_avg_sq"][lo:hi]
        t1, t2 = self._scratch(hi - lo)
        if h["weight_decay"] != 0:  # torch: grad = grad + weight_decay * param
            np.multiply(params, h["weight_decay"], out=t1)
            np.add(t1, grad, out=t1)
            grad = t1
        # exp_avg.lerp_(grad, 1 - beta1). Torch switches formula at weight 0.5 to keep rounding
        # small, so do the same to get its results.
        np.subtract(grad, exp_avg, out=t2)
        if weight < 0.5:
            t2 *= weight
            exp_avg += t2
        else:
            t2 *= np.float32(1) - weight
            np.subtract(grad, t2, out=exp_avg)
        # exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad. Torch's addcmul evaluates
        # left to right, so the scalar multiplies first.
        np.multiply(grad, 1 - h["betas"][1], out=t2)
        t2 *= grad
        exp_avg_sq *= h["betas"][1]
        exp_avg_sq += t2
        second = exp_avg_sq
        if h["amsgrad"]:
            second = self._state["max_exp_avg_sq"][lo:hi]
            np.maximum(second, exp_avg_sq, out=second)
        np.sqrt(second, out=t2)  # denom = sqrt(v) / sqrt(bias_correction2) + eps
        t2 /= bias_correction2_sqrt
        t2 += h["eps"]
        np.multiply(exp_avg, neg_step_size, out=t1)  # addcdiv: (value * exp_avg) / denom
        t1 /= t2
        params += t1


def _real(name: str, value: Any, low: float | None, high: float | None = None) -> float:
    """Return ``value`` as a Python float in ``[low, high)``, or raise a ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    # Use a Python float, never a NumPy scalar. NumPy would compute a float32 array times a
    # float64 scalar in float64 and round differently from torch, which rounds the scalar to
    # float32 first. The comparisons below also reject NaN, as torch.optim.Adam does.
    value = float(value)
    if low is not None and not low <= value:
        raise ValueError(f"invalid {name}: {value} (must be >= {low})")
    if high is not None and not value < high:
        raise ValueError(f"invalid {name}: {value} (must be < {high})")
    return value


def _flag(name: str, value: Any) -> bool:
    """Return ``value`` as a bool. Reject other types, because ``bool("false")`` is True."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


_OPTIMIZERS = {cls.name: cls for cls in (SGD, Adam)}


def make(name: str, size: int, **hyper: Any) -> ServerOptimizer:
    """Build the optimizer ``name`` (``"sgd"`` or ``"adam"``, in any case) for a shard of ``size``.

    Raises:
        ValueError: an unknown optimizer, or a missing, unknown or invalid hyperparameter.
    """
    cls = _OPTIMIZERS.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"unknown server optimizer {name!r}; expected one of {sorted(_OPTIMIZERS)}")
    params = inspect.signature(cls).parameters
    accepted = [p for p in params if p != "size"]
    unknown = sorted(set(hyper) - set(accepted))
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {unknown} for {cls.name!r}; "
                         f"accepted: {accepted}")
    missing = [p for p in accepted if params[p].default is params[p].empty and p not in hyper]
    if missing:
        raise ValueError(f"{cls.name!r} requires hyperparameter(s) {missing}")
    return cls(size, **hyper)
