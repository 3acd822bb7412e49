"""``compile_training_ahead(model, example)``: compile the kernels of a converted or fused model's first
training step on several threads before that step runs.

A training step compiles each layer's forward kernels as the forward reaches the layer and its dgrad
and wgrad kernels as the backward reaches them, one program after another on the caller's thread.
Here the model runs once on the example with PyTorch's convolutions in place of convforge's, batch
norms held in eval mode so that no running statistic moves (only the shapes matter), under the
caller's autocast; each convforge layer records its input's shape, compute dtype and layout. Then
the programs the step will build are predicted and compiled on a pool of threads
(``Backend.compile_ahead``), so the step finds them built:

- every layer's forward with the epilogue its training call runs (a bias; bias and ReLU for a conv -> ReLU
  node, torch/conv_relu.py; a fused block's conv, whose batch norm follows, without a bias only), dgrad (not
  of the model's own input, which needs none) and wgrad, chosen as ``convforge.grad`` and the conv op choose
  them (``dispatch.choose``, the NHWC plans first for channels-last activations);
- for a fused block whose batch norm trains on convforge's kernels (``FusedConv2d``, torch/batchnorm.py):
  the batch norm's program of its first call, and, under ``config.bn_stats``, the block's conv with the
  statistics epilogue (``FusedConv2d.stats_plan``) and the batch norm that finalizes those statistics; under
  autocast, its float32 master's filter casts (torch/filter_casts.py: a program a form, not a layer);
- for a fused block whose input a later block adds as its residual or reads too (a bottleneck's first block),
  under ``config.residual_grad``: its dgrad that adds that residual gradient (``FusedConv2d.res_dgrad_plan``,
  torch/residual_grad.py);
- every squeeze-and-excitation node's program (torch/se.py; its recording runs the original modules);
- under ``config.mlp_train``, ConvNeXt's MLP nodes' programs (torch/mlp_train.py: each ``FusedLinear`` chain's
  GEMM forward with its bias, dgrad and wgrad, and node A's layer norm forward and backward; the recording runs
  PyTorch's operations for these layers, never their inference programs).

A layer PyTorch runs (a half layer handed back) is skipped. A prediction that misses costs one compile
on the pool, never a wrong result: the step compiles what it needs by the same source, from the cache when
the prediction was right. A choice or compile that fails is left for the step itself to report.

A new process with a warm cache would pay the recording and the predictions (generating every source to
find it cached) for nothing: the programs compiled ahead are listed in the cache folder under a hash of
the model's layers, the inputs and the settings (``_manifest``), and a process that finds the list, with
every program on it still cached, does nothing here.

``prepare_on_first_call`` (prepare.py) runs it on a fused or converted model's first forward in
training mode with gradients enabled on CUDA tensors, under ``config.train_ahead``
(``CONVFORGE_TRAIN_AHEAD``, on by default: a cold first step compiles its programs on threads instead of
one after another as the step reaches them; docs/BENCHMARKS.md, "First call").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from convforge.torch.modules import Conv2d, compute_dtype, padding_quad
from convforge.torch.se import program_work as se_program_work

log = logging.getLogger("convforge")


@dataclass(frozen=True)
class LayerCall:
    """One convforge layer's input in the recorded forward: what its backward problems follow from."""

    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    stride: tuple[int, ...]
    pad: tuple[int, int, int, int]
    dilation: tuple[int, ...]
    groups: int
    dtype: torch.dtype
    channels_last: bool
    device: int
    needs_dgrad: bool
    algo: str
    precision: str | None
    max_error: float | None
    has_bias: bool = False
    block: Any = None  # (module, batch norm, residual?, ReLU?, SiLU / HardSwish) of a fused block whose batch norm
    # trains, else None
    relu_node: bool = False  # the layer trains as a conv -> ReLU node (its forward's epilogue applies the ReLU)
    # (batch norm, ReLU?, x's dtype, x's layout) of the pre-activation this conv folds, whose batch norm trains
    # on x on its own (fused.PreActivation: batchnorm.bn_act), else None
    pre: Any = None
    # the recorded input's and residual's identities (0: none), to find a block whose input a later block adds
    # (torch/residual_grad.py); not part of what the call needs
    x_id: int = dataclasses.field(default=0, compare=False)
    res_id: int = dataclasses.field(default=0, compare=False)


