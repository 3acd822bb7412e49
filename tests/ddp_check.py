"""Data-parallel training of a convforge model, for tests/test_gpu_multi.py and tests/test_ddp_order.py
(not a test file itself).

Under ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node N tests/ddp_check.py
--how HOW --out DIR``) each rank trains a small model wrapped in DistributedDataParallel (NCCL; gloo
with ``--device cpu``) on its shard of a fixed batch for ``--steps`` SGD steps and writes
``DIR/rank{R}.pt``: the averaged gradients of every step, the parameters after the last step, what it
checked about its device (every executable, runner and cached filter transform of convforge on its
own GPU), and the order in which the last step's backward made its gradients (below). With
``--reference`` one process on GPU 0 takes the same steps from the same weights, each step's loss
the mean of the shards' losses computed one shard at a time (so batch norm sees the same per-shard
statistics as under DDP), and writes ``DIR/reference.pt``. The test compares them.

HOW: ``torch`` (the model as PyTorch has it: the yardstick of the order), ``convert`` or ``fuse``
(the model in training mode: FusedConv2d's unfused path, convforge's conv forward and backward
kernels; with fuse, the conv -> batch norm blocks as one C++ autograd node where the native path is
built, their batch norm on convforge's kernels), optionally ``+noset`` (ranks do not call
torch.cuda.set_device: tensors on cuda:R while device 0 stays current) and ``+autotune`` (layers
tuned on first sight into ``DIR/tuning.sqlite`` with a two-candidate budget, by every rank at
once). ``--precision``: convforge's class (``relaxed``: PyTorch's yardstick runs TF32 too).
``--amp fp16|bf16``: every step under autocast with a GradScaler (the gradients recorded unscaled).
``--device cpu`` (gloo; tests/test_ddp_order.py): convforge's ``Conv2d`` sends its training call
through the ``convforge::conv2d`` op as on CUDA (on CPU tensors it would call PyTorch's conv), so the
graph holds the op's autograd node, whose CPU kernels compute through PyTorch's; convert swaps the
convs of the CPU model (``convert`` itself leaves CPU parameters to PyTorch).

The order: during the last step each parameter's gradient hook (``register_post_accumulate_grad_hook``,
after DDP's reducer saw the gradient) and the gradient of each conv's and linear's input (the
layer's backward done) append an event, in the order the backward made them: ``("p", parameter)``
and ``("x", module)``; :func:`canonical` maps parameters to groups (the conv a fused batch norm's
parameters belong to: one C++ node makes their gradients together) and merges repeats. With
``--bucket-mb`` tiny, DDP's rebuilt buckets (``rebuilt_per_bucket_param_indices``) list the order in
which DDP saw the gradients ready in its first step.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the lent machines' rules: no NVLink multicast
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

N_PER_RANK = 4
SHAPE = (3, 17, 19)
CLASSES = 10
LR = 0.05
AMP = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Block(nn.Module):
    """conv-bn-relu, conv-bn, + the input, relu: fuse() makes bn+relu and bn+add+relu FusedConv2d's."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.block = Block(16)
        self.down = nn.Conv2d(16, 24, 3, stride=2, padding=1)  # strided, with bias
        self.proj = nn.Conv2d(24, 8, 1)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(torch.relu(self.bn(self.stem(x))))
        x = self.proj(torch.relu(self.down(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def build(how: str, device: torch.device) -> tuple[nn.Module, int]:
    """The model (same weights everywhere: drawn on the CPU from seed 0), made convforge's after
    moving to ``device`` (``torch``: left as it is); the number of convs convforge runs."""
    import convforge.torch as ct

    torch.manual_seed(0)
    model = Net().to(device).train()
    if how.startswith("torch"):
        return model, 0
    if device.type == "cpu":
        _through_the_op()
    if how.startswith("fuse"):
        model, report = ct.fuse(model)
        assert report.fused, report
    elif device.type == "cpu":
        return model, _convert_cpu(model)
    else:
        report = ct.convert(model)
    assert not report.left, report
    return model.train(), len(report.converted)


def _through_the_op() -> None:
    """CPU runs (module docstring): ``Conv2d.forward`` takes ``_forward``, the op, as on CUDA."""
    from convforge.torch.modules import Conv2d

    def forward(self: Conv2d, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self.weight, self.bias)

    Conv2d.forward = forward  # type: ignore[method-assign]


def _convert_cpu(model: nn.Module) -> int:
    """What ``convert`` does, for a CPU model: every nn.Conv2d swapped for a convforge Conv2d."""
    from convforge.torch.modules import Conv2d

    names = [n for n, m in model.named_modules() if type(m) is nn.Conv2d]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, Conv2d.from_module(getattr(owner, attr)))
    return len(names)


def data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(world * N_PER_RANK, *SHAPE, generator=g), torch.randint(0, CLASSES, (world * N_PER_RANK,),
                                                                               generator=g)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().double().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().cpu().clone() for n, p in model.named_parameters()}


def device_checks(rank_device: int) -> dict[str, object]:
    """Where convforge's state lives: every executable's back-end, every runner's, every cached
    filter transform; the database entries' device keys."""
    from convforge.dispatch import RUNNERS
    from convforge.dispatch.executables import _EXECUTABLES

    exes = {key[0].device_id for key in _EXECUTABLES}
    runners = {run.exe.backend.device_id for run in RUNNERS.values() if hasattr(run, "exe")}
    packed = set()
    for run in RUNNERS.values():
        cache = getattr(run, "filters", None)
        for entry in getattr(cache, "_entries", {}).values():
            packed.add(entry[2].device.index)
    n_filters = sum(len(getattr(r, "filters", None) or ()) for r in RUNNERS.values())
    from convforge.torch import native

    nat = native.load()
    stats = nat.stats() if nat is not None else {}
    return {"executables": sorted(exes), "runners": sorted(runners), "filters": sorted(packed),
            "n_runners": len(RUNNERS), "n_filters": n_filters, "current": torch.cuda.current_device(),
            "rank_device": rank_device, "native": nat is not None, "block_runs": stats.get("block_runs", 0),
            "pass_runs": stats.get("pass_runs", 0)}


def setup(args: argparse.Namespace) -> None:
    from convforge.config import config

    tf32 = args.precision == "relaxed"
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    config.precision = args.precision
    if "+autotune" in args.how:
        from pathlib import Path

        import convforge.tune as tune_pkg
        from convforge.tune import Budget

        config.db_path = Path(args.out) / "tuning.sqlite"
        config.autotune = True
        tune_pkg.AUTOTUNE_BUDGET = Budget(None, 2)


# -- the order of a backward -------------------------------------------------------------------------------
def groups(model: nn.Module) -> dict[str, str]:
    """Parameter name -> its group: the conv a fused batch norm's parameters belong to (its C++ node
    makes their gradients together), else the module holding it."""
    bn_of = {id(m._cf_bn): name for name, m in model.named_modules() if getattr(m, "_cf_bn", None) is not None}
    by_module = {}
    for name, m in model.named_modules():
        for pname, _ in m.named_parameters(recurse=False):
            by_module[f"{name}.{pname}" if name else pname] = bn_of.get(id(m), name)
    return by_module


class Recorder:
    """The events of one backward (module docstring), recorded while ``on``."""

    def __init__(self, model: nn.Module) -> None:
        self.events: list[tuple[str, str]] = []
        self.on = False
        self.handles = [p.register_post_accumulate_grad_hook(self._param(n)) for n, p in model.named_parameters()]
        for name, m in model.named_modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                self.handles.append(m.register_forward_pre_hook(self._input(name)))

    def _param(self, name: str) -> Any:
        def hook(_p: torch.Tensor) -> None:
            if self.on:
                self.events.append(("p", name))
        return hook

    def _input(self, name: str) -> Any:
        def pre(_m: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if self.on and isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda _g: self.events.append(("x", name)))
        return pre



def canonical(events: list[tuple[str, str]], group: dict[str, str]) -> list[tuple[str, str]]:
    """``events`` with parameters as their groups (:func:`groups` of the fused model: the same names
    in every form of the model) and repeats of one event in a row merged."""
    out: list[tuple[str, str]] = []
    for kind, name in events:
        e = (kind, group.get(name, name) if kind == "p" else name)
        if not out or out[-1] != e:
            out.append(e)
    return out


def bucket_order(ddp: Any, model: nn.Module) -> list[str]:
    """DDP's rebuilt buckets as parameter names, in the order DDP saw them ready in its first step."""
    names = [n for n, _ in model.named_parameters()]
    text = str(ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices", ""))
    return [names[int(i)] for bucket in text.split(",") for i in bucket.split()]


# -- the runs ----------------------------------------------------------------------------------------------
def make_step(model: nn.Module, opt: Any, scaler: Any, amp: str | None, device: torch.device) -> Any:
    """step(x, y, record) -> the unscaled gradients (``record``: into the returned dict), then the update."""

    def step(loss_of: Any) -> dict[str, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=AMP[amp]) if amp else nullcontext():
            loss = loss_of()
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        out = grads(model)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        return out

    return step


def _scaler(amp: str | None, device: torch.device) -> Any:
    return torch.amp.GradScaler(device.type, init_scale=2.0 ** 10) if amp else None


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cpu = args.device == "cpu"
    if not cpu and "+noset" not in args.how:
        torch.cuda.set_device(local)
    device = torch.device("cpu") if cpu else torch.device("cuda", local)
    dist.init_process_group("gloo" if cpu else "nccl")
    setup(args)
    model, converted = build(args.how, device)
    kw = {} if args.bucket_mb is None else {"bucket_cap_mb": args.bucket_mb}
    ddp = DDP(model, device_ids=None if cpu else [local], **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    x, y = data(world)
    shard = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    xs, ys = x[shard].to(device), y[shard].to(device)
    rec = Recorder(model)
    step = make_step(model, opt, _scaler(args.amp, device), args.amp, device)
    steps = []
    for i in range(args.steps):
        rec.on, rec.events = i == args.steps - 1, []
        steps.append(step(lambda: F.cross_entropy(ddp(xs), ys)))
    if not cpu:
        torch.cuda.synchronize(device)
    checks = device_checks(local) if not cpu else {}
    checks["converted"] = converted
    torch.save({"grads": steps, "params": params(model), "checks": checks, "events": rec.events,
                "buckets": bucket_order(ddp, model), "groups": groups(model)},
               os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def one_gpu_steps(model: nn.Module, device: torch.device, world: int, steps: int,
                  dtype: torch.dtype = torch.float32, amp: str | None = None) -> list[dict[str, torch.Tensor]]:
    """``steps`` SGD steps on one device, each step's loss the mean of the ``world`` shards' losses
    (each shard a forward of its own: batch norm sees per-shard statistics, as under DDP)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = data(world)
    step = make_step(model, opt, _scaler(amp, device), amp, device)

    def loss() -> torch.Tensor:
        losses = [F.cross_entropy(model(x[r * N_PER_RANK:(r + 1) * N_PER_RANK].to(device, dtype)),
                                  y[r * N_PER_RANK:(r + 1) * N_PER_RANK].to(device)) for r in range(world)]
        return torch.stack(losses).sum() / world

    out = [step(loss) for _ in range(steps)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def reference_main(args: argparse.Namespace) -> None:
    """One GPU, the same steps with the convforge model; PyTorch's own float64 model, the anchor
    that both the DDP run and this one compute the right gradients; and PyTorch's model in the same
    precision (FP32, TF32 for the relaxed class, the same autocast), the yardstick of how far a run in
    that precision strays from the anchor (batch norm over 4 images amplifies rounding, and the
    weights of later steps differ)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    setup(args)
    model, converted = build(args.how, device)
    steps = one_gpu_steps(model, device, args.world, args.steps, amp=args.amp)
    checks = device_checks(0)
    checks["converted"] = converted
    torch.manual_seed(0)
    torch64 = Net().to(device).double().train()  # the same weights (drawn in float32, then widened)
    anchor = one_gpu_steps(torch64, device, args.world, args.steps, torch.float64)
    torch.manual_seed(0)
    yard = Net().to(device).train()
    yardstick = one_gpu_steps(yard, device, args.world, args.steps, amp=args.amp)
    torch.save({"grads": steps, "params": params(model), "checks": checks, "torch64": anchor,
                "params64": params(torch64), "torch32": yardstick}, os.path.join(args.out, "reference.pt"))


def bench_rank_cpu(rank: int, world: int, port: int, out: str) -> None:
    """One rank of bench/ddp.py's ``rank_run`` on the CPU (gloo), for tests/test_ddp_order.py: a tiny
    model in place of torchvision's, a wall-clock timer in place of CUDA events."""
    import statistics
    import time
    from pathlib import Path

    from convforge.apps.bench import ddp, models, training

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))

    def build(name: str) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def timed(step: Any, warmup: int, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    models.build = build  # type: ignore[assignment]
    models.MODELS["tiny"] = 12
    models.environment = lambda: {"device": "cpu"}  # type: ignore[assignment]
    training._time = timed  # type: ignore[assignment]
    training.CLASSES = 10
    ddp.rank_run([("tiny", 4)], ("pytorch", "convforge_fused"), ("fp32",), 1, 3, False, Path(out), profile=True,
                 cpu=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--how", default="convert")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world", type=int, default=2, help="shards of the reference run")
    p.add_argument("--reference", action="store_true")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--precision", choices=("fp32", "relaxed"), default="fp32")
    p.add_argument("--amp", choices=tuple(AMP))
    p.add_argument("--bucket-mb", type=float, help="DDP's bucket_cap_mb (tiny: one bucket per parameter)")
    args = p.parse_args(argv)
    if args.amp and args.device == "cpu":
        p.error("--amp runs on CUDA (on the CPU the op's PyTorch kernels run under CPU autocast's own rules)")
    (reference_main if args.reference else rank_main)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
