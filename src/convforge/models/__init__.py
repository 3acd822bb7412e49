"""Shipped network descriptions (Caffe prototxt written from the published architectures): the text only;
``convforge.graph.caffe.load_shipped`` builds a network from one."""

from __future__ import annotations

from importlib import resources

NAMES = ("alexnet", "nin", "googlenet", "vgg16", "resnet50")


def prototxt(name: str) -> str:
    """The text of shipped model ``name``."""
    if name not in NAMES:
        raise ValueError(f"model ({name!r}) is not shipped; known: {', '.join(NAMES)}")
    return resources.files(__name__).joinpath(f"{name}.prototxt").read_text()