def compile_training_ahead(model: torch.nn.Module, *example: Any, **example_kwargs: Any) -> int:
    """Compile the programs ``model``'s training step on ``example`` will run (module docstring); how
    many were compiled here (not found in a cache). Nothing while ``config.autotune`` is on (tuning
    times candidates one at a time), nor where this model's step on inputs like these was compiled ahead
    into this cache before and every program it listed is still there (:func:`_manifest`: a new process
    with a warm cache records nothing and generates no source here)."""
    from convforge.backends import get_backend
    from convforge.config import config

    if config.autotune:
        return 0
    manifest = _manifest(model, example, example_kwargs)
    if manifest is not None and _all_cached(manifest):
        return 0
    work_by_device: dict[int, dict[str, Any]] = {}
    seen: set[Any] = set()
    blocks: dict[int, LayerCall] = {}  # fused blocks by their input's identity
    excitations: list[tuple[Any, int]] = []
    linears: list[tuple[Any, ...]] = []
    for call in record_calls(model, example, example_kwargs, excitations, linears):
        first = blocks.get(call.res_id) if call.res_id else None  # C: its residual is an earlier block's input
        if first is None and call.block is not None:
            first = blocks.get(call.x_id)  # D: its input is an earlier block's too (residual_grad.note_block)
        for w in _call_work(call, seen) + _pair_work(first, seen):
            work_by_device.setdefault(call.device, {})[w.source] = w
        if call.block is not None and call.x_id not in blocks:
            blocks[call.x_id] = call
    for layer, dev in excitations:  # squeeze-and-excitation nodes' programs (torch/se.py)
        w = se_program_work(layer, dev)
        work_by_device.setdefault(dev, {})[w.source] = w
    for noted in linears:  # ConvNeXt's MLP nodes (torch/mlp_train.py)
        for w in _linear_work(noted, seen):
            work_by_device.setdefault(noted[-1], {})[w.source] = w
    name = type(model).__name__
    compiled = 0
    for dev, work in work_by_device.items():
        be = get_backend("cuda", dev)
        compiled += be.compile_ahead(list(work.values()), f"{name}'s training kernels")
        if manifest is not None:
            _write_manifest(manifest, be, work)
    return compiled


def _call_work(call: LayerCall, seen: set[Any]) -> list[Any]:
    """The programs one recorded call adds (module docstring), each conv problem and batch norm once:
    ``seen`` holds what earlier calls gave (layers of one shape share their programs)."""
    conv = dataclasses.replace(call, block=None, pre=None)
    out: list[Any] = []
    if conv not in seen:
        seen.add(conv)
        fwd = _forward_epilogue(call)
        passes = ("fprop",) * (fwd is not None) + (("dgrad", "wgrad") if call.needs_dgrad else ("wgrad",))
        out += [w for w in (_pass_work(call, p, fwd if p == "fprop" else None) for p in passes) if w is not None]
    return out + _block_work(call, seen) + _pre_work(call, seen)


def _pre_work(call: LayerCall, seen: set[Any]) -> list[Any]:
    """The batch-norm program a pre-activation's training call builds (``batchnorm.bn_act`` on the conv's
    input: DenseNet's, a pre-activation ResNet's), once per call key; empty where there is none."""
    from convforge.config import config
    from convforge.torch import batchnorm as bn_train

    if call.pre is None or not config.train_bn:
        return []
    bn, relu, dtype, lay = call.pre
    try:
        key = bn_train.key_of(bn, call.x_shape, dtype, lay, False, relu, call.device)
        if key in seen:
            return []
        seen.add(key)
        return [bn_train.program_work(key)]
    except (ValueError, RuntimeError, KeyError) as err:
        log.debug("convforge: no pre-activation batch-norm program to compile ahead for %s (%s)", call.x_shape, err)
        return []


