"""Data-parallel training of a convforge model, for tests/test_gpu_multi.py (not a test file itself).

Under ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ddp_check.py
--how HOW --out DIR``) each rank trains a small model wrapped in DistributedDataParallel (NCCL) on
its shard of a fixed batch for ``--steps`` SGD steps and writes ``DIR/rank{R}.pt``: the averaged
gradients of every step, the parameters after the last step, and what it checked about its device
(every executable, runner and cached filter transform of convforge on its own GPU). With
``--reference`` one process on GPU 0 takes the same steps from the same weights, each step's loss
the mean of the shards' losses computed one shard at a time (so batch norm sees the same per-shard
statistics as under DDP), and writes ``DIR/reference.pt``. The test compares them.

HOW: ``convert`` or ``fuse`` (the model in training mode: FusedConv2d's unfused path, convforge's
conv forward and backward kernels, PyTorch's batch norm), optionally ``+noset`` (ranks do not call
torch.cuda.set_device: tensors on cuda:R while device 0 stays current) and ``+autotune`` (layers
tuned on first sight into ``DIR/tuning.sqlite`` with a two-candidate budget, by both ranks at once).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # the lent machines' rule: no NVLink multicast

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

N_PER_RANK = 4
SHAPE = (3, 17, 19)
CLASSES = 10
LR = 0.05


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
    moving to ``device``; the number of convs convforge runs."""
    import convforge.torch as ct

    torch.manual_seed(0)
    model = Net().to(device).train()
    if how.startswith("fuse"):
        model, report = ct.fuse(model)
        assert report.fused, report
    else:
        report = ct.convert(model)
    assert not report.left, report
    return model.train(), len(report.converted)


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
    return {"executables": sorted(exes), "runners": sorted(runners), "filters": sorted(packed),
            "n_runners": len(RUNNERS), "n_filters": n_filters, "current": torch.cuda.current_device(),
            "rank_device": rank_device}


def setup(args: argparse.Namespace) -> None:
    from convforge.config import config

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    if "+autotune" in args.how:
        from pathlib import Path

        import convforge.tune as tune_pkg
        from convforge.tune import Budget

        config.db_path = Path(args.out) / "tuning.sqlite"
        config.autotune = True
        tune_pkg.AUTOTUNE_BUDGET = Budget(None, 2)


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if "+noset" not in args.how:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl")
    setup(args)
    model, converted = build(args.how, device)
    ddp = DDP(model, device_ids=[local])
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    x, y = data(world)
    shard = slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    xs, ys = x[shard].to(device), y[shard].to(device)
    steps = []
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(xs), ys).backward()
        steps.append(grads(model))
        opt.step()
    torch.cuda.synchronize(device)
    checks = device_checks(local)
    checks["converted"] = converted
    torch.save({"grads": steps, "params": params(model), "checks": checks}, os.path.join(args.out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def one_gpu_steps(model: nn.Module, device: torch.device, world: int, steps: int,
                  dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    """``steps`` SGD steps on one device, each step's loss the mean of the ``world`` shards' losses
    (each shard a forward of its own: batch norm sees per-shard statistics, as under DDP)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = data(world)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = [F.cross_entropy(model(x[r * N_PER_RANK:(r + 1) * N_PER_RANK].to(device, dtype)),
                                  y[r * N_PER_RANK:(r + 1) * N_PER_RANK].to(device)) for r in range(world)]
        (torch.stack(losses).sum() / world).backward()
        out.append(grads(model))
        opt.step()
    torch.cuda.synchronize(device)
    return out


def reference_main(args: argparse.Namespace) -> None:
    """One GPU, the same steps with the convforge model; PyTorch's own float64 model, the anchor
    that both the DDP run and this one compute the right gradients; and PyTorch's FP32 model, the
    yardstick of how far an FP32 run strays from that anchor (batch norm over 4 images amplifies
    rounding, and the weights of later steps differ)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(0)
    setup(args)
    model, converted = build(args.how, device)
    steps = one_gpu_steps(model, device, args.world, args.steps)
    checks = device_checks(0)
    checks["converted"] = converted
    torch.manual_seed(0)
    torch64 = Net().to(device).double().train()  # the same weights (drawn in float32, then widened)
    anchor = one_gpu_steps(torch64, device, args.world, args.steps, torch.float64)
    torch.manual_seed(0)
    torch32 = Net().to(device).train()  # PyTorch FP32 (TF32 off): the yardstick of the error
    yardstick = one_gpu_steps(torch32, device, args.world, args.steps)
    torch.save({"grads": steps, "params": params(model), "checks": checks, "torch64": anchor,
                "params64": params(torch64), "torch32": yardstick}, os.path.join(args.out, "reference.pt"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--how", default="convert")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--world", type=int, default=2, help="shards of the reference run")
    p.add_argument("--reference", action="store_true")
    args = p.parse_args(argv)
    (reference_main if args.reference else rank_main)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
