"""Check and time every dgrad variant on the ResNet layers (GPU machine), beside PyTorch's FP32 pick.

For each layer: every dgrad variant that applies (``--precision fp32``: the fp32 class; ``relaxed``:
all) with its default parameters, checked against float64 (first image) and timed (CUDA events,
median of 20, every step of the plan inside the call: the filter rotation / packing too); the
untuned heuristic's pick is marked ``*`` (``--defaults pick``: only it is timed); ``--tune BUDGET``
also runs the tuner on the layer (in the class asked for). Baseline: PyTorch's own pick through
``aten.convolution_backward`` (grad_input only, cudnn.benchmark on, TF32 off) -- one half of
cuDNN-best FP32; the legacy BWD_DATA sweep is
``convforge bench --pass dgrad``'s. Effective TFLOPS use the forward formula. Prints the geometric
means of PyTorch / ours (heuristic pick, best default, tuned) and writes $OUT/gpu-dgrad.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

import numpy as np

from convforge.backends import get_backend
from convforge.check import check_plan, pass_inputs
from convforge.kernels import accurate_enough, all_variants, most_specialised
from convforge.spec import ConvSpec

RESNET = {f"res{c}@{hw}": (c, hw) for c, hw in ((64, 56), (128, 28), (256, 14), (512, 7))}
RESNET50 = {  # the strided and 1x1 layers of ResNet-50 (torchvision v1.5: stride on the 3x3)
    "r50 3x3/2 128@56": (128, 56, 56, 128, 3, 3, 2, 1), "r50 3x3/2 256@28": (256, 28, 28, 256, 3, 3, 2, 1),
    "r50 3x3/2 512@14": (512, 14, 14, 512, 3, 3, 2, 1), "r50 1x1/2 256@56->512": (256, 56, 56, 512, 1, 1, 2, 0),
    "r50 1x1/2 512@28->1024": (512, 28, 28, 1024, 1, 1, 2, 0), "r50 1x1 64@56->256": (64, 56, 56, 256, 1, 1, 1, 0),
    "r50 1x1 256@56->64": (256, 56, 56, 64, 1, 1, 1, 0), "r50 1x1 1024@14->256": (1024, 14, 14, 256, 1, 1, 1, 0),
}


def layers(batch: int) -> dict[str, ConvSpec]:
    out = {f"{k} N{batch}": ConvSpec.make(batch, c, hw, hw, c, 3, 3, 1, 1, conv_pass="dgrad")
           for k, (c, hw) in RESNET.items()}
    out.update({f"{k} N{batch}": ConvSpec.make(batch, *v, conv_pass="dgrad") for k, v in RESNET50.items()})
    return out


def time_plan(be: Any, spec: ConvSpec, exe: Any) -> float:
    inputs = pass_inputs(spec, np.random.default_rng(0))
    bufs = {"y": be.upload(inputs["y"]), "w": be.upload(inputs["w"]), "x": be.empty(4 * int(np.prod(spec.x_shape)))}
    for _ in range(3):
        exe(bufs)
    return statistics.median(be.time_ms(lambda: exe(bufs), 20))


def torch_pick(spec: ConvSpec) -> tuple[float, float] | None:
    """(ms, rel err on image 0) of aten.convolution_backward's grad_input, TF32 off; None without torch."""
    try:
        import torch
    except ImportError:
        return None
    from convforge.reference import dgrad_ref, rel_l2

    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = True, False
    torch.backends.cuda.matmul.allow_tf32 = False
    inputs = pass_inputs(spec, np.random.default_rng(0))
    dy, w = (torch.from_numpy(inputs[k]).cuda() for k in ("y", "w"))
    x = torch.empty(spec.x_shape, device="cuda")
    pad = (spec.pad[0], spec.pad[2])

    def call() -> Any:
        return torch.ops.aten.convolution_backward(dy, x, w, None, list(spec.stride), list(pad),
                                                   list(spec.dilation), False, [0, 0], spec.groups,
                                                   [True, False, False])[0]

    for _ in range(5):
        out = call()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(20)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(20)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        call()
        e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    one = spec.with_batch(1)
    err = rel_l2(out[:1].cpu().numpy(), dgrad_ref(inputs["y"][:1], inputs["w"], one))
    return ms, err


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "relaxed"])
    ap.add_argument("--tune", default="", help="tuner budget per layer, e.g. '20s,24' (empty: no tuning)")
    ap.add_argument("--only", default="", help="comma-separated substrings of layer labels")
    ap.add_argument("--defaults", default="all", choices=["all", "pick"],
                    help="time every applicable variant's default (all) or only the heuristic's pick")
    args = ap.parse_args()
    be = get_backend("cuda")
    print(f"device {be.device.name} ({be.device.driver})")
    rows, bad = [], 0
    for label, spec in layers(args.batch).items():
        if args.only and not any(s in label for s in args.only.split(",")):
            continue
        row, failed = run_layer(be, label, spec, args)
        rows.append(row)
        bad += failed
    summary(rows)
    out = os.environ.get("OUT", "/tmp/convforge-out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu-dgrad.json"), "w") as f:
        json.dump({"device": be.device.name, "rows": rows}, f, indent=1)
    return 1 if bad else 0


