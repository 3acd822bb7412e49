"""One convolution call inside an NVTX range named ``prof``, for Nsight Compute (``scripts/gpu-ncu``).

The implementation is a convforge algorithm (a variant or family name, or ``auto``: the database's or the
heuristic's pick) or ``cudnn-fp32`` / ``cudnn-tf32`` (PyTorch's ``F.conv2d`` with cudnn.benchmark, TF32 off/on,
i.e. the pick the fp32 / relaxed class is compared with). Warm-up calls (compilation, choice, filter
transforms, cuDNN's benchmark) run outside the range, so ``ncu --nvtx --nvtx-include prof/`` profiles exactly
the kernels of one warm call, every launch of a convforge plan included.

    PYTHONPATH=src python scripts/ncu_layer.py 'N=32,C=256,H=14,W=14,K=256,R=3,S=3,pad=1' implicit_gemm_tf32
"""

from __future__ import annotations

import argparse

from convforge.spec import ConvSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec", help="layer, e.g. 'N=32,C=64,H=56,W=56,K=64,R=3,S=3,pad=1'")
    ap.add_argument("impl", help="convforge algorithm (variant, family, auto) or cudnn-fp32 / cudnn-tf32")
    ap.add_argument("--precision", default=None, help="convforge precision class for 'auto' (default: config)")
    args = ap.parse_args()
    import torch  # after the arguments: --help runs without torch (tests/test_scripts.py)
    import torch.nn.functional as F

    import convforge

    spec = ConvSpec.parse(args.spec)
    x = torch.randn(spec.x_shape, device="cuda")
    w = torch.randn(spec.w_shape, device="cuda") / (spec.c * spec.r * spec.s) ** 0.5
    torch.backends.cudnn.benchmark = True
    if args.impl.startswith("cudnn-"):
        torch.backends.cudnn.allow_tf32 = args.impl == "cudnn-tf32"
        t, b, left, right = spec.pad
        xin = F.pad(x, (left, right, t, b)) if (t != b or left != right) else x
        pad = (0, 0) if (t != b or left != right) else (t, left)

        def call() -> object:
            return F.conv2d(xin, w, None, spec.stride, pad, spec.dilation)
    else:
        def call() -> object:
            return convforge.conv2d(x, w, None, spec.stride, spec.pad, spec.dilation, algo=args.impl,
                                    precision=args.precision)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
