"""convforge: convolution kernels generated for the layer in front of it."""

from __future__ import annotations

from convforge.config import config
from convforge.spec import ConvSpec
from convforge.version import __version__

__all__ = ["__version__", "config", "ConvSpec", "conv2d", "conv_transpose2d", "algorithms", "compile"]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    # Lazy: importing convforge must not import a vendor API.
    if name in ("conv2d", "algorithms"):
        from convforge import api

        return getattr(api, name)
    if name == "conv_transpose2d":
        from convforge import transposed

        return transposed.conv_transpose2d
    if name == "compile":
        from convforge.graph import build

        return build.compile
    raise AttributeError(name)