def run_layer(be: Any, label: str, spec: ConvSpec, args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """Check and time every applicable variant's default (and the tuner's pick) on one layer."""
    pick, _ = most_specialised("auto", spec, be.device, precision=args.precision)
    row: dict[str, Any] = {"layer": label, "spec": spec.to_dict(), "heuristic": pick.name, "variants": {}}
    bad = 0
    print(f"\n== {label}: {spec.short()}  ({spec.flops / 1e9:.1f} GFLOP)")
    for v in all_variants():
        if v.applies(spec, be.device) or accurate_enough(v, spec, args.precision) or not v.capturable:
            continue
        if args.defaults == "pick" and v is not pick:
            continue
        prm = v.default(spec, be.device)
        try:
            exe = be.executable(v.plan(spec, prm, be.device))
            res = check_plan(exe.plan, be, exe=exe, batch_slice=1)
            ms = time_plan(be, spec, exe)
        except Exception as err:  # noqa: BLE001 - report it and go on
            print(f"  {v.name:36s} ERROR {type(err).__name__}: {str(err)[:160]}")
            bad += 1
            continue
        bad += not res.ok
        row["variants"][v.name] = {"ms": ms, "err": res.rel_err, "ok": res.ok, "params": prm.short()}
        mark = "*" if v is pick else " "
        print(f" {mark}{v.name:36s} {ms:8.3f} ms {spec.flops / ms / 1e9:7.1f} TFLOPS  err {res.rel_err:.2e}"
              f"{'' if res.ok else ' FAIL'}  {prm.short()}")
    if args.tune:
        from convforge.tune.tuner import Budget, Tuner

        tr = Tuner(be, budget=Budget.parse(args.tune), precision=args.precision).tune(spec)
        row["tuned"] = {"variant": tr.variant.name, "params": tr.params.short(), "ms": tr.entry.time_ms,
                        "err": tr.entry.error}
        print(f"  tuned: {tr.variant.name} [{tr.params.short()}] {tr.entry.time_ms:.3f} ms "
              f"{spec.flops / tr.entry.time_ms / 1e9:.1f} TFLOPS err {tr.entry.error:.2e}")
    base = torch_pick(spec)
    if base is not None:
        row["torch"] = {"ms": base[0], "err": base[1]}
        print(f"  PyTorch pick (aten.convolution_backward, TF32 off): {base[0]:.3f} ms "
              f"{spec.flops / base[0] / 1e9:.1f} TFLOPS err {base[1]:.2e}")
    return row, bad


def summary(rows: list[dict[str, Any]]) -> None:
    """Geometric means of PyTorch's time over ours (heuristic pick, best default, tuned)."""
    def gmean(vals: list[float]) -> float:
        return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else float("nan")

    kinds: dict[str, list[float]] = {"heuristic pick": [], "best default": [], "tuned": []}
    print("\n== speed-up over PyTorch's FP32 pick (time ratio; >1: ours faster)")
    for r in rows:
        if "torch" not in r or not r["variants"]:
            continue
        t = r["torch"]["ms"]
        ours = {"heuristic pick": r["variants"].get(r["heuristic"], {}).get("ms"),
                "best default": min(v["ms"] for v in r["variants"].values() if v["ok"]),
                "tuned": r.get("tuned", {}).get("ms")}
        cells = []
        for k, ms in ours.items():
            if ms:
                kinds[k].append(t / ms)
                cells.append(f"{k} {t / ms:5.2f}x")
        print(f"  {r['layer']:28s} " + "  ".join(cells))
    for k, vals in kinds.items():
        if vals:
            print(f"  geometric mean, {k}: {gmean(vals):.2f}x over {len(vals)} layers")


if __name__ == "__main__":
    sys.exit(main())
