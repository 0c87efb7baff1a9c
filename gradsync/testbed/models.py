"""The models that ``gradsync bench train`` times and ``gradsync simulate`` predicts.

Both tools must train the same networks: ``simulate``'s measured-here points
(``simulate/measure.py``) run ``bench train`` on emulated clusters and time the compute of
these models in their own process, and its step model is checked against those runs. So the
models live here, below both tools, and neither imports the other for them.
"""

from __future__ import annotations

__all__ = ["MODELS", "build_model"]

MODELS = ("mlp", "cnn")


def build_model(name: str):
    """The model ``name`` (one of ``MODELS``) and the shape of one input sample.

    ``mlp``: 1024-1024-1024-10, 2.1M parameters (8.4 MB of gradients), little compute per
    byte, so communication matters. ``cnn``: three 3x3 convolutions with pooling and two
    linear layers on CIFAR-sized input (3x32x32), 0.62M parameters, compute-bound.
    """
    import torch.nn as nn

    if name == "mlp":
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10)), (1024,)
    if name == "cnn":
        def conv(c_in, c_out):
            return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]

        model = nn.Sequential(*conv(3, 32), *conv(32, 64), *conv(64, 128), nn.Flatten(),
                              nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10))
        return model, (3, 32, 32)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
