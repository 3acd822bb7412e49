"""The composition: one kernel = barriers + the producer role + the consumer role.

Warpgroup 0 is the producer, warpgroups 1 .. cw the consumers. With two consumer warpgroups holding
many accumulators the roles trade registers (setmaxnreg: the producer drops to 80, consumers rise to
200; tiles.PRODUCER_REGS); the kernel is compiled with a register cap at entry (``__launch_bounds__(threads, 1)``),
which setmaxnreg needs.
"""

from __future__ import annotations

from convforge.codegen.dialect import Arg, Kernel, LocalBuf, TensorMap
from convforge.codegen.meta import Code
from convforge.kernels.tensorcore.sm90 import epilogue, tma
from convforge.kernels.tensorcore.sm90.epilogue import Output
from convforge.kernels.tensorcore.sm90.isa import Math
from convforge.kernels.tensorcore.sm90.mainloop import Job, Ring, emit_consumer, emit_producer, job_tag
from convforge.kernels.tensorcore.sm90.operands import Operand
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig


def gemm_kernel(name: str, math: Math, cfg: TileConfig, prob: Problem, a: Operand, b: Operand,
                out: Output) -> Kernel:
    """D = A . B^T of ``prob`` with tile ``cfg`` in ``math``, stored through ``out``."""
    return jobs_kernel(name, math, cfg, [Job(prob, [a, b], out)])


def jobs_kernel(name: str, math: Math, cfg: TileConfig, jobs: list[Job]) -> Kernel:
    """Several GEMMs of one tile shape in one launch, in turn (:func:`schedule.job_heads`): the stage
    ring runs on from one job's tiles to the next, so the producer already loads the next job's
    stages while the consumers store the last tile of this one. Launch it on
    ``min(sum of tiles, units)`` blocks (persistent) or the most tiles of a job (``ps=0``). One job
    is :func:`gemm_kernel`."""
    if not jobs:
        raise ValueError(f"{name}: no GEMM to run")
    if cfg.cl > 1 and len(jobs) > 1:
        raise ValueError(f"{name}: clusters (cl={cfg.cl}) run one GEMM a kernel, not {len(jobs)}")
    for job in jobs:
        why = cfg.problems(math, job.prob)
        if why:
            raise ValueError(f"tensor-core tile {cfg.params().short()}: {'; '.join(why)}")
    ring = Ring(cfg, math)
    code = Code()
    code("const int tid = LOCAL_ID(0), wg = SHFL(tid >> 7, 0);  // warpgroup, uniform in the warp",
         "const unsigned sbase = (SMEM_U32(tc_smem) + 1023u) & ~1023u;  // swizzle atoms 1024-byte aligned",
         f"const unsigned bars = sbase + {ring.barrier_offset}u;")
    if cfg.cl > 1:
        code("const int crank = CLUSTER_RANK();  // this block's rank in its cluster (same shared layout in each)")
    ring.emit_init(code)
    regs = cfg.regs()
    with code.block("if (wg == 0)"):
        if regs:
            code(f"SETMAXNREG_DEC({regs[0]});")
        emit_producer(code, ring, jobs)
    with code.block("else"):
        if regs:
            code(f"SETMAXNREG_INC({regs[1]});")
        emit_consumer(code, ring, jobs)
    if cfg.cl > 1:  # no block leaves while its peer may still arrive on its barriers
        code("CLUSTER_SYNC();")
    args: tuple[Arg, ...] = ()
    for j, job in enumerate(jobs):
        stores = (epilogue.store_map(job.out, cfg.wm),) if cfg.es else ()
        for arg in _operand_args(cfg, math, job, job_tag(jobs, j)) + job.out.args() + stores:
            if arg.name not in {a.name for a in args}:
                args += (arg,)
    return Kernel(name, args + (LocalBuf("tc_smem", cfg.shared_bytes(math)),), code.text(), (cfg.threads, 1, 1),
                  frozenset({"wgmma", "shuffle"}), min_blocks=1, comment=_comment(math, cfg, jobs), cluster=cfg.cl)


def _operand_args(cfg: TileConfig, math: Math, job: Job, tag: str) -> tuple[Arg, ...]:
    """A, then B, each part in order: buffers (cp.async) or tensor maps over them (TMA; the launch
    names the same buffers: :func:`launch_refs`)."""
    if not cfg.tm:
        return job.ops[0].args() + job.ops[1].args()
    return tuple(arg for op in job.ops for arg in
                 tuple(tma.tensor_map(op, part, tma.box_rows(op, job.ops, cfg), tag) for part in math.parts)
                 + op.scale_args())


def launch_refs(kernel: Kernel) -> tuple[str, ...]:
    """What a Launch of ``kernel`` names, in order: each buffer argument, or a tensor map's buffer."""
    return tuple(a.source if isinstance(a, TensorMap) else a.name for a in kernel.args if not isinstance(a, LocalBuf))


def _comment(math: Math, cfg: TileConfig, jobs: list[Job]) -> str:
    """The kernel's one-line comment: its GEMM(s) and tile."""
    if len(jobs) == 1:
        p = jobs[0].prob
        batch = f" x{p.batch}" if p.batch > 1 else ""
        how = ", TMA" if cfg.tm else ""
        return f"wgmma {math.name} GEMM {p.m}x{p.n}x{p.kred}{batch}{how}: {cfg.params().short()}"
    shapes = ", ".join(f"{j.prob.m}x{j.prob.n}x{j.prob.kred}" for j in jobs)
    joined = "; each parked tile joined with the next job's, stored as pairs" if any(j.out.park for j in jobs) else ""
    return f"wgmma {math.name} GEMMs {shapes} in turn{joined}: {cfg.params().short()}"


def jobs_grid(cfg: TileConfig, probs: list[Problem], units: int) -> int:
    """Blocks of a :func:`jobs_kernel` launch: one per SM up to every tile of the sequence
    (persistent), or the most tiles of one job (``ps=0``: a block takes one tile of each job)."""
    if cfg.cl > 1:
        return cfg.grid(probs[0], units)
    total = sum(cfg.tiles(p) for p in probs)
    return min(total, max(units, 1)) if cfg.ps else max(cfg.tiles(p) for p in probs)
