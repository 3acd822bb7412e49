"""``convforge bench --model NAME[:BATCH] --first-call``: how long a user waits for a fused model's first forward.

Each model runs in two new Python processes that share one fresh cache folder (convforge's, and the
CUDA driver's compute cache, ``CUDA_CACHE_PATH``, inside it): the first finds it
empty (cold: every kernel compiled, every choice made), the second finds what the first left there
(warm: a new process on a machine that ran the model before). After torch, torchvision and
convforge are imported and the model (random weights, eval mode) is on the GPU, a process times
``convforge.torch.fuse(model)``, the first forward under ``torch.no_grad()`` (synchronised) and a
second forward, and PyTorch's own first forward of the same model and input (cudnn.benchmark on) for
scale, and the long phases convforge reported (``convforge.progress``: compiling, tuning) with their
seconds. The native C++ module is built once per machine and torch version (~30 s, an installation
step, not a first call): it is built here first and copied into the fresh folder. One unreported
process runs first so that the machine's one-time costs (files in the page cache, CUDA's and cuDNN's
set-up) fall on no row.

``--dtype fp16|bf16`` runs the model cast to that dtype; ``--layout nhwc`` gives the model and input
channels_last. ``--train --amp fp16|bf16`` times the first mixed-precision training step instead
(``training_amp.amp_step_fn``: autocast, GradScaler for FP16, channels_last, SGD with momentum; the
model in training mode, float32 master weights) and a second step, against PyTorch AMP's first step.
The child's entry point is this module (``python -m convforge.apps.bench.first_call``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from convforge.files import write_atomic

CHILD_TIMEOUT_S = 600
FIELDS = ("fuse_s", "first_s", "second_s", "pytorch_first_s", "import_s")


def run(specs: list[str], dtype: str, layout: str, out: str | None, console: Console, train: str | None = None) -> int:
    """Every model cold then warm: the table and (``out``) first_call.json; exit status 1 when a child
    failed, 2 on bad input or no GPU. ``train`` (fp16 / bf16): the first AMP training step instead of
    the first forward (``dtype`` and ``layout`` then float32 and channels_last: AMP's)."""
    if train is not None:
        dtype, layout = f"train-{train}", "nhwc"
    from convforge.apps.bench import models as M

    prepared = M.prepare(specs, console)
    if prepared is None:
        return 2
    models, env = prepared
    native = _native_folder(console)
    with tempfile.TemporaryDirectory(prefix="convforge-first-call-") as cache:  # the machine, not a first call:
        _child(*models[0], dtype, layout, cache)  # page cache, CUDA's and cuDNN's one-time set-up
    rows: list[dict[str, Any]] = []
    for name, batch in models:
        with tempfile.TemporaryDirectory(prefix="convforge-first-call-") as cache:
            if native is not None:
                shutil.copytree(native, Path(cache) / "native")
            for state in ("cold", "warm"):
                row = _child(name, batch, dtype, layout, cache)
                rows.append({"model": name, "batch": batch, "dtype": dtype, "layout": layout, "cache": state, **row})
    console.print(_table(rows, train is not None))
    for r in rows:
        for phase in r.get("phases", []):
            console.print(f"  {r['model']} {r['cache']}: {phase}", markup=False, highlight=False)
    what = ("first and second step: the fused model's AMP training steps (forward, loss, backward, SGD), "
            "synchronised; pytorch first: the unfused model's first AMP step" if train is not None else
            "first and second forward: the fused model's forwards under no_grad, synchronised; pytorch first: the "
            "unfused model's first forward")
    console.print(f"fuse: convforge.torch.fuse(model); {what} (cudnn.benchmark); import: torch + torchvision + "
                  "convforge; each row a new process, cold = empty cache folders (convforge's and the CUDA driver's "
                  "compute cache), warm = the folders the cold "
                  "process left")
    if out:
        write_atomic(Path(out) / "first_call.json", json.dumps({"env": env, "rows": rows}, indent=1))
        console.print(f"wrote {out}/first_call.json")
    return 1 if any(r.get("status") != "ok" for r in rows) else 0


def _native_folder(console: Console) -> Path | None:
    """The folder holding the built native module (built now if needed), or None without one."""
    from convforge.config import config
    from convforge.torch import native

    t0 = time.perf_counter()
    if native.load() is None:
        console.print("the native module is not available here: every process takes the Python fast path")
        return None
    console.print(f"native module ready in {time.perf_counter() - t0:.1f} s (built once per machine)")
    folder = Path(config.cache_dir) / "native"
    return folder if folder.is_dir() else None


def _child(name: str, batch: int, dtype: str, layout: str, cache: str) -> dict[str, Any]:
    """One new process's times (FIELDS) and status."""
    # the driver's compute cache too (it keeps what was compiled for the device across processes: a
    # process that finds it full is not cold, however empty convforge's own folder)
    env = {**os.environ, "CONVFORGE_CACHE_DIR": cache, "CUDA_CACHE_PATH": str(Path(cache) / "nv-compute-cache")}
    cmd = [sys.executable, "-m", "convforge.apps.bench.first_call", name, str(batch), dtype, layout]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: no answer in {CHILD_TIMEOUT_S} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"status": f"failed (exit {done.returncode}): {tail}"}
    return {"status": "ok", **json.loads(lines[-1])}