def _pair_work(first: LayerCall | None, seen: set[Any]) -> list[Any]:
    """The dgrad that adds a later block's residual gradient into ``first``'s (a fused block whose input
    that later block adds: torch/residual_grad.py), under ``config.residual_grad`` where its conv writes its
    batch norm's statistics (the blocks that take one); empty otherwise or when ``seen``."""
    from convforge.config import config

    if first is None or first.block is None or not config.residual_grad:
        return []
    m = first.block[0]
    key = ("res_dgrad", dataclasses.replace(first, block=None))
    if key in seen or not m.stats_conv_wanted(first.channels_last):
        return []
    seen.add(key)
    try:
        plan = m.res_dgrad_plan(first.x_shape, first.w_shape, first.dtype, first.device)
    except (ValueError, RuntimeError) as err:
        log.debug("convforge: no residual-adding dgrad to compile ahead for %s (%s)", first.x_shape, err)
        return []
    if plan is None:
        return []
    from convforge.backends.base import plan_work

    return [plan_work(plan, "cuda")]


def record_calls(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 excitations: list[tuple[Any, int]] | None = None,
                 linears: list[tuple[Any, ...]] | None = None) -> list[LayerCall]:
    """The convforge layers' inputs when ``model`` runs on ``args`` / ``kwargs`` with PyTorch's
    convolutions (cudnn.benchmark off), no gradients and every training batch norm in eval mode (all
    restored after), the random number generators forked (a dropout or stochastic depth in the recording
    draws nothing the step would have drawn); ``excitations`` gets each squeeze-and-excitation node's
    (layer, device) once; ``linears`` each MLP node's call (:func:`_linear_call`) under ``config.mlp_train``."""
    from convforge.config import config

    noted: list[tuple[Any, int]] = [] if excitations is None else excitations
    chains: list[tuple[Any, ...]] = [] if linears is None else linears

    def excite(layer: Any, x: torch.Tensor) -> None:
        if (layer, x.device.index or 0) not in noted:
            noted.append((layer, x.device.index or 0))

    def linear(layer: Any, x: torch.Tensor, res: Any) -> None:
        call = _linear_call(layer, x, res) if config.mlp_train else None
        if call is not None and call not in chains:
            chains.append(call)

    from convforge.torch.prepare import _record

    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    inputs = {id(a) for a in tensors}
    # the inputs' GPUs only: forking every visible device's generator would make a context on each (DDP)
    devices = sorted({a.device.index or 0 for a in tensors if a.is_cuda})
    calls: list[LayerCall] = []
    alive: list[Any] = []  # every recorded input and residual until the end: their ids (LayerCall) stay unique
    held = _training_batch_norms(model)
    benchmark = torch.backends.cudnn.benchmark  # PyTorch's stand-in convolutions need no algorithm search
    try:
        torch.backends.cudnn.benchmark = False
        for bn in held:
            bn.training = False
        ids = {id(bn) for bn in held}
        with torch.random.fork_rng(devices=devices):
            _record(model, args, kwargs, lambda m, rec: _visiting(m, rec, calls, inputs, ids, alive),  # jobs: never run
                    excite, linear)
    finally:
        for bn in held:
            bn.training = True
        torch.backends.cudnn.benchmark = benchmark
    return calls


def _visiting(m: Conv2d, inner: Any, calls: list[LayerCall], inputs: set[int], held: set[int],
              alive: list[Any]) -> Any:
    """``inner`` (the layer's recorded forward), noting the layer's input first; ``held``: the ids of
    the batch norms that train (held in eval mode while recording); ``alive`` keeps each noted input and
    residual, so no later tensor of the recording takes its id (which pairs blocks: compile_training_ahead)."""
    def forward(x: torch.Tensor, *rest: Any) -> torch.Tensor:
        call = _layer_call(m, x, id(x) not in inputs, rest[0] if rest else None, held)
        if call is not None:
            calls.append(call)
            alive.append((x, rest[0] if rest else None))
        return inner(x, *rest)  # type: ignore[no-any-return]

    return forward


