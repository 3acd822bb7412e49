"""Whole networks: the graph IR, front-ends, passes, the float64 reference and the runtime."""

from __future__ import annotations

from convforge.graph.ir import Graph, GraphError, Node, Tensor, infer

__all__ = ["Graph", "GraphError", "Node", "Tensor", "infer"]
