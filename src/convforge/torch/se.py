"""Squeeze-and-excitation on convforge's kernels (``kernels/se.py``): what ``fuse()`` puts in place of
torchvision's ``SqueezeExcitation`` pattern (EfficientNet, MobileNet-v3, RegNetY).

``scale = gate(fc2(act(fc1(avgpool(x)))))``, ``y = scale * x``: PyTorch runs it as about 11 operators and
autograd nodes forward and 20 backward (the two 1x1 convs' weight and bias casts under autocast among them),
which on a host-bound AMP step cost more than the GPU time they launch. Here it is one autograd node of 3
launches forward and 4 backward, the float32 master weights read and their gradients written as they are.
With the native module loaded the node is native_layers.inc's (the same launches from C++, no Python in its forward
or backward: ``register_se`` files each layer's program on its first call), else ``_SqueezeExcite``.
Channels-last or NCHW-contiguous CUDA tensors of float32, float16 or bfloat16, in an autocast region or not,
with grad or without; anything else (other strides, dtypes, CPU, ``torch.compile`` or ``torch.jit`` tracing (an
ONNX export), more than ``kernels.se.MAX_C`` channels) runs the original modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from convforge.backends import get_backend
from convforge.frontends import fast_path
from convforge.kernels.se import MAX_C, SeProgram, SeTrain, se_program, title
from convforge.torch.modules import _AUTOCAST

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_ACTS = {torch.nn.ReLU: "relu", torch.nn.SiLU: "silu"}
_GATES = {torch.nn.Sigmoid: "sigmoid", torch.nn.Hardsigmoid: "hardsigmoid"}
_PROGRAMS: dict[tuple[SeTrain, int], tuple[SeTrain, SeProgram, Any, Any]] = {}
_HANDLES: dict[tuple[SeTrain, int], int] = {}  # native.cpp's register_se handle of each program
# the kernels' buffers as native_layers.inc's pointer slots (its SeSlot)
SE_SLOTS = {"x": 0, "w1": 1, "b1": 2, "w2": 3, "b2": 4, "part": 5, "sv": 6, "y": 7, "gy": 8, "bs": 9, "gw1": 10,
            "gb1": 11, "gw2": 12, "gb2": 13, "gx": 14}
_CL = torch.channels_last


def _one_by_one(m: Any) -> bool:
    """A 1x1 conv with a bias, stride 1, no padding, one group: a matrix and a vector."""
    return isinstance(m, torch.nn.Conv2d) and m.bias is not None \
        and tuple(m.kernel_size) == (1, 1) and tuple(m.stride) == (1, 1) and m.groups == 1 \
        and tuple(m.dilation) == (1, 1) and m.padding_mode == "zeros" and m.padding in ((0, 0), 0, "valid")


def kinds(pool: Any, fc1: Any, act: Any, fc2: Any, gate: Any) -> tuple[str, str] | None:
    """(activation, gate) of modules that make a squeeze-and-excitation these kernels run, or None."""
    size = getattr(pool, "output_size", None)
    if type(pool) is not torch.nn.AdaptiveAvgPool2d or size not in (1, (1, 1)):
        return None
    if not (_one_by_one(fc1) and _one_by_one(fc2)) or fc1.out_channels != fc2.in_channels \
            or fc2.out_channels != fc1.in_channels or max(fc1.in_channels, fc1.out_channels) > MAX_C:
        return None
    a, g = _ACTS.get(type(act)), _GATES.get(type(gate))
    return None if a is None or g is None else (a, g)


class SqueezeExcite(torch.nn.Module):
    """``gate(fc2(act(fc1(pool(x))))) * x`` as one node: the modules stay where the model has them (its
    state_dict is unchanged) and this holds references to them, no parameters of its own."""

    def __init__(self, pool: Any, fc1: Any, act: Any, fc2: Any, gate: Any) -> None:
        super().__init__()
        found = kinds(pool, fc1, act, fc2, gate)
        if found is None:
            raise ValueError("not a squeeze-and-excitation these kernels run (kernels/se.py)")
        self.__dict__["_cf_mods"] = (pool, fc1, act, fc2, gate)
        self.act, self.gate = found

    def extra_repr(self) -> str:
        fc1 = self._cf_mods[1]
        return f"{fc1.in_channels} -> {fc1.out_channels}, act={self.act}, gate={self.gate}"

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The original modules' computation (PyTorch's operators)."""
        pool, fc1, act, fc2, gate = self._cf_mods
        return gate(fc2(act(fc1(pool(x))))) * x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, fc1, _, fc2, _ = self._cf_mods
        w1, b1, w2, b2 = fc1.weight, fc1.bias, fc2.weight, fc2.bias
        se = self.layer(x, w1, w2)
        if se is None or any(t.dtype != w1.dtype or not t.is_cuda or t.device != x.device for t in (b1, w2, b2)):
            return self.reference(x)
        hit = program_of(se, x.device.index or 0)
        module = fast_path.torch_module()
        if module is not None:  # native_layers.inc's node: the same launches from C++
            handle = _HANDLES.get((se, x.device.index or 0))
            if handle is None:
                handle = _file(module, hit, x.device.index or 0)
            y = module.se(x, w1, b1, w2, b2, handle)
            if y is not None:
                return y  # type: ignore[no-any-return]
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, b1, w2, b2)):
            return _SqueezeExcite.apply(x, w1, b1, w2, b2, hit)  # type: ignore[no-any-return]
        with torch.no_grad():
            return _SqueezeExcite.forward(_NoCtx(), x, w1, b1, w2, b2, hit)

    def layer(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> SeTrain | None:
        """The kernels' description of this call, or None where the modules run (module docstring)."""
        if (x.dim() != 4 or not x.is_cuda or x.dtype not in _NAMES or x.data_ptr() % 16
                or torch.compiler.is_compiling() or torch.jit.is_tracing() or x.numel() == 0
                or not (w1.is_contiguous() and w2.is_contiguous())):
            return None
        lay = "nhwc" if x.is_contiguous(memory_format=_CL) else "nchw" if x.is_contiguous() else None
        if lay is None:
            return None
        if _AUTOCAST():  # the region's convs would run in its half dtype; here float32 inside
            if w1.dtype != torch.float32:
                return None
        elif w1.dtype != x.dtype:
            return None
        n, c, h, w = x.shape
        if c != w1.shape[1]:
            return None
        return SeTrain(n, c, h * w, w1.shape[0], self.act, self.gate, _NAMES[x.dtype], _NAMES[w1.dtype], lay)


def program_work(se: SeTrain, device: int) -> Any:
    """The ``Work`` of the program :func:`program_of` builds for ``se`` on ``device`` (the same source): what
    torch/train_ahead.py compiles ahead, so the first step finds it built."""
    from convforge.backends.base import Work
    from convforge.codegen.render import render

    prog = se_program(se, get_backend("cuda", device).device)
    return Work(render(list(prog.kernels), "cuda", title(se)), tuple(prog.kernels))


def program_of(se: SeTrain, device: int) -> tuple[SeTrain, SeProgram, Any, Any]:
    """(layer, program, launcher on raw pointers, torch's raw-stream query), compiled once per process."""
    hit = _PROGRAMS.get((se, device))
    if hit is None:
        from convforge.backends.cuda import RawLaunches
        from convforge.frontends.torch_run import torch_stream_queries

        be = get_backend("cuda", device)
        prog = se_program(se, be.device)
        run = RawLaunches(be, prog.kernels, {"forward": prog.forward, "backward": prog.backward},  # type: ignore[arg-type]
                          title(se))
        hit = _PROGRAMS[(se, device)] = (se, prog, run, torch_stream_queries()[0])
    return hit


def _file(module: Any, hit: tuple[SeTrain, SeProgram, Any, Any], device: int) -> int:
    """The layer's program filed with native.cpp (``register_se``) once: its handle."""
    se, prog, run, _ = hit
    handle = _HANDLES[(se, device)] = int(module.register_se(
        run.native_program(SE_SLOTS, "forward", "backward"), se.n, se.c, se.hw, se.s, prog.part, se.sv, se.bs,
        se.dtype, se.pdtype, se.nhwc))
    return handle


def _floats(count: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(max(count, 1), dtype=torch.float32, device=like.device)


class _SqueezeExcite(torch.autograd.Function):
    """The autograd node: saves x, the weights and the float32 intermediates "sv" (p, u, a, g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,  # type: ignore[override]
                b2: torch.Tensor, hit: tuple[SeTrain, SeProgram, Any, Any]) -> torch.Tensor:
        se, prog, run, stream_of = hit
        y = torch.empty_like(x)  # x's layout (dense: its strides)
        part, sv = _floats(prog.part, x), _floats(se.sv, x)
        run("forward", {"x": x.data_ptr(), "w1": w1.data_ptr(), "b1": b1.data_ptr(), "w2": w2.data_ptr(),
                        "b2": b2.data_ptr(), "part": part.data_ptr(), "sv": sv.data_ptr(), "y": y.data_ptr()},
            stream_of(x.device.index or 0))
        ctx.hit = hit
        ctx.save_for_backward(x, w1, w2, sv)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        se, prog, run, stream_of = ctx.hit
        x, w1, w2, sv = ctx.saved_tensors
        fmt = _CL if se.nhwc else torch.contiguous_format
        if not gy.is_contiguous(memory_format=fmt) or gy.data_ptr() % 16 or gy.dtype != x.dtype:
            gy = gy.to(x.dtype).clone(memory_format=fmt)
        gx = torch.empty_like(x)
        part, bs = _floats(prog.part, x), _floats(se.bs, x)
        gw1, gw2 = torch.empty_like(w1, memory_format=torch.contiguous_format), \
            torch.empty_like(w2, memory_format=torch.contiguous_format)
        gb1 = torch.empty(se.s, dtype=w1.dtype, device=w1.device)
        gb2 = torch.empty(se.c, dtype=w1.dtype, device=w1.device)
        run("backward", {"x": x.data_ptr(), "gy": gy.data_ptr(), "w1": w1.data_ptr(), "w2": w2.data_ptr(),
                         "part": part.data_ptr(), "sv": sv.data_ptr(), "bs": bs.data_ptr(), "gw1": gw1.data_ptr(),
                         "gb1": gb1.data_ptr(), "gw2": gw2.data_ptr(), "gb2": gb2.data_ptr(), "gx": gx.data_ptr()},
            stream_of(gy.device.index or 0))
        return gx, gw1, gb1, gw2, gb2, None


class _NoCtx:
    """A stand-in context for a forward without autograd."""

    hit: Any = None

    def save_for_backward(self, *tensors: Any) -> None:
        pass
