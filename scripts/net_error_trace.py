"""Where a network's output error comes from: every node's output, ours and PyTorch FP32's, against
the float64 executor, in graph order (CUDA with torch; a maintainer's tool for calibration work).

    python scripts/net_error_trace.py --net googlenet --batch 2 [--error-budget 0] [--precision fp32] [--images 4]

Each row: the node, its op, the variant a conv / fc runs (with its stated error), our relative L2
error, PyTorch's, and their ratio. A ratio that jumps at one node names the layer (or op) to fix;
a ratio that creeps up is per-layer error compounding. Errors are over the first ``--images``
images (default 1; ``convforge run`` and calibration use 4).
"""

from __future__ import annotations

import argparse

import numpy as np

from convforge import config
from convforge.graph import torch_reference
from convforge.graph.build import compile
from convforge.graph.caffe import load_shipped
from convforge.graph.passes import optimize
from convforge.graph.reference import run_reference
from convforge.graph.runtime import conv_spec
from convforge.reference import rel_l2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="googlenet")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--input-size", type=int, default=None)
    ap.add_argument("--error-budget", type=float, default=0.0)
    ap.add_argument("--precision", choices=("fp32", "relaxed"), default="fp32")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--images", type=int, default=1, help="errors over the first IMAGES images")
    a = ap.parse_args()
    why = torch_reference.available()
    if why:
        raise SystemExit(f"net_error_trace: {why}")
    config.precision = a.precision
    g = optimize(load_shipped(a.net, input_size=a.input_size).with_batch(a.batch))
    g.outputs = list(dict.fromkeys(n.output for n in g.nodes))
    net = compile(g, batch=a.batch, backend="cuda", passes=False, error_budget=a.error_budget, capture=False)
    x = np.random.default_rng(a.seed).standard_normal(g.input_shape).astype(np.float32)
    ours, pt = net(x), torch_reference.outputs(g, x, tf32=a.precision == "relaxed")
    k = max(1, min(a.images, a.batch))
    want = run_reference(g.with_batch(k), x[:k])
    print(f"{a.net} N{a.batch} {a.precision}, error budget {a.error_budget:g}; errors of {k} image(s) against float64")
    print(f"{'node':32} {'op':8} {'variant (stated error)':40} {'ours':>9} {'PyTorch':>9} {'ratio':>6}")
    for node in g.nodes:
        t = node.output
        e_us = rel_l2(np.asarray(ours[t][:k], np.float64), want[t])
        e_pt = rel_l2(np.asarray(pt[t][:k], np.float64), want[t])
        what = ""
        if node.op in ("conv", "fc"):
            ch = net.choice(node)
            spec = conv_spec(node, net.shapes[node.inputs[0]])
            err = ch.error if ch.error is not None else ch.variant.expected_error(spec)
            what = f"{ch.variant.name} ({err:.1e})"
        ratio = e_us / e_pt if e_pt > 0 else float("inf")
        print(f"{node.name[:32]:32} {node.op:8} {what[:40]:40} {e_us:9.2e} {e_pt:9.2e} {ratio:6.2f}")


if __name__ == "__main__":
    main()
