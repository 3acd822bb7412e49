"""convforge: convolution kernels generated for the layer in front of it."""

from __future__ import annotations

__version__ = "0.1.0"

from convforge.config import config  # noqa: E402
from convforge.spec import ConvSpec  # noqa: E402

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
