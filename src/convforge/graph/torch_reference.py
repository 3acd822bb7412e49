"""The graph run through PyTorch (``torch.nn.functional``): the reference a CUDA network's
calibration compares with where torch sees the GPU (``convforge.graph.network_calibration``), and the
computation ``convforge run`` times as its PyTorch baseline. torch is imported inside the functions.

The IR runs op by op in FP32 with cudnn.benchmark on and TF32 off (``tf32=True``: on, for cuDNN and
matmul, the relaxed class's reference), or with every weight and the input in float16 / bfloat16
(``dtype``: PyTorch's ``.half()`` eager).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from convforge.graph.ir import Graph, Node, conv_geometry, conv_group, lrn_params, resize_table


def _lrn(F: Any, attrs: dict, x: Any) -> Any:
    return F.local_response_norm(x, *lrn_params(attrs))


def _pool(F: Any, node: Node, x: Any) -> Any:
    """A pool node in PyTorch (its fused LRN first). Padding PyTorch's pools cannot take (unequal
    sides, more than half the window) is applied explicitly: -inf for max, zeros for an average
    that counts its padding; an average that does not count it has no such PyTorch form."""
    if node.attrs.get("lrn"):  # fuse_lrn_pool: normalise, then pool
        x = _lrn(F, node.attrs["lrn"], x)
    is_max = node.attrs.get("kind", "max") == "max"
    if node.attrs.get("global"):
        return (F.adaptive_max_pool2d if is_max else F.adaptive_avg_pool2d)(x, 1)
    k, st, (pt, pb, pl, pr), _ = conv_geometry(node)
    ceil, count_pad = bool(node.attrs.get("ceil")), bool(node.attrs.get("count_pad", True))
    if (pt, pl) != (pb, pr) or 2 * pt > k[0] or 2 * pl > k[1]:
        if not is_max and not count_pad:
            raise ValueError(f"node {node.name!r}: PyTorch has no average pool that skips padding "
                             f"{(pt, pb, pl, pr)} (unequal sides or more than half the window)")
        x = F.pad(x, (pl, pr, pt, pb), value=float("-inf") if is_max else 0.0)
        pt = pl = 0
    if is_max:
        return F.max_pool2d(x, k, st, (pt, pl), ceil_mode=ceil)
    return F.avg_pool2d(x, k, st, (pt, pl), ceil_mode=ceil, count_include_pad=count_pad)


def _act(F: Any, torch: Any, fn: str, attrs: dict, x: Any) -> Any:
    """An act node's function (ir.ACT_FNS), or a conv / fc epilogue's, in PyTorch."""
    if fn in ("sigmoid", "tanh"):
        return getattr(torch, fn)(x)
    if fn == "silu":
        return F.silu(x)
    if fn == "hardswish":
        return F.hardswish(x)
    if fn == "gelu":
        return F.gelu(x)
    if fn == "mish":
        return F.mish(x)
    if fn == "softplus":
        return F.softplus(x, threshold=float("inf"))
    if fn == "hardsigmoid":
        return (x * float(attrs.get("alpha", 0.2)) + float(attrs.get("beta", 0.5))).clamp(0.0, 1.0)
    return x.clamp(attrs.get("lo"), attrs.get("hi"))


_TABLES: dict[tuple[Any, ...], Any] = {}  # (node's attributes, axis, size, device) -> its table on the device


def _resize(torch: Any, node: Node, x: Any) -> Any:
    """A resize node by the same host tables as our kernel (ir.resize_table): F.interpolate has
    no form for every ONNX coordinate mode and rounding. The tables go to the device once per node
    and size (a copy from the host is not allowed while a CUDA graph is captured)."""
    out = x
    for axis in (2, 3):
        key = (repr(sorted(node.attrs.items())), axis, out.shape[axis], str(x.device))
        t = _TABLES.get(key)
        if t is None:
            t = _TABLES[key] = torch.from_numpy(
                resize_table(out.shape[axis], node.attrs["size"][axis - 2], node.attrs["scale"][axis - 2],
                             node.attrs["mode"], node.attrs["coord"],
                             node.attrs.get("nearest", "round_prefer_floor"))).to(x.device)
        shape = [1, 1, 1, 1]
        shape[axis] = -1
        w1 = t[:, 2].to(x.dtype).reshape(shape)
        out = out.index_select(axis, t[:, 0].long()) * (1 - w1) + out.index_select(axis, t[:, 1].long()) * w1
    return out


def _onnx_op(F: Any, torch: Any, node: Node, ins: list[Any], w: dict[str, Any]) -> Any:
    """The ops of ONNX exports (ir.py: act, binary, resize, pad, deconv, reshape) in PyTorch."""
    x, op = ins[0], node.op
    if op == "act":
        return _act(F, torch, node.attrs["fn"], node.attrs, x)
    if op == "binary":
        a, b = x, (ins[1] if len(ins) == 2 else w["b"])
        a, b = (b, a) if node.attrs.get("swap") else (a, b)
        return {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[node.attrs["fn"]](a, b)
    if op == "resize":
        return _resize(torch, node, x)
    if op == "pad":
        pt, pb, pl, pr = conv_geometry(node)[2]
        mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}[node.attrs.get("mode", "constant")]
        value = float(node.attrs.get("value", 0.0)) if mode == "constant" else None
        return F.pad(x, (pl, pr, pt, pb), mode=mode, value=value)
    if op == "deconv":
        _, st, (pt, pb, pl, pr), dil = conv_geometry(node)  # unequal sides: the full output, cropped
        oh, ow = node.attrs.get("out_pad", (0, 0))
        full = F.pad(F.conv_transpose2d(x, w["w"], None, st, 0, 0, conv_group(node), dil), (0, ow, 0, oh))
        y = full[:, :, pt:full.shape[2] - pb, pl:full.shape[3] - pr]
        return y + w["bias"][:, None, None] if "bias" in w else y
    return x.reshape((x.shape[0],) + tuple(node.attrs["shape"]))


def _op(F: Any, torch: Any, node: Node, ins: list[Any], w: dict[str, Any]) -> Any:
    x = ins[0]
    op = node.op
    if op in ("act", "binary", "resize", "pad", "deconv", "reshape"):
        y = _onnx_op(F, torch, node, ins, w)
    elif op == "conv":
        if "pscale" in w:  # a folded pre-activation (prologue): batch norm's affine, then ReLU
            x = x * w["pscale"][:, None, None] + w["pshift"][:, None, None]
        if node.attrs.get("pre_relu"):
            x = F.relu(x)
        _, st, (pt, pb, pl, pr), dil = conv_geometry(node)
        if (pt, pl) != (pb, pr):
            x, pt, pl = F.pad(x, (pl, pr, pt, pb)), 0, 0
        y = F.conv2d(x, w["w"], w.get("bias"), st, (pt, pl), dil, conv_group(node))
    elif op == "fc":
        y = F.linear(x.flatten(1), w["w"], w.get("bias"))
    elif op == "pool":
        y = _pool(F, node, x)
    elif op == "lrn":
        y = _lrn(F, node.attrs, x)
    elif op == "relu":
        y = F.leaky_relu(x, float(node.attrs.get("slope", 0.0)))
        if node.attrs.get("clip") is not None:
            y = y.clamp(max=float(node.attrs["clip"]))
    elif op == "batchnorm":
        y = F.batch_norm(x, w["mean"], w["var"], w.get("gamma"), w.get("beta"), False, 0.0,
                         float(node.attrs.get("eps", 1e-5)))
    elif op == "scale":
        y = x * w["gamma"][:, None, None] + (w["beta"][:, None, None] if "beta" in w else 0)
    elif op == "add":
        y = sum(ins[1:], ins[0])
    elif op == "concat":
        y = torch.cat(ins, 1)
    elif op == "softmax":
        y = F.softmax(x, 1)
    elif op == "flatten":
        y = x.flatten(1)
    else:  # dropout
        y = x
    if len(ins) > 1 and op == "conv":
        y = y + ins[1]
    if node.attrs.get("act"):
        return _act(F, torch, node.attrs["act"], node.attrs, y)
    return F.relu(y) if node.attrs.get("relu") else y


def forward_fn(graph: Graph, x: np.ndarray, device: str = "cuda", dtype: str = "float32",
               every: bool = False) -> Any:
    """A no-argument function running ``graph`` on ``x`` through torch.nn.functional (weights and
    input moved to ``device`` once, as ``dtype``); it returns the first output tensor (``every``: a
    dict of all)."""
    import torch
    import torch.nn.functional as F

    dev, tdt = torch.device(device), getattr(torch, dtype)
    weights = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(dev, tdt)
               for k, v in graph.weights.items()}
    xin = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dev, tdt)

    def forward() -> Any:
        vals = {graph.input: xin}
        with torch.no_grad():
            for node in graph.nodes:
                w = {role: weights[key] for role, key in node.weights.items()}
                vals[node.output] = _op(F, torch, node, [vals[t] for t in node.inputs], w)
        return {t: vals[t] for t in graph.outputs} if every else vals[graph.outputs[0]]

    return forward


def outputs(graph: Graph, x: np.ndarray, tf32: bool = False) -> dict[str, np.ndarray]:
    """Every output of ``graph`` on ``x`` computed by PyTorch on the GPU in FP32 (``tf32``: TF32
    allowed; cudnn.benchmark on, as the timed baseline), as float32 NumPy arrays. The TF32 switches
    are restored afterwards."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    set_math(torch, tf32)
    try:
        out = forward_fn(graph, x, "cuda", every=True)()
        return {t: v.float().cpu().numpy() for t, v in out.items()}
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = saved


def set_math(torch: Any, tf32: bool) -> None:
    """cudnn.benchmark on; TF32 on or off for both cuDNN convolutions and matmul (fc layers)."""
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def available() -> str | None:
    """None when torch with CUDA is importable, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None
