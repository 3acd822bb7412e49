"""One convolution call inside an NVTX range named ``prof``, for Nsight Compute (``scripts/gpu-ncu``).

The implementation is a convforge algorithm (a variant or family name, or ``auto``: the database's or the
heuristic's pick) or ``cudnn-fp32`` / ``cudnn-tf32`` (PyTorch's ``F.conv2d`` with cudnn.benchmark, TF32 off/on,
i.e. the pick the fp32 / relaxed class is compared with). Warm-up calls (compilation, choice, filter
transforms, cuDNN's benchmark) run outside the range, so ``ncu --nvtx --nvtx-include prof/`` profiles exactly
the kernels of one warm call, every launch of a convforge plan included.

    PYTHONPATH=src python scripts/ncu_layer.py 'N=32,C=256,H=14,W=14,K=256,R=3,S=3,pad=1' implicit_gemm_tf32
    PYTHONPATH=src python scripts/ncu_layer.py 'N=32,C=128,H=56,W=56,K=128,R=3,S=3,stride=2,pad=1' auto --pass dgrad
    PYTHONPATH=src python scripts/ncu_layer.py 'N=128,C=512,H=7,W=7,K=512,R=3,S=3,pad=1' cudnn-fp32 --dtype fp16

``--dtype fp16|bf16`` runs both sides on half tensors (cuDNN on channels_last ones, as the bench's
``--layout nhwc`` baseline; convforge on NCHW ones unless ``--layout nhwc``, so its plan may add a layout
conversion as a kernel of its own: compare the GEMM kernels). ``--params 'k=v,...'`` times one point of the
variant's space instead of the tuned one.
"""

from __future__ import annotations

import argparse
from typing import Any

from convforge.spec import ConvSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec", help="layer, e.g. 'N=32,C=64,H=56,W=56,K=64,R=3,S=3,pad=1'")
    ap.add_argument("impl", help="convforge algorithm (variant, family, auto) or cudnn-fp32 / cudnn-tf32")
    ap.add_argument("--precision", default=None, help="convforge precision class for 'auto' (default: config)")
    ap.add_argument("--pass", dest="conv_pass", choices=("fprop", "dgrad", "wgrad"), default="fprop",
                    help="the pass: fprop (conv2d), dgrad (grad.conv2d_input), wgrad (grad.conv2d_weight); "
                         "cuDNN's through aten.convolution_backward")
    ap.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32",
                    help="storage dtype of both sides (half: cuDNN on channels_last tensors)")
    ap.add_argument("--layout", choices=("nchw", "nhwc"), default="nchw",
                    help="convforge's tensors: nchw, or nhwc (channels_last, its NHWC kernels)")
    ap.add_argument("--params", default=None, help="convforge parameters instead of the tuned ones, e.g. 'bc=8,cv=4'")
    args = ap.parse_args()
    import torch  # after the arguments: --help runs without torch (tests/test_scripts.py)
    import torch.nn.functional as F

    import convforge

    spec = ConvSpec.parse(args.spec)
    x = torch.randn(spec.x_shape, device="cuda")
    w = torch.randn(spec.w_shape, device="cuda") / (spec.c * spec.r * spec.s) ** 0.5
    dy = torch.randn((spec.n, spec.k, spec.p, spec.q), device="cuda")
    if args.dtype != "fp32":
        tdt = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
        x, w, dy = (t.to(tdt) for t in (x, w, dy))
    if args.impl.startswith("cudnn-") and args.dtype != "fp32" or args.layout == "nhwc":
        x, w, dy = (t.to(memory_format=torch.channels_last) for t in (x, w, dy))
    torch.backends.cudnn.benchmark = True
    if args.impl.startswith("cudnn-"):
        torch.backends.cudnn.allow_tf32 = args.impl == "cudnn-tf32"
        call = _cudnn_call(F, torch, spec, x, w, dy, args.conv_pass)
    else:
        import convforge.grad as cg
        params = dict(kv.split("=") for kv in args.params.split(",")) if args.params else None
        geo = dict(stride=spec.stride, padding=spec.pad, dilation=spec.dilation, groups=spec.groups,
                   algo=args.impl, precision=args.precision,
                   params={k: int(v) for k, v in params.items()} if params else None)

        def call() -> object:
            if args.conv_pass == "dgrad":
                return cg.conv2d_input(spec.x_shape, w, dy, **geo)
            if args.conv_pass == "wgrad":
                return cg.conv2d_weight(x, spec.w_shape, dy, **geo)
            return convforge.conv2d(x, w, None, **geo)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def _cudnn_call(F: Any, torch: Any, spec: ConvSpec, x: Any, w: Any, dy: Any, conv_pass: str) -> Any:
    """PyTorch's cuDNN call for the pass (asymmetric padding: the input padded first, as the bench does)."""
    t, b, left, right = spec.pad
    sym = t == b and left == right
    xin = x if sym else F.pad(x, (left, right, t, b))
    pad = [t, left] if sym else [0, 0]
    if conv_pass == "fprop":
        return lambda: F.conv2d(xin, w, None, spec.stride, pad, spec.dilation, spec.groups)
    mask = [conv_pass == "dgrad", conv_pass == "wgrad", False]
    return lambda: torch.ops.aten.convolution_backward(dy, xin, w, None, list(spec.stride), pad,
                                                       list(spec.dilation), False, [0, 0], spec.groups, mask)


if __name__ == "__main__":
    main()
