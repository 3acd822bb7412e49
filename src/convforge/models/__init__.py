"""Shipped network descriptions (Caffe prototxt written from the published architectures)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from convforge.graph.ir import Graph

NAMES = ("alexnet", "nin", "googlenet", "vgg16", "resnet50")


def prototxt(name: str) -> str:
    """The text of shipped model ``name``."""
    if name not in NAMES:
        raise ValueError(f"model ({name!r}) is not shipped; known: {', '.join(NAMES)}")
    return resources.files(__name__).joinpath(f"{name}.prototxt").read_text()


def load(name: str, seed: int = 0, input_size: int | None = None, batch: int | None = None,
         weights: str | Path | None = None) -> Graph:
    """The IR of shipped model ``name`` with random weights (``seed``) or a ``.caffemodel``."""
    from convforge.graph.caffe import load_prototxt

    return load_prototxt(prototxt(name), weights=weights, seed=seed, input_size=input_size, batch=batch)
