"""Plans, devices and the Variant interface.

A Plan is everything needed to run one convolution: generated kernels, the launches in order,
and the workspace. Checking, timing, tuning, benchmarking and graphs work on Plans only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from convforge.codegen.dialect import FLOAT32, Dim3, Kernel, Storage
from convforge.codegen.render import render
from convforge.dtypes import dtype_tolerance
from convforge.params import Params
from convforge.spec import ConvSpec

ArgRef = str | int | float  # a buffer name ("x", "w", "y", "bias", a workspace) or a scalar


INT32_MAX = 2**31 - 1  # the largest element offset of 32-bit index arithmetic
INT64_MAX = 2**63 - 1


def _count(shape: tuple[int, ...]) -> int:
    total = 1
    for s in shape:
        total *= s
    return total


def index_refusal(arrays: dict[str, int], limit: int = INT32_MAX) -> str | None:
    """The reason 32-bit offsets cannot address the largest of ``arrays`` (name -> elements), or None."""
    name, count = max(arrays.items(), key=lambda kv: kv[1])
    if count <= limit:
        return None
    return (f"needs 64-bit indexing: the {name} has {count} elements, more than the 2^31 - 1 = {INT32_MAX} "
            "its 32-bit offsets address")


@dataclass(frozen=True)
class Launch:
    """One kernel launch: grid in blocks, block in threads, arguments by kernel order."""

    kernel: str
    grid: Dim3
    block: Dim3
    args: tuple[ArgRef, ...]


@dataclass(frozen=True)
class Fill:
    """Set a buffer to a float value (used before accumulating kernels)."""

    buffer: str
    value: float = 0.0


@dataclass(frozen=True)
class Gemm:
    """A library SGEMM (cuBLAS on CUDA): row-major C[i] = A[i] (m x k) . B[i] (k x n), i < batch.

    Operands are named buffers; leading dimensions and batch strides count elements (a stride
    of 0 reuses one matrix for every batch entry). Back-ends without a library GEMM refuse it.
    """

    a: str
    b: str
    c: str
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    batch: int = 1
    stride_a: int = 0
    stride_b: int = 0
    stride_c: int = 0


Step = Launch | Fill | Gemm


# The epilogue's activations: field name -> the dialect token that applies it (codegen/dialect.py).
ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "silu": "SILU", "hardswish": "HSWISH", "mish": "MISH"}
_ACT_NAMES = {"relu": "ReLU", "gelu": "GELU", "silu": "SiLU", "hardswish": "HardSwish", "mish": "Mish"}


@dataclass(frozen=True)
class Epilogue:
    """Work folded into the output write: per-channel bias, a residual tensor shaped like the
    output (``res``, added before the activation: a network's skip connection) and one activation:
    ReLU, GELU (the exact, erf form: ``nn.GELU()``'s default; a transformer-style MLP's first
    linear layer, ConvNeXt's), SiLU (x * sigmoid(x): EfficientNet's, YOLO's), HardSwish
    (x * relu6(x + 3) / 6: MobileNet-v3's) or Mish (x * tanh(softplus(x)): CSP backbones')."""

    bias: bool = False
    relu: bool = False
    residual: bool = False
    k_total: int = 0  # channels of the tensor written (0: the conv's own K): a concat written in place
    k_offset: int = 0  # the first of those channels this conv writes
    gelu: bool = False
    silu: bool = False
    hardswish: bool = False
    mish: bool = False

    def __post_init__(self) -> None:
        acts = [name for name in ACTIVATIONS if getattr(self, name)]
        if len(acts) > 1:
            raise ValueError(f"unsupported epilogue: {' and '.join(_ACT_NAMES[a] for a in acts)} together "
                             "(one activation at most)")
        if self.k_total and (self.residual or self.k_offset < 0):
            raise ValueError(f"unsupported epilogue: channel offset {self.k_offset} of {self.k_total} "
                             f"{'with a residual' if self.residual else ''}")

    def apply(self, acc: str, k: str, index: str | None = None, offset_done: bool = False,
              storage: Storage = FLOAT32) -> str:
        """Expression of the stored value given accumulator ``acc`` for channel ``k``; ``index``
        is the output element's index (read from ``res`` when the epilogue has a residual);
        ``offset_done`` says the caller's store path writes at the channel offset; ``storage``:
        how bias and res are stored (the conv's dtype)."""
        if self.k_total and not offset_done:
            raise ValueError("unsupported epilogue: this store path cannot write at a channel offset")
        expr = f"{acc} + {storage.load('bias', k)}" if self.bias else acc
        if self.residual:
            if index is None:
                raise ValueError("unsupported epilogue: this store path does not give the residual's index")
            expr = f"{expr} + {storage.load('res', index)}"
        return self.activate(expr)

    @property
    def act(self) -> str:
        """The activation's name ("relu", "gelu", "silu", "hardswish", "mish"), or "" for none."""
        return next((name for name in ACTIVATIONS if getattr(self, name)), "")

    def activate(self, expr: str) -> str:
        """``expr`` through the epilogue's activation (the dialect's NaN-keeping RELU / GELU / SILU /
        HSWISH)."""
        return f"{ACTIVATIONS[self.act]}({expr})" if self.act else expr

    def plain(self) -> Epilogue:
        """Bias and activation only: the part a database entry is tuned with (no residual, no offset)."""
        return Epilogue(bias=self.bias, relu=self.relu, gelu=self.gelu, silu=self.silu, hardswish=self.hardswish,
                        mish=self.mish)

    def tag(self) -> str:
        at = f"_at{self.k_offset}of{self.k_total}" if self.k_total else ""
        act = f"_{self.act}" if self.act else ""
        return ("_bias" if self.bias else "") + ("_res" if self.residual else "") + act + at

    @property
    def activation(self) -> str:
        """The activation's name (as :attr:`act`)."""
        return self.act


@dataclass(frozen=True)
class Prologue:
    """Work folded into the conv's input load: a pre-activation (batch norm -> ReLU -> conv, as in
    DenseNet and pre-activation ResNets). Every in-bounds input value v of channel c becomes
    ``max(pscale[c] * v + pshift[c], 0)`` (``affine``: the scale and shift, buffers "pscale" and
    "pshift" of C floats; ``relu``: the max) before the kernel's arithmetic; padding stays zero, so
    the plan computes the padded convolution of the activated tensor. Forward (fprop) only."""

    affine: bool = False
    relu: bool = False

    @property
    def active(self) -> bool:
        return self.affine or self.relu

    def apply(self, value: str, c: str) -> str:
        """Expression of the activated ``value`` (an in-bounds input of channel ``c``)."""
        expr = f"FMA({value}, pscale[{c}], pshift[{c}])" if self.affine else value
        return f"RELU({expr})" if self.relu else expr  # NaN stays NaN, as in the epilogue

    def apply4(self, dst: str, c: str) -> list[str]:
        """Statements activating the float4 ``dst`` in place (four inputs of channel ``c``)."""
        return [f"{dst}.{e} = {self.apply(f'{dst}.{e}', c)};" for e in "xyzw"] if self.active else []

    def buffers(self) -> tuple[str, ...]:
        """The buffers its kernels read: pscale and pshift when affine."""
        return ("pscale", "pshift") if self.affine else ()

    def tag(self) -> str:
        return ("_pre" + ("aff" if self.affine else "") + ("relu" if self.relu else "")) if self.active else ""


@dataclass(frozen=True)
class DeviceInfo:
    """What the variants and the tuner need to know about a device."""

    backend: str
    name: str
    driver: str = ""
    platform: str = ""
    cc: tuple[int, int] | None = None
    max_threads: int = 1024
    shared_bytes: int = 48 * 1024
    shared_optin_bytes: int = 48 * 1024
    const_bytes: int = 64 * 1024
    warp: int = 32
    units: int = 1
    l2_bytes: int = 0
    is_gpu: bool = True

    def key(self) -> str:
        cc = f"sm{self.cc[0]}{self.cc[1]}" if self.cc else self.platform
        return f"{self.backend}|{self.name}|{cc}|{self.driver}"


@dataclass(frozen=True)
class Plan:
    """Generated kernels + ordered steps + workspace for one spec, variant and parameter set."""

    variant: str
    family: str
    spec: ConvSpec
    params: Params
    kernels: tuple[Kernel, ...]
    steps: tuple[Step, ...]
    workspace: tuple[tuple[str, int], ...] = ()
    tolerance: float = 1e-5
    epilogue: Epilogue = field(default_factory=Epilogue)
    index_bits: int = 32  # width of the element offsets its kernels compute (64: a layer past 2^31 - 1)
    prologue: Prologue = field(default_factory=Prologue)

    def __post_init__(self) -> None:
        # a plan storing half precision is judged at least at its dtype's rounding (dtypes.py)
        floor = dtype_tolerance(self.spec.dtype)
        if self.tolerance < floor:
            object.__setattr__(self, "tolerance", floor)

    @property
    def workspace_bytes(self) -> int:
        return sum(b for _, b in self.workspace)

    @property
    def requires(self) -> frozenset[str]:
        out: set[str] = set()
        for k in self.kernels:
            out |= k.requires
        return frozenset(out)

    def source(self, backend: str) -> str:
        title = f"{self.variant} [{self.params.short()}] {self.spec.short()}{self.prologue.tag()}{self.epilogue.tag()}"
        return render(list(self.kernels), backend, title)

    def describe(self) -> str:
        return f"{self.variant}({self.params.short()})"


class Variant:
    """One algorithm family member. Subclasses set the class attributes and three methods.

    A variant serves the passes in ``passes``, the storage dtypes in ``dtypes`` and grouped layers
    when ``grouped``; :meth:`applies` refuses any other spec before a subclass's own test runs (every
    subclass's ``applies`` is wrapped so, whether or not it calls ``super()``)."""

    name: str = ""
    family: str = ""
    backends: frozenset[str] = frozenset({"cuda", "opencl"})
    tolerance: float = 1e-5  # the correctness check's bound (relative L2 vs float64)
    precision: str = "fp32"  # the accuracy class it states: "fp32" or "relaxed" (convforge.precision)
    exact: bool = False  # plain float32 sums of products (direct, GEMM family): the verifier's family
    capturable: bool = True  # its plans record into a CUDA graph (False: a cuBLAS step through CuPy)
    specialised: int = 0  # higher = more specialised; the heuristic prefers it when it applies
    space_lead: int = 0  # the tuner tries this many first points of space() in order, then samples
    residual_ok: bool = False  # its store paths honour Epilogue.residual (others raise, never ignore it)
    offset_ok: bool = False  # its store paths honour Epilogue.k_total/k_offset (others raise)
    passes: frozenset[str] = frozenset({"fprop"})  # which of fprop, dgrad, wgrad its plans compute
    # parameters a caller may name beyond those of the space (their allowed values), for points the
    # space leaves out on a layer: plan() then says why one cannot run rather than "unknown"
    optional_params: dict[str, frozenset[Any]] = {}
    dtypes: frozenset[str] = frozenset({"float32"})  # storage dtypes its plans read and write
    grouped: bool = False  # it plans layers of groups > 1 (the depthwise family among them)
    # reached only by its own name (algo=NAME, bench --algo NAME), never by 'auto' or its family: a
    # variant checked on the CPU (emulated, compiled) that no GPU has run yet
    named_only: bool = False
    # whether the stride-1 dgrad form of this forward (kernels/dgrad/transposed.py, dgrad_<name>) was timed on
    # a GPU: False keeps that form out of 'auto' though the forward is in it
    dgrad_timed: bool = True
    layouts: frozenset[str] = frozenset({"nchw"})  # activation layouts its kernels index (spec.LAYOUTS)
    # its plan() takes ``prologue=`` (Prologue, applied to the input load); a subclass that defines
    # its own plan() without saying so again takes none (__init_subclass__)
    prologue_ok: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("applies")
        if own is not None and not getattr(own, "_serves_checked", False):
            def applies(self: Variant, spec: ConvSpec, device: DeviceInfo, _own=own) -> str | None:
                return self.serves(spec) or _own(self, spec, device)

            applies._serves_checked = True  # type: ignore[attr-defined]
            applies.__doc__, applies.__qualname__ = own.__doc__, own.__qualname__
            cls.applies = applies  # type: ignore[method-assign]
        if "plan" in cls.__dict__ and "prologue_ok" not in cls.__dict__:
            cls.prologue_ok = False  # a new plan() says for itself whether it takes a prologue

    def serves(self, spec: ConvSpec) -> str | None:
        """None when the variant computes ``spec``'s pass, dtype, groups and layout; otherwise why not."""
        if spec.conv_pass not in self.passes:
            return f"{self.name} does not compute {spec.conv_pass} (only {', '.join(sorted(self.passes))})"
        if spec.dtype not in self.dtypes:
            return f"{self.name} does not take {spec.dtype} (only {', '.join(sorted(self.dtypes))})"
        if spec.groups > 1 and not self.grouped:
            return f"{self.name} does not take grouped layers (groups={spec.groups})"
        if spec.layout not in self.layouts:
            return f"{self.name} does not read {spec.layout.upper()} activations (only " \
                   f"{', '.join(sorted(v.upper() for v in self.layouts))})"
        return None

    # The widest element offsets its generators write: 32 (``applies`` then refuses a layer with an
    # array past max_offset(), "needs 64-bit indexing: ...") or 64 (its plans switch to 64-bit
    # offsets, Plan.index_bits, where a layer needs them).
    index_bits: int = 32

    def rank(self, spec: ConvSpec, device: DeviceInfo) -> int:
        """The heuristic's preference for this variant on ``spec`` (Boda's rule: how specialised it
        is); a variant whose measured standing depends on the layer overrides it."""
        return self.specialised

    def slow_on(self, spec: ConvSpec) -> str | None:
        """Why this variant, though it runs ``spec`` on the tensor cores, is measured far below the vendor
        library's kernels there (``dispatch.is_fast`` then counts it slow, and a half layer goes to
        PyTorch), or None."""
        return None

    # Every plan of this variant runs its product on tensor cores (dispatch.is_fast then builds none to
    # find out); False: a plan's kernels say so (Plan.requires)
    tensor_cores = False

    def dgrad_slow_on(self, spec: ConvSpec) -> str | None:
        """:meth:`slow_on` of this forward's dgrad form (dgrad_<name>) on the dgrad layer ``spec``, or None."""
        return None

    def expected_error(self, spec: ConvSpec) -> float:
        """Typical relative L2 error on ``spec`` (stated, from docs/NOTES-winograd.md's accuracy table):
        what the precision rule uses where the tuner measured nothing. Exact FP32 sums of products
        state 5e-7 (cuDNN FP32 measures 1.5-5e-7 on the suites), other fp32-class variants 1e-6."""
        if self.precision != "fp32":
            return 1e-4
        return 5e-7 if self.exact else 1e-6

    def applies(self, spec: ConvSpec, device: DeviceInfo) -> str | None:
        """None when the variant can run ``spec`` on ``device``, otherwise the reason it cannot."""
        why = self.serves(spec)
        if why:
            return why
        if device.backend not in self.backends:
            return f"{self.name} runs only on {sorted(self.backends)}"
        return self.index_refusal(spec)

    def max_offset(self) -> int:
        """The largest element offset its generated code can address."""
        return INT32_MAX if self.index_bits == 32 else INT64_MAX

    def arrays(self, spec: ConvSpec) -> dict[str, int]:
        """Elements of each array its kernels index on ``spec``: input, filter and output (a
        family's workspaces are checked by its own ``applies``)."""
        return {"input": _count(spec.x_shape), "filter": _count(spec.w_shape), "output": _count(spec.y_shape)}

    def index_refusal(self, spec: ConvSpec, extra: dict[str, int] | None = None) -> str | None:
        """"needs 64-bit indexing: ..." when an array of ``spec`` (or of ``extra``, workspaces by
        name) has more elements than :meth:`max_offset` addresses, else None."""
        return index_refusal({**self.arrays(spec), **(extra or {})}, self.max_offset())

    def space(self, spec: ConvSpec, device: DeviceInfo) -> list[Params]:
        """Every parameter set worth trying, each valid for ``spec`` and ``device``."""
        raise NotImplementedError

    def default(self, spec: ConvSpec, device: DeviceInfo) -> Params:
        """A good parameter set without tuning (first of the space by default)."""
        return self.space(spec, device)[0]

    def plan(self, spec: ConvSpec, params: Params, device: DeviceInfo,
             epilogue: Epilogue = Epilogue()) -> Plan:
        raise NotImplementedError

    def workspace_bytes(self, spec: ConvSpec, params: Params) -> int:
        return 0

    def takes_prologue(self, spec: ConvSpec, prologue: Prologue) -> str | None:
        """None when the variant's plans apply ``prologue`` to ``spec``'s input, otherwise why not."""
        if not prologue.active:
            return None
        if not self.prologue_ok:
            return f"{self.name} has no input-load prologue (pre-activation)"
        if spec.conv_pass != "fprop":
            return f"a prologue applies to the forward pass only, not {spec.conv_pass}"
        return None

    def plan_for(self, spec: ConvSpec, params: Params, device: DeviceInfo, epilogue: Epilogue = Epilogue(),
                 prologue: Prologue = Prologue()) -> Plan:
        """:meth:`plan` with ``prologue`` folded into the input load; ValueError ("unsupported
        prologue: ...") when the variant cannot take it."""
        if not prologue.active:
            return self.plan(spec, params, device, epilogue)
        why = self.takes_prologue(spec, prologue)
        if why:
            raise ValueError(f"unsupported prologue: {why}")
        return self.plan(spec, params, device, epilogue, prologue=prologue)  # type: ignore[call-arg]