def _table(rows: list[dict[str, Any]], train: bool = False) -> Table:
    what, unit = ("first AMP training step", "step") if train else ("first forward", "fwd")
    t = Table(title=f"{what} of a fused model, new process each row (seconds)")
    for col in ("model", "N", "dtype", "layout", "cache", "fuse", f"first {unit}", f"second {unit}", "pytorch first",
                "import", "status"):
        t.add_column(col)
    for r in rows:
        nums = [f"{r[f]:.2f}" if isinstance(r.get(f), float) else "-" for f in FIELDS]
        t.add_row(r["model"], str(r["batch"]), r["dtype"], r["layout"], r["cache"], *nums, r["status"])
    return t


def measure(name: str, batch: int, dtype: str, layout: str) -> dict[str, Any]:
    """In this (new) process: the times of FIELDS for one model (see the module docstring)."""
    t0 = time.perf_counter()
    import torch

    import convforge.torch as ct
    from convforge.apps.bench import models as M
    from convforge.progress import listen

    imported = time.perf_counter() - t0
    torch.backends.cudnn.benchmark = True
    model = M.build(name)
    if isinstance(model, str):
        raise RuntimeError(model)
    amp = dtype[len("train-"):] if dtype.startswith("train-") else None
    dtype = "float32" if amp else dtype  # AMP: float32 master weights, autocast computes in half
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    model = model.to(dtype=getattr(torch, dtype), memory_format=fmt)
    size = M.MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(M.SEED)
    x = torch.randn(batch, 3, size, size, device="cuda", generator=gen).to(dtype=getattr(torch, dtype),
                                                                         memory_format=fmt)

    def timed(fn: Any) -> tuple[Any, float]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        y = fn()
        torch.cuda.synchronize()
        return y, time.perf_counter() - t

    phases: list[str] = []

    def note(phase: Any, event: str) -> None:
        if event == "end":
            phases.append(f"{phase.what}: {phase.done} {phase.unit}, {phase.seconds:.2f} s")

    if amp:
        with listen(note):
            times = _train_steps(model, name, batch, amp, timed)
        return {**times, "import_s": imported, "phases": phases}
    with torch.no_grad(), listen(note):
        _, pytorch_first = timed(lambda: model(x))
        (fused, _), fuse_s = timed(lambda: ct.fuse(model))
        _, first = timed(lambda: fused(x))
        _, second = timed(lambda: fused(x))
    return {"fuse_s": fuse_s, "first_s": first, "second_s": second, "pytorch_first_s": pytorch_first,
            "import_s": imported, "phases": phases}


def _train_steps(model: Any, name: str, batch: int, amp: str, timed: Any) -> dict[str, float]:
    """PyTorch AMP's first step on a copy, then fuse, the fused model's first and second AMP steps
    (training_amp.amp_step_fn), on one batch of ``batch`` images in channels_last."""
    import copy

    import torch

    import convforge.torch as ct
    from convforge.apps.bench import training, training_amp

    dtype = getattr(torch, training_amp.DTYPES[amp])
    x, target = training._batch(name, batch)
    x = x.contiguous(memory_format=torch.channels_last)
    _, pytorch_first = timed(training_amp.amp_step_fn(copy.deepcopy(model), x, target, dtype))
    (fused, _), fuse_s = timed(lambda: ct.fuse(model))
    step = training_amp.amp_step_fn(fused, x, target, dtype)
    _, first = timed(step)
    _, second = timed(step)
    return {"fuse_s": fuse_s, "first_s": first, "second_s": second, "pytorch_first_s": pytorch_first}


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: python -m convforge.apps.bench.first_call NAME BATCH DTYPE LAYOUT")
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])))