def _layer_call(m: Conv2d, x: torch.Tensor, needs_dgrad: bool, res: Any = None,
                held: frozenset[int] | set[int] = frozenset()) -> LayerCall | None:
    """The layer's input as its training step would see it, or None where convforge does not run it."""
    w = m.weight
    dt = compute_dtype(x, w)
    if dt is None or not x.is_cuda or x.dim() != 4 or not w.is_cuda or m.padding_mode != "zeros":
        return None
    from convforge.config import config
    from convforge.torch.ops import channels_last

    bn = getattr(m, "_cf_bn", None)
    relu = bool(getattr(m, "_cf_relu", False))
    block = (m, bn, res is not None, relu, str(getattr(m, "_cf_act", ""))) if id(bn) in held else None
    pre = _pre_of(m, x, held)
    node = (relu and bn is None and res is None and not getattr(m, "_cf_residual", False) and config.train_bn
            and w.requires_grad)  # FusedConv2d._conv_relu's conditions (torch/conv_relu.py)
    return LayerCall(tuple(x.shape), tuple(w.shape), tuple(m.stride), padding_quad(m), tuple(m.dilation), m.groups,
                     dt, channels_last(x), x.device.index or 0, needs_dgrad, m.algo, m.precision, m.max_error,
                     m.bias is not None, block, node, pre, id(x), id(res) if isinstance(res, torch.Tensor) else 0)


def _pre_of(m: Conv2d, x: torch.Tensor, held: frozenset[int] | set[int]) -> tuple[Any, ...] | None:
    """``LayerCall.pre`` of a conv whose pre-activation's batch norm trains (held in eval mode by the
    recording) and would run on our kernels on ``x`` (batchnorm.takes' checks of the module and of x)."""
    from convforge.torch import batchnorm as bn_train

    pre = getattr(m, "_cf_pre", None)
    bn: Any = getattr(pre, "bn", None)
    if pre is None or id(bn) not in held or type(bn) is not torch.nn.BatchNorm2d or bn.momentum is None:
        return None
    lay = bn_train.layout(x)
    if lay is None or x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or x.shape[1] != bn.num_features:
        return None
    return bn, bool(pre.relu), x.dtype, lay


def _linear_call(m: Any, x: torch.Tensor, res: Any) -> tuple[Any, ...] | None:
    """A ``FusedLinear`` call an MLP node takes in training (torch/mlp_train.py ``node_of``), as (node, x's
    shape and dtype, the half dtype, in and out features, the layer norm's eps and parameter dtype, device);
    None where PyTorch's operations run it. Autocast's state is the step's: the recording runs under it."""
    from convforge.torch import mlp_train

    took = mlp_train.node_of(m, x, res)
    if took is None:
        return None
    node, dt = took
    norm = m._cf_norm if node == "A" else None
    eps = None if norm is None else float(norm.eps)
    wdt = None if norm is None or norm.weight is None else norm.weight.dtype
    return node, tuple(x.shape), x.dtype, dt, m.in_features, m.out_features, eps, wdt, x.device.index or 0


