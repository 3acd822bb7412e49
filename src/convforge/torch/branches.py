"""Re-parameterised branches: a sum of parallel convs (each with its batch norm) and an identity over one
input, as RepVGG / ACNet / DBB-style blocks and many detection backbones train them, run as ONE conv in eval
inference.

    y = [ReLU] ( BN_a(conv_kxk(x)) + BN_b(conv_1x1(x)) + [BN_c](x) + ... )

Every branch is linear in x, so in eval (the batch norms on their running statistics) the sum is one conv
whose filters are the branches' filters, each scaled by its batch norm and zero-padded to the widest kernel,
added (the identity as a filter with a 1 at the centre tap of its own channel), and whose bias is the sum
of the branches' shifted biases. ``fuse()`` (fuse.py) finds such sums in the traced graph and calls one
:class:`BranchSum` in their place: in training mode, or when a gradient must reach the branches'
parameters, it runs the branches as they were; in eval inference it folds them (again whenever a
parameter or running statistic changed version) into a convforge ``FusedConv2d`` with the ReLU after it.
The branches' modules stay in the model where they were (state_dict unchanged); the BranchSum holds
references only and no parameters of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from convforge.torch.fused import FusedConv2d

Branch = tuple[torch.nn.Conv2d | None, torch.nn.BatchNorm2d | None]  # (conv or identity, batch norm or none)


def branch_reason(branches: list[Branch]) -> str | None:
    """Why these branches over one input cannot be folded into one conv, or None: two convs or more
    (one conv and an identity is fuse()'s conv -> batch norm -> add chain, a residual in the epilogue) of one shape
    family (in and out channels, stride, groups; dilation 1; odd square kernels padded to keep the
    centre: k // 2; zero padding), batch norms of running statistics over the output channels, an
    identity only where the output has the input's channels at stride 1."""
    convs = [c for c, _ in branches if c is not None]
    if len(convs) < 2:  # one conv and an identity: fuse()'s conv -> batch norm -> add chain runs it
        return "fewer than two conv branches"
    first = convs[0]
    for c in convs:
        k = c.kernel_size
        if (c.in_channels, c.out_channels, c.stride, c.groups) != (first.in_channels, first.out_channels,
                                                                  first.stride, first.groups):
            return "branches of different channels, stride or groups"
        if c.dilation != (1, 1) or c.padding_mode != "zeros" or k[0] != k[1] or k[0] % 2 == 0:
            return "a branch with dilation, a padding mode or an even or non-square kernel"
        if c.padding != (k[0] // 2, k[1] // 2):
            return "a branch padded off its kernel's centre"
    for c, bn in branches:
        if c is None and (first.in_channels != first.out_channels or first.stride != (1, 1)):
            return "an identity branch where the output differs from the input in channels or size"
        if bn is not None and (bn.running_mean is None or bn.num_features != first.out_channels):
            return "a batch norm without running statistics or of other channels"
    return None


def fold(branches: list[Branch]) -> tuple[torch.Tensor, torch.Tensor]:
    """(filters K x C/g x k x k, bias K) of the one conv the branches sum to in eval, in float64."""
    convs = [c for c, _ in branches if c is not None]
    first = convs[0]
    k = max(c.kernel_size[0] for c in convs)
    out, cg = first.out_channels, first.in_channels // first.groups
    dev = first.weight.device
    w = torch.zeros(out, cg, k, k, dtype=torch.float64, device=dev)
    b = torch.zeros(out, dtype=torch.float64, device=dev)
    for conv, bn in branches:
        if conv is None:  # the identity: channel o reads its own channel, o % (C / g) within its group
            wi = torch.zeros(out, cg, 1, 1, dtype=torch.float64, device=dev)
            wi[torch.arange(out), torch.arange(out) % cg, 0, 0] = 1.0
            bi = torch.zeros(out, dtype=torch.float64, device=dev)
        else:
            wi = conv.weight.detach().double()
            bi = conv.bias.detach().double() if conv.bias is not None else torch.zeros(out, dtype=torch.float64,
                                                                                      device=dev)
        if bn is not None:
            var, mean = bn.running_var.detach().double(), bn.running_mean.detach().double()  # type: ignore[union-attr]
            gamma = bn.weight.detach().double() if bn.weight is not None else torch.ones_like(var)
            beta = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(var)
            s = gamma / torch.sqrt(var + bn.eps)
            wi, bi = wi * s[:, None, None, None], (bi - mean) * s + beta
        o = (k - wi.shape[-1]) // 2
        w[:, :, o:o + wi.shape[-2], o:o + wi.shape[-1]] += wi
        b += bi
    return w, b


class BranchSum(torch.nn.Module):
    """The sum of re-parameterisable branches over one input [-> ReLU] (module docstring)."""

    def __init__(self, branches: list[Branch], relu: bool, options: dict[str, Any]) -> None:
        super().__init__()
        why = branch_reason(branches)
        if why:
            raise ValueError(f"BranchSum: {why}")
        self.__dict__["_cf_branches"] = list(branches)  # references: not submodules, not in state_dict
        self.__dict__["_cf_relu"] = relu
        self.__dict__["_cf_options"] = dict(options)
        self.__dict__["_cf_conv"] = None  # the folded FusedConv2d, built on the first eval forward
        self.__dict__["_cf_key"] = None

    def ops(self) -> str:
        """What the module sums, e.g. "3x3+1x1+id(bn)+relu"."""
        parts = [("id" if c is None else f"{c.kernel_size[0]}x{c.kernel_size[1]}") + ("(bn)" if bn else "")
                 for c, bn in self._cf_branches]
        return "+".join(parts) + ("+relu" if self._cf_relu else "")

    def extra_repr(self) -> str:
        return f"branches={self.ops()!r}"

    def _tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for conv, bn in self._cf_branches:
            for m in (conv, bn):
                if m is not None:
                    out += [t for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)) if t is not None]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = self._tensors()
        if self.training or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return self._branches(x)
        return self._folded(tensors)(x)  # type: ignore[no-any-return]

    def _branches(self, x: torch.Tensor) -> torch.Tensor:
        """The branches as the model defined them (training, or a gradient through them)."""
        total: Any = None
        for conv, bn in self._cf_branches:
            y = x if conv is None else conv(x)
            y = y if bn is None else bn(y)
            total = y if total is None else total + y
        return torch.relu(total) if self._cf_relu else total  # type: ignore[no-any-return]

    def _folded(self, tensors: list[torch.Tensor]) -> FusedConv2d:
        """The one conv of the current parameters and running statistics (folded again when any of them
        changed version, moved or changed dtype)."""
        first = next(c for c, _ in self._cf_branches if c is not None)
        try:
            key: Any = tuple((t.data_ptr(), t._version, t.dtype) for t in tensors)
        except RuntimeError:  # inference tensors have no version counter: fold every call
            key = None
        conv = self._cf_conv
        if conv is not None and key is not None and key == self._cf_key:
            return conv  # type: ignore[no-any-return]
        w, b = fold(self._cf_branches)
        dt, dev = first.weight.dtype, first.weight.device
        if conv is None or conv.weight.dtype != dt or conv.weight.device != dev:
            k = w.shape[-1]
            plain = torch.nn.Conv2d(first.in_channels, first.out_channels, k, first.stride, k // 2,
                                    groups=first.groups, bias=True, device=dev, dtype=dt).requires_grad_(False)
            conv = FusedConv2d.from_conv(plain, None, False, self._cf_relu, **self._cf_options)
            self.__dict__["_cf_conv"] = conv
        conv.train(False)
        with torch.no_grad():
            conv.weight.copy_(w.to(dt))
            conv.bias.copy_(b.to(dt))  # type: ignore[union-attr]
        self.__dict__["_cf_key"] = key
        return conv
