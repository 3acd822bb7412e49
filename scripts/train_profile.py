"""Where a training step's GPU time goes: PyTorch FP32 against the convforge-converted model, per
operator (torch.profiler; CUDA with torch and torchvision; a maintainer's tool behind BENCHMARKS'
training section). With --forward: an inference forward, PyTorch FP32 eager against ``fuse()``.

    python scripts/train_profile.py --model resnet50 --batch 32 [--steps 5] [--top 14] [--forward]
                                    [--precision relaxed]   # PyTorch TF32 against the relaxed class
                                    [--fused]   # fuse() in training mode: batch norm, add, ReLU ours too
                                    [--host]    # also: each side's host time per step, its operators by
                                                # own host time, and ours under cProfile
                                    [--ab native_block]  # instead: an A/B of a boolean setting in ONE
                                                # process, rounds alternating PyTorch, ours on, ours off
                                    [--amp fp16|bf16]  # the AMP step (autocast, GradScaler, channels_last)
                                                # against PyTorch AMP: bench --train --amp's step; with
                                                # --forward: the fused model's forward under autocast
                                    [--nchw]    # --forward --amp: NCHW input, not channels_last
                                    [--kernels]  # also: each side's kernels by launches per step (what
                                                # a host-bound step's launch count is made of)
                                    [--each 40]  # also: ours' 40 costliest kernels one by one (full names:
                                                # a layer's shape), to find the ones far from their roofline
                                    [--bn]      # also: convforge's batch-norm kernels by kind, with the
                                                # bandwidth their activation reads and writes reach
                                    [--phases]  # with --amp, instead: host ms of each phase of the step
                                                # (forward + loss, backward, scaler) for PyTorch, convert()
                                                # and fuse(), in alternating rounds, as is and with the GPU
                                                # drained between phases; synchronising calls a step

The step is `convforge bench --train`'s (forward, cross-entropy, backward, SGD with momentum, one
fixed batch, training mode). Each side prints its GPU time per step and the operators that take
most of it (device time of the kernels each launched, convforge's ops included), so a missed
training target can say which passes and which PyTorch ops between them hold the time.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any


def profile(step: Any, steps: int) -> Any:
    import torch

    for _ in range(3):  # warm-up: compile, autotune, allocate
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages()


def report(name: str, events: Any, steps: int, top: int) -> None:
    """The step's GPU time (kernels only), then the operators that launched the most of it: aten and
    convforge ops with the device time of the kernels they launched themselves (a kernel counts once)."""
    per = [(e.key, e.self_device_time_total / steps / 1e3, e.count // steps, str(e.device_type).endswith("CUDA"))
           for e in events if e.self_device_time_total > 0]
    total = sum(ms for _, ms, _, kernel in per if kernel)
    ops = [r for r in per if not r[3]]
    print(f"\n{name}: {total:.3f} ms of GPU time per step (kernels); by the operator that launched them:")
    print(f"{'operator':48} {'ms/step':>8} {'share':>6} {'calls':>6}")
    for key, ms, calls, _ in sorted(ops, key=lambda r: -r[1])[:top]:
        print(f"{key[:48]:48} {ms:8.3f} {100 * ms / total:5.1f}% {calls:6d}")
    rest = total - sum(ms for _, ms, _, _ in ops)
    print(f"{'(kernels without an operator: optimizer, autograd)':48} {rest:8.3f} {100 * rest / total:5.1f}%")


def kernel_report(name: str, events: Any, steps: int, top: int) -> None:
    """The step's kernels by launches per step (names cut to a family: template arguments and our shape
    suffixes dropped), with their GPU time: where a host-bound step's launches come from."""
    import re

    fam: dict[str, list[float]] = {}
    for e in events:
        if not (str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0):
            continue
        key = re.sub(r"<.*", "", e.key)
        key = re.sub(r"_\d+x\d+.*", "", key)  # convforge kernels: name_<shape>...
        row = fam.setdefault(key[:60], [0.0, 0.0])
        row[0] += e.count / steps
        row[1] += e.self_device_time_total / steps / 1e3
    total = sum(r[0] for r in fam.values())
    print(f"\n{name}: {total:.0f} kernel launches a step; by kernel family:")
    print(f"{'kernel':60} {'a step':>7} {'ms':>7}")
    for key, (n, ms) in sorted(fam.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{key:60} {n:7.1f} {ms:7.3f}")


def each_report(events: Any, steps: int, top: int) -> None:
    """The ``top`` kernels with the most GPU time a step, each under its full name (convforge's names carry
    the layer's shape and tile), with launches a step and microseconds a launch."""
    rows = [(e.key, e.count / steps, e.self_device_time_total / steps / 1e3) for e in events
            if str(e.device_type).endswith("CUDA") and e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    print(f"\nthe {top} costliest kernels a step:")
    print(f"{'kernel':90} {'a step':>7} {'ms':>7} {'us each':>8}")
    for key, n, ms in rows[:top]:
        print(f"{key[:90]:90} {n:7.1f} {ms:7.3f} {1e3 * ms / max(n, 1e-9):8.1f}")


def bn_report(events: Any, steps: int, copy_gbs: float = 4036.0) -> None:
    """convforge's batch-norm kernels (kernels/batchnorm.py, ``bn_train_<N>x<C>x<HW><tags>_<kind>``) by
    kind: launches and ms a step, and GB/s of the activation tensors each kind reads and writes (y, res,
    z, dz, the masked dz, dy: the kernel's own byte model), against the H200's measured copy bandwidth."""
    import re

    kinds: dict[str, list[float]] = {}
    for e in events:
        m = re.match(r"bn_train_(\d+)x(\d+)x(\d+)(\w*?)_(stats|finalize_partials|finalize|apply|bwd_reduce|"
                     r"bwd_finalize|bwd_apply|fwd_one|bwd_one)$", e.key)
        if not (m and str(e.device_type).endswith("CUDA")):
            continue
        n, c, hw, tags, kind = int(m[1]), int(m[2]), int(m[3]), m[4], m[5]
        size = 4 if not re.search(r"_(f16|bf16)", tags) else 2
        res, relu = "_res" in tags, "_relu" in tags
        tensors = {"stats": 1, "apply": 3 if res else 2, "bwd_reduce": 4 if res and relu else 2,
                   "bwd_apply": 3}.get(kind, 0)
        row = kinds.setdefault(kind, [0.0, 0.0, 0.0])
        row[0] += e.count / steps
        row[1] += e.self_device_time_total / steps / 1e3
        row[2] += tensors * n * c * hw * size * e.count / steps
    print(f"\nconvforge batch norm by kernel kind (GB/s: the activations it reads and writes; copy {copy_gbs:.0f}):")
    print(f"{'kind':20} {'a step':>7} {'ms':>7} {'GB/s':>7}")
    for kind, (count, ms, nbytes) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        gbs = f"{nbytes / ms / 1e6:7.0f}" if nbytes and ms else "      -"
        print(f"{kind:20} {count:7.1f} {ms:7.3f} {gbs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--forward", action="store_true", help="eval-mode forward: PyTorch against fuse()")
    ap.add_argument("--fused", action="store_true",
                    help="train fuse()'s model (batch norm, residual add and ReLU on convforge's kernels; they "
                    "launch outside any aten op, so their time is in the last row) instead of convert()'s")
    ap.add_argument("--host", action="store_true",
                    help="also time each side's host work per step (steps enqueued without waiting for the GPU, "
                    "the queue kept short) and print convforge's Python functions by own time (cProfile)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "relaxed"),
                    help="relaxed: PyTorch with TF32 convolutions and matmuls against convert(precision='relaxed')")
    ap.add_argument("--ab", metavar="SETTING",
                    help="a boolean convforge.config setting (native_block, train_bn, grad_rows...): time the "
                    "step as `bench --train` does and the host with the GPU drained, in rounds alternating "
                    "PyTorch, ours with the setting on and off, all in this one process (host speed moves between "
                    "processes by a third: an A/B across two of them measures the machine)")
    ap.add_argument("--rounds", type=int, default=4, help="--ab: rounds (each times every side)")
    ap.add_argument("--amp", choices=("fp16", "bf16"),
                    help="the mixed-precision step (bench --train --amp's: autocast, GradScaler for fp16, model and "
                    "input channels_last) against PyTorch AMP")
    ap.add_argument("--nchw", action="store_true", help="--forward --amp: NCHW input (channels_last otherwise)")
    ap.add_argument("--kernels", action="store_true", help="also: the kernels by launches per step")
    ap.add_argument("--each", type=int, default=0, metavar="N",
                    help="also: convforge's N costliest kernels, each by its full name (layer shape)")
    ap.add_argument("--bn", action="store_true", help="also: convforge's batch-norm kernels by kind, with bandwidth")
    ap.add_argument("--phases", action="store_true",
                    help="with --amp: host ms per phase of the step (forward + loss, backward, scaler) for PyTorch, "
                    "convert() and fuse() in alternating rounds, as is and drained; synchronising calls a step")
    a = ap.parse_args()
    import torch

    import convforge.torch as ct
    from convforge.apps.bench import models, training

    torch.backends.cudnn.benchmark = True
    tf32 = a.precision == "relaxed"
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    base = "PyTorch TF32" if tf32 else "PyTorch FP32"
    model = models.build(a.model)
    if isinstance(model, str):
        raise SystemExit(f"train_profile: {model}")
    x, target = training._batch(a.model, a.batch)
    if a.phases:
        if not a.amp:
            raise SystemExit("train_profile: --phases times the AMP step: give --amp fp16 or --amp bf16")
        phases(a.model, a.batch, model, x, target, a.amp, a.rounds)
        return
    ref = copy.deepcopy(model).cuda()
    if a.forward:
        ref.eval()
        ours, _ = ct.fuse(ref, precision=a.precision)
        if a.amp:  # the fused float32 model under autocast, as bench --model --dtype times it
            base = f"PyTorch {a.amp} autocast"
            if not a.nchw:
                x = x.contiguous(memory_format=torch.channels_last)
                ref = ref.to(memory_format=torch.channels_last)
        sides = ((f"{base} forward", ref), ("convforge fuse() forward", ours))
        for name, m in sides:
            events = profile(_forward_fn(m, x, a.amp), a.steps)
            report(f"{a.model} N{a.batch} {name}", events, a.steps, a.top)
            if a.kernels:
                kernel_report(name, events, a.steps, a.top)
            if a.each:
                each_report(events, a.steps, a.each)
            if a.host:
                host(name, _forward_fn(m, x, a.amp), a.steps, a.top * 2 if m is ours else 0)
        return
    ours = copy.deepcopy(model).cuda()
    if a.fused:
        ours, _ = ct.fuse(ours, precision=a.precision)
    else:
        ct.convert(ours, precision=a.precision)
    how = "fused" if a.fused else "converted"
    if a.amp:
        from convforge.apps.bench import training_amp

        dt = torch.float16 if a.amp == "fp16" else torch.bfloat16
        cl = torch.channels_last
        xs = x.contiguous(memory_format=cl)
        if a.ab:  # the A/B of the AMP step
            steps = [training_amp.amp_step_fn(m.to(memory_format=cl), xs, target, dt) for m in (ref, ours)]
            ab(a.ab, a.rounds, f"PyTorch AMP {a.amp}", *steps, False)
            return
        for name, m in ((f"PyTorch AMP {a.amp}", ref), (f"convforge ({how}, AMP {a.amp})", ours)):
            step = training_amp.amp_step_fn(m.to(memory_format=cl), xs, target, dt)
            events = profile(step, a.steps)
            report(f"{a.model} N{a.batch} {name}", events, a.steps, a.top)
            if a.kernels:
                kernel_report(name, events, a.steps, a.top * 3)
            if a.bn and m is ours:
                bn_report(events, a.steps)
            if a.each and m is ours:
                each_report(events, a.steps, a.each)
            if a.host:
                cpu_report(name, events, a.steps, a.top)
                host(name, step, a.steps, a.top * 2 if m is ours else 0)
        return
    if a.ab:
        ab(a.ab, a.rounds, base, training.step_fn(ref, x, target), training.step_fn(ours, x, target), tf32)
        return
    for name, m in ((base, ref), (f"convforge ({how}, {a.precision})", ours)):
        step = training.step_fn(m, x, target)
        events = profile(step, a.steps)
        report(f"{a.model} N{a.batch} {name}", events, a.steps, a.top)
        if a.host:
            cpu_report(name, events, a.steps, a.top)
            host(name, step, a.steps, a.top * 2 if m is ours else 0)


def phases(name: str, batch: int, model: Any, x: Any, target: Any, amp: str, rounds: int, per: int = 6) -> None:
    """Host milliseconds of each phase of the AMP step (forward + loss, scaled backward, scaler step and
    update), and the step's, for PyTorch AMP, ``convert()`` and ``fuse()``: ``rounds`` rounds alternating the
    three, ``per`` steps each as is ("normal": phases overlap the GPU, the scaler's step waits for it) and
    ``per`` with the GPU drained between phases ("drained": each phase's own host time; the step column leaves
    the drains out). Then the synchronising CUDA calls of one step each (sync-debug mode)."""
    import collections
    import time
    import warnings

    import torch
    import torch.nn.functional as F

    import convforge.torch as ct

    dt = torch.float16 if amp == "fp16" else torch.bfloat16
    xs = x.contiguous(memory_format=torch.channels_last)

    def fresh() -> Any:
        return copy.deepcopy(model).cuda().to(memory_format=torch.channels_last)

    converted = fresh()
    ct.convert(converted)
    forms = {"pytorch": fresh(), "convert": converted, "fused": ct.fuse(fresh())[0]}

    def stepper(m: Any) -> Any:
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda", enabled=dt == torch.float16)

        def step(drain: bool) -> tuple[float, float, float, float]:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dt):
                loss = F.cross_entropy(m(xs), target)
            t1 = time.perf_counter()
            if drain:
                torch.cuda.synchronize()
            t1b = time.perf_counter()
            scaler.scale(loss).backward()
            t2 = time.perf_counter()
            if drain:
                torch.cuda.synchronize()
            t2b = time.perf_counter()
            scaler.step(opt)
            scaler.update()
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            return t1 - t0, t2 - t1b, t3 - t2b, t4 - t0 - (t1b - t1) - (t2b - t2)
        return step

    steps = {k: stepper(m) for k, m in forms.items()}
    for s in steps.values():
        for _ in range(4):
            s(False)
    res: dict[tuple[str, bool], list[tuple[float, ...]]] = {(k, d): [] for k in steps for d in (False, True)}
    for _ in range(rounds):
        for k, s in steps.items():
            for d in (False, True):
                res[(k, d)] += [s(d) for _ in range(per)]
    print(f"{name} N{batch} AMP {amp}: host ms per phase (median of {rounds * per}, rounds alternating)")
    print(f"{'form':10s} {'mode':8s} {'fwd+loss':>9s} {'backward':>9s} {'scaler':>9s} {'step':>9s}")
    for (k, d), v in res.items():
        cols = [1e3 * sorted(t[i] for t in v)[len(v) // 2] for i in range(4)]
        print(f"{k:10s} {'drained' if d else 'normal':8s} " + " ".join(f"{c:9.2f}" for c in cols))
    for k, s in steps.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            s(False)
            torch.cuda.set_sync_debug_mode(0)
        where = collections.Counter(f"{w.filename.split('site-packages/')[-1]}:{w.lineno} {str(w.message)[:80]}"
                                    for w in caught)
        print(f"\n{k}: {sum(where.values())} synchronising calls in one step")
        for line, n in where.most_common(12):
            print(f"  {n:4d} {line}")


def ab(setting: str, rounds: int, base: str, theirs: Any, ours: Any, tf32: bool) -> None:
    """Rounds alternating PyTorch, ours with ``setting`` on and ours with it off: each side's eager step
    (``bench --train``'s timing: 2 warm-up steps, median of 10) and host time with the GPU drained (median
    of 7); then the medians over the rounds and each of ours against PyTorch."""
    import statistics
    import time

    import torch

    from convforge.apps.bench import training
    from convforge.config import config

    if not isinstance(getattr(config, setting, None), bool):
        raise SystemExit(f"train_profile: --ab takes a boolean convforge.config setting, not {setting!r}")
    keep = getattr(config, setting)
    sides = {base: (theirs, None), f"convforge {setting}=on": (ours, True), f"convforge {setting}=off": (ours, False)}
    eager: dict[str, list[float]] = {k: [] for k in sides}
    drained: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(3):
        ours()
    try:
        for _ in range(rounds):
            for name, (step, on) in sides.items():
                torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32 and on is None
                if on is not None:
                    setattr(config, setting, on)
                eager[name].append(training._time(step, 2, 10))
                times = []
                for _ in range(7):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step()
                    times.append(1e3 * (time.perf_counter() - t0))
                torch.cuda.synchronize()
                drained[name].append(statistics.median(times))
    finally:
        setattr(config, setting, keep)
    ref = statistics.median(eager[base])
    for name in sides:
        e, h = statistics.median(eager[name]), statistics.median(drained[name])
        print(f"{name:32} eager {e:8.3f} ms ({ref / e:.2f}x {base})  host drained {h:8.3f} ms   rounds: eager "
              + " ".join(f"{v:.3f}" for v in eager[name]) + ", host " + " ".join(f"{v:.2f}" for v in drained[name]))


def cpu_report(name: str, events: Any, steps: int, top: int) -> None:
    """The operators and autograd nodes with the most own host time per step (torch.profiler's self CPU
    time, profiler overhead included: compare the two sides' ranks and counts, not absolute µs)."""
    per = sorted(((e.key, e.self_cpu_time_total / steps / 1e3, e.count // steps) for e in events
                  if e.self_cpu_time_total > 0), key=lambda r: -r[1])
    total = sum(ms for _, ms, _ in per)
    print(f"\n{name}: {total:.3f} ms of host time per step under the profiler; by own time:")
    print(f"{'operator or node':48} {'ms/step':>8} {'share':>6} {'calls':>6}")
    for key, ms, calls in per[:top]:
        print(f"{key[:48]:48} {ms:8.3f} {100 * ms / max(total, 1e-9):5.1f}% {calls:6d}")


def host(name: str, step: Any, steps: int, top: int) -> None:
    """Host milliseconds per step: each step timed from its call to its return, with the GPU drained
    before it (so the launch queue never fills and blocks the host); then, for ``top`` > 0, the
    functions with the most own time under cProfile (which slows Python down: compare ranks, not ms). Where
    native.cpp is built: its counters a step (op calls handed to Python, backward passes and blocks run in C++)."""
    import cProfile
    import pstats
    import time

    import torch

    from convforge.torch import native

    mod = native.load()
    before = mod.stats() if mod is not None else {}
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    times.sort()
    print(f"{name}: host {1e3 * times[len(times) // 2]:.3f} ms per step (median of {steps}; GPU drained before each)")
    if mod is not None:  # native.cpp's counters a step: op calls that went to Python, passes and blocks run in C++
        after = mod.stats()
        print("  native.cpp a step: " + ", ".join(f"{k} {(after[k] - before[k]) / steps:g}" for k in after
                                                  if k != "entries") + f"; entries {after['entries']}")
    if top:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        prof.disable()
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats("convforge", top)  # our Python functions, callers first


def _forward_fn(model: Any, x: Any, amp: str | None = None) -> Any:
    import torch

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(amp or "")

    def run() -> None:
        with torch.no_grad(), torch.autocast("cuda", dtype=dt or torch.float16, enabled=dt is not None):
            model(x)
    return run


if __name__ == "__main__":
    main()