def _linear_work(noted: tuple[Any, ...], seen: set[Any]) -> list[Any]:
    """The programs one MLP node call builds (:func:`_linear_call`): its GEMM's forward with the bias, dgrad and
    wgrad as the 1x1 conv on the channels-last view (mlp_train ``_gemm``, ``_linear_grads``) and node A's layer
    norm forward with statistics and backward; what ``seen`` holds already left out."""
    from convforge.torch import layernorm

    node, shape, xdt, dt, cin, cout, eps, wdt, dev = noted
    n, h, w, _ = shape
    gemm = LayerCall((n, cin, h, w), (cout, cin, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 1, dt, True, dev, True, "auto",
                     None, None, has_bias=True)
    out = _call_work(gemm, seen)
    key = ("layernorm", n * h * w, cin, eps, xdt, dt, wdt, dev)
    if node == "A" and key not in seen:
        seen.add(key)
        try:
            out += layernorm.train_works(n * h * w, cin, eps, xdt, dt, wdt, dev)
        except (ValueError, RuntimeError) as err:
            log.debug("convforge: no layer-norm programs to compile ahead for %s (%s)", shape, err)
    return out


def _block_work(call: LayerCall, seen: set[Any]) -> list[Any]:
    """The programs a fused block's first training call builds besides its conv's (module docstring):
    its batch norm's, under ``config.bn_stats`` the statistics conv and the batch norm finishing it, and an
    autocast block's filter casts (torch/filter_casts.py);
    empty where the block's batch norm is PyTorch's, nothing applies or ``seen`` has them already."""
    from convforge.config import config
    from convforge.spec import ConvSpec
    from convforge.torch import batchnorm as bn_train

    if call.block is None or call.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return []
    m, bn, residual, relu, act = call.block
    if not (config.train_bn and type(bn) is torch.nn.BatchNorm2d and bn.momentum is not None):
        return []
    from convforge.torch import filter_casts

    casts = filter_casts.casts_of(m.weight, call.dtype)  # an autocast block's float32 master: its casts' form
    cast_work = [] if casts is None or ("wcast", casts.form()) in seen else [filter_casts.program_work(casts)]
    if casts is not None:
        seen.add(("wcast", casts.form()))
    try:
        y = ConvSpec.from_shapes(call.x_shape, call.w_shape, call.stride, call.pad, call.dilation, call.groups,
                                 str(call.dtype).replace("torch.", "")).y_shape
        key = bn_train.key_of(bn, tuple(y), call.dtype, "nhwc" if call.channels_last else "nchw", residual, relu,
                              call.device, act)
        work = [] if key in seen else [bn_train.program_work(key)]
        seen.add(key)
        stats = ("stats", dataclasses.replace(call, block=None, pre=None), key)
        if stats not in seen and m.stats_conv_wanted(call.channels_last):
            seen.add(stats)
            found = m.stats_plan(call.x_shape, call.w_shape, call.dtype, call.device)
            if found is not None:
                from convforge.backends.base import plan_work

                plan, parts, _ = found
                work += [plan_work(bn_train.partials_in_res(plan), "cuda"), bn_train.program_work(key, parts)]
        return work + cast_work
    except (ValueError, RuntimeError, KeyError) as err:
        log.debug("convforge: no batch-norm programs to compile ahead for %s (%s)", call.x_shape, err)
        return []


def _manifest(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Path | None:
    """Where this cache keeps the list of programs compiled ahead for ``model``'s step on inputs like
    ``args`` / ``kwargs`` (their shapes, dtypes, strides and devices; the layers' and batch norms'
    settings; autocast's dtype; the settings that change a choice; the tuning database's state), or None
    without a disk cache. A list that outlives its programs (a cleared folder, a new database) only
    costs the compile ahead: :func:`_all_cached` checks every program is still there."""
    from convforge.config import config
    from convforge.version import __version__

    if not config.disk_cache:
        return None
    try:
        st = config.tuning_db.stat()
        db_state: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
    except OSError:  # no database yet
        db_state = None
    tensors = [(tuple(a.shape), str(a.dtype), tuple(a.stride()), str(a.device))
               for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    autocast = _autocast()
    layers = [(name, type(m).__name__, *_settings(m)) for name, m in model.named_modules() if _settings(m)]
    what = repr((__version__, tensors, autocast, layers, sorted(kwargs), config.precision, config.max_error,
                 config.bn_stats, config.native_block, config.train_bn, config.deterministic, config.mlp_train,
                 db_state))
    return config.cache_dir / "train_ahead" / f"{hashlib.sha256(what.encode()).hexdigest()}.json"


def _autocast() -> str | None:
    """CUDA autocast's dtype where it is on, else None."""
    try:
        on = torch.is_autocast_enabled("cuda")
    except TypeError:  # torch < 2.4: CUDA's autocast only, no argument
        on = torch.is_autocast_enabled()
    if not on:
        return None
    get = getattr(torch, "get_autocast_dtype", None)
    return str(get("cuda") if get is not None else torch.get_autocast_gpu_dtype())


def _settings(m: torch.nn.Module) -> tuple[Any, ...]:
    """What of a layer decides the programs its step builds: a convforge conv's geometry, options and fused
    ops, a batch norm's settings and mode; () for anything else."""
    if isinstance(m, Conv2d):
        fused = m.fused_ops() if hasattr(m, "fused_ops") else ""
        return (tuple(m.weight.shape), str(m.weight.dtype), m.stride, m.padding, m.dilation, m.groups,
                m.bias is not None, m.padding_mode, m.algo, m.precision, m.max_error, fused)
    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
        return (type(m).__name__, m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, m.training)
    return ()


def _all_cached(manifest: Path) -> bool:
    """Whether ``manifest`` lists programs and the disk cache holds every one."""
    from convforge.backends import get_backend

    try:
        listed = json.loads(manifest.read_text())
        return bool(listed) and all(get_backend("cuda", int(dev)).disk.has(key)
                                    for dev, keys in listed.items() for key in keys)
    except (OSError, ValueError, TypeError, AttributeError):  # missing, unreadable or not ours: compile ahead
        return False


def _write_manifest(manifest: Path, be: Any, work: dict[str, Any]) -> None:
    """List the programs of ``work`` the disk cache now holds under this device (atomically: a crash or a
    second process leaves the old list or the new one); a failure to write only costs the next process the
    compile ahead."""
    from convforge.files import write_atomic

    try:
        listed = json.loads(manifest.read_text()) if manifest.is_file() else {}
    except (OSError, ValueError):
        listed = {}
    keys = [k for k in (be.program_key(src) for src in work) if be.disk.has(k)]
    if not keys:
        return
    listed[str(be.device_id)] = keys
    try:
        write_atomic(manifest, json.dumps(listed))
    except OSError as err:
        log.debug("convforge: could not write %s (%s)", manifest, err)


def _forward_epilogue(call: LayerCall) -> Any:
    """The epilogue of ``call``'s forward program in its training step, or None where it is not predicted
    (a fused block's conv with a bias: the block's own path decides)."""
    from convforge.plan import Epilogue

    if call.block is not None:
        return None if call.has_bias else Epilogue()
    return Epilogue(call.has_bias, call.relu_node)


def _pass_work(call: LayerCall, conv_pass: str, epilogue: Any = None) -> Any:
    """The program ``convforge.grad`` (or, for the forward, the conv op or the conv -> ReLU node) would
    build for ``call``'s ``conv_pass`` with ``epilogue`` (None: none), as its ``Work``; None where PyTorch
    runs that pass or nothing applies."""
    from convforge import dispatch
    from convforge.backends import get_backend
    from convforge.backends.base import plan_work
    from convforge.frontends.checks import check_options
    from convforge.plan import Epilogue
    from convforge.spec import ConvSpec
    from convforge.torch.ops import _slow_call

    if call.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    if call.dtype != torch.float32 and _slow_call(conv_pass, call.x_shape, call.w_shape, call.stride, call.pad,
                                                  call.dilation, call.groups, call.dtype, call.channels_last,
                                                  call.device, call.algo, call.precision, call.max_error):
        return None
    try:
        spec = ConvSpec.from_shapes(call.x_shape, call.w_shape, call.stride, call.pad, call.dilation, call.groups,
                                    str(call.dtype).replace("torch.", ""), conv_pass)
        _, limit = check_options(False, None, call.precision, call.max_error)
    except ValueError:
        return None
    be = get_backend("cuda", call.device)
    layouts = ("nhwc", "nchw") if call.channels_last else ("nchw",)
    for layout in layouts:
        s = dataclasses.replace(spec, layout=layout)
        try:
            epi = epilogue if epilogue is not None else Epilogue()
            ch = dispatch.choose(s, be, epi, algo=call.algo, precision=call.precision,
                                 max_error=call.max_error, workspace_limit=limit)
            return plan_work(ch.variant.plan_for(s, ch.params, be.device, epi), be.name)
        except ValueError as err:
            log.debug("convforge: no %s program to compile ahead for %s (%s)", conv_pass, s.short(), err)
    return None


def _training_batch_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every batch norm in training mode that ``model`` runs (its own, or one a fused layer references)."""
    bn_type = torch.nn.modules.batchnorm._BatchNorm
    found: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        pre = getattr(m, "_cf_pre", None)
        for bn in (m, getattr(m, "_cf_bn", None), getattr(m, "bn", None), getattr(pre, "bn", None)):
            if isinstance(bn, bn_type) and bn.training:
                found[id(bn)] = bn
    return list(found.values())
