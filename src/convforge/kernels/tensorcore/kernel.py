"""The composition: one kernel = barriers + the producer role + the consumer role.

Warpgroup 0 is the producer, warpgroups 1 .. cw the consumers. With two consumer warpgroups holding
many accumulators the roles trade registers (setmaxnreg: the producer drops to 80, consumers rise to
200; tiles.PRODUCER_REGS); the kernel is compiled with a register cap at entry (``__launch_bounds__(threads, 1)``),
which setmaxnreg needs.
"""

from __future__ import annotations

from convforge.codegen.dialect import Kernel, LocalBuf
from convforge.codegen.meta import Code
from convforge.kernels.tensorcore.epilogue import Output
from convforge.kernels.tensorcore.isa import Math
from convforge.kernels.tensorcore.mainloop import Ring, emit_consumer, emit_producer
from convforge.kernels.tensorcore.operands import Operand
from convforge.kernels.tensorcore.tiles import Problem, TileConfig


def gemm_kernel(name: str, math: Math, cfg: TileConfig, prob: Problem, a: Operand, b: Operand,
                out: Output) -> Kernel:
    """D = A . B^T of ``prob`` with tile ``cfg`` in ``math``, stored through ``out``."""
    why = cfg.problems(math, prob)
    if why:
        raise ValueError(f"tensor-core tile {cfg.params().short()}: {'; '.join(why)}")
    ring = Ring(cfg, math)
    code = Code()
    code("const int tid = LOCAL_ID(0), wg = SHFL(tid >> 7, 0);  // warpgroup, uniform in the warp",
         "const unsigned sbase = (SMEM_U32(tc_smem) + 1023u) & ~1023u;  // swizzle atoms 1024-byte aligned",
         f"const unsigned bars = sbase + {ring.barrier_offset}u;")
    ring.emit_init(code)
    regs = cfg.regs()
    with code.block("if (wg == 0)"):
        if regs:
            code(f"SETMAXNREG_DEC({regs[0]});")
        emit_producer(code, ring, prob, [a, b])
    with code.block("else"):
        if regs:
            code(f"SETMAXNREG_INC({regs[1]});")
        emit_consumer(code, ring, prob, out)
    args = a.args() + b.args() + out.args() + (LocalBuf("tc_smem", cfg.shared_bytes(math)),)
    return Kernel(name, args, code.text(), (cfg.threads, 1, 1), frozenset({"wgmma", "shuffle"}),
                  min_blocks=1, comment=f"wgmma {math.name} GEMM {prob.m}x{prob.n}x{prob.kred}"
                  f"{f' x{prob.batch}' if prob.batch > 1 else ''}: {cfg.params().short()}")
