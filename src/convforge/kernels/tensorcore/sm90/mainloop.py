"""One stage ring: the producer warpgroup fills stages, the consumer warpgroups multiply them.

Barriers (mbarriers in shared memory, two per stage): ``full[s]`` completes when the producer's copies
of stage s have landed (one cp.async arrival per producer thread, ``.noinc``), ``empty[s]`` when every
consumer thread is done reading it (one arrival each, after the wgmma group that read it has
finished: wgmma.wait_group). Stage s is used for iterations i = s, s + st, ... with phase (i / st) & 1;
the producer waits on ``empty`` with the opposite parity (a fresh barrier's "previous phase" counts as
complete, so the first round passes), the consumers on ``full`` with the phase itself. Counters run on
across tiles, so a persistent block's producer fills the next tile's stages while the consumers store.

Consumers: per stage one wgmma group (every k step x product x m64 block), committed, then
wait_group 1: the group before is done, its stage released. cp.async writes are generic-proxy
writes and wgmma reads through the async proxy, so each consumer thread fences the proxies
(fence.proxy.async) after acquiring a full stage. 3xTF32 with ``pi`` promotes the wgmma sums into
FP32 registers every ``pi`` stages (the tensor core's FP32 accumulation truncates; its error grows with
the reduction length, the promoted sum's with ``pi`` stages only).

With ``pp`` = 1 (ping-pong) each consumer takes whole tiles, the block's tiles in turn (``lt`` % 2):
it steps over the other's stages in the ring by arithmetic and releases only its own (``empty[s]``
expects one warpgroup). Parity waits alias when a waiter runs two ring rounds ahead of a stage, so a
consumer waits on its tile's stages only after the other has waited on all of its previous tile's
(two turn barriers, CUTLASS's ordered math warpgroups): then one stores its tile while the other
multiplies.

With ``tm`` = 1 the producer is one thread issuing bulk tensor copies (tensorcore/sm90/tma.py): the full
barriers expect 1 arrival, its ``mbarrier.arrive.expect_tx`` with the stage's bytes, and the copies
complete them; the consumers skip the proxy fence (TMA writes through the async proxy). With
clusters (``cl`` = 2) a block's stage is written by its peer's multicast too, so ``empty[s]``
collects one arrival per consumer warpgroup of every block of the cluster (thread 0 of each
arrives locally, thread r on the barrier of the block r ranks further: :meth:`Ring.release`), and
the blocks initialise and leave together (cluster barriers).
"""

from __future__ import annotations

from dataclasses import dataclass

from convforge.codegen.meta import Code
from convforge.kernels.tensorcore.sm90 import epilogue, schedule, tma
from convforge.kernels.tensorcore.sm90.cexpr import emit_all
from convforge.kernels.tensorcore.sm90.epilogue import Output, acc_name
from convforge.kernels.tensorcore.sm90.isa import Math
from convforge.kernels.tensorcore.sm90.operands import THREADS, Copy, Operand
from convforge.kernels.tensorcore.sm90.smem import StageLayout
from convforge.kernels.tensorcore.sm90.tiles import Problem, TileConfig

REGISTER_ROWS = 8  # per-row producer state kept in registers up to this many rows per thread (twice as
# many without setmaxnreg, when the producer has the launch bound's 168 registers)


@dataclass(frozen=True)
class Job:
    """One GEMM of a kernel that runs several in turn on one tile shape (strided dgrad's phases):
    its problem, operands (A, B) and destination."""

    prob: Problem
    ops: list[Operand]
    out: Output


@dataclass(frozen=True)
class Ring:
    """The stage ring's shared-memory layout: ``st`` stages from ``sbase``, the consumers' staging
    after them, then the barriers (variable ``bars``)."""

    cfg: TileConfig
    math: Math

    @property
    def stage_bytes(self) -> int:
        return self.cfg.stage(self.math).nbytes

    @property
    def staging_offset(self) -> int:
        return self.cfg.st * self.stage_bytes

    @property
    def barrier_offset(self) -> int:
        return self.staging_offset + self.cfg.cw * epilogue.staging_bytes(self.cfg.wm, bool(self.cfg.es))

    def full(self, s: str) -> str:
        return f"(bars + 8u * ({s}))"

    def empty(self, s: str) -> str:
        return f"(bars + {8 * self.cfg.st}u + 8u * ({s}))"

    def turn(self, c: str) -> str:
        """Ping-pong: consumer ``c``'s turn barrier (it may wait on its tile's stages once the other
        has waited on all of its previous tile's)."""
        return f"(bars + {16 * self.cfg.st}u + 8u * ({c}))"

    def emit_init(self, code: Code) -> None:
        with code.block("if (tid == 0)"):
            for s in range(self.cfg.st):
                code(f"MBAR_INIT({self.full(str(s))}, {1 if self.cfg.tm else THREADS});",
                     f"MBAR_INIT({self.empty(str(s))}, {self.releases});")
            if self.cfg.pp:
                code(f"MBAR_INIT({self.turn('0')}, {THREADS});", f"MBAR_INIT({self.turn('1')}, {THREADS});")
            if self.cfg.tm:
                code("MBAR_INIT_FENCE();  // the copy engine completes the full barriers")
        if self.cfg.cl > 1:
            code("CLUSTER_SYNC();  // every block's barriers initialised before a peer copies or arrives")
        else:
            code("BARRIER();  // barriers initialised before any role uses them")

    @property
    def releases(self) -> int:
        """Arrivals that free a stage: every thread of the consumers that read it (all of them, or
        with ping-pong the one whose tile it holds); with clusters, one thread of each consumer
        warpgroup of every block of the cluster (a peer's multicast writes this block's stage, so
        the stage is free only once all of them have read it)."""
        return THREADS * self.cfg.groups if self.cfg.cl == 1 else self.cfg.cw * self.cfg.cl

    def release(self, s: str) -> str:
        """A consumer thread's release of stage ``s`` (after the wgmma that read it has completed)."""
        if self.cfg.cl == 1:
            return f"MBAR_ARRIVE({self.empty(s)});"
        peers = " ".join(f"else if (ct == {r}) MBAR_ARRIVE_CLUSTER({self.empty(s)}, (crank + {r}) % {self.cfg.cl});"
                         for r in range(1, self.cfg.cl))
        return f"if (ct == 0) MBAR_ARRIVE({self.empty(s)}); {peers}"

    def advance(self, code: Code) -> None:
        code(f"if (++stage == {self.cfg.st}) {{ stage = 0; phase ^= 1u; }}")


def emit_producer(code: Code, ring: Ring, jobs: list[Job]) -> None:
    """The producer warpgroup (tid 0..127): per tile and stage, wait for the stage to be empty, issue
    every copy of every operand part, arrive on its full barrier once they land. Several jobs run in
    turn, the stage ring running on from one to the next, each job's operand state in a scope of its
    own (one job: no extra scope)."""
    heads = schedule.job_heads(ring.cfg, [j.prob for j in jobs])
    if ring.cfg.tm:
        _producer_tma(code, ring, jobs, heads)
        return
    if len(jobs) == 1:
        for op in jobs[0].ops:
            emit_all(code, op.thread_lets())
    code("int stage = 0;", "unsigned phase = 0u;")
    if len(jobs) == 1:
        _producer_tiles(code, ring, jobs[0].prob, jobs[0].ops, heads[0])
    else:
        for job, head in zip(jobs, heads, strict=True):
            with code.block(""):
                for op in job.ops:
                    emit_all(code, op.thread_lets())
                _producer_tiles(code, ring, job.prob, job.ops, head)
    code("CP_ASYNC_COMMIT();", "CP_ASYNC_WAIT(0);  // no copy outlives its thread")


def _producer_tiles(code: Code, ring: Ring, prob: Problem, ops: list[Operand], head: str) -> None:
    cfg, math = ring.cfg, ring.math
    with code.block(head):
        emit_all(code, schedule.tile_lets(cfg, math, prob))
        rows = REGISTER_ROWS if cfg.regs() else 2 * REGISTER_ROWS  # (setmaxnreg leaves the producer 80)
        keep = [op for op in ops if op.per_thread <= rows]
        for op in keep:
            emit_all(code, op.tile_lets())
        with code.block("for (int kt = kbeg; kt < kend; ++kt)"):
            code(f"MBAR_WAIT({ring.empty('stage')}, phase ^ 1u);")
            for op in ops:
                emit_all(code, op.stage_lets())
            code(f"const unsigned sst = sbase + stage * {ring.stage_bytes}u;")
            for op in ops:
                for i in range(op.per_thread):
                    if op not in keep:  # many rows: their state recomputed per stage, each row's short-lived
                        emit_all(code, op.row_lets(i))
                    _issue(code, cfg.stage(math), op, math, op.row_copies(i))
            code(f"CP_ASYNC_MBAR_ARRIVE({ring.full('stage')});")
            ring.advance(code)


def _producer_tma(code: Code, ring: Ring, jobs: list[Job], heads: list[str]) -> None:
    """The TMA producer: thread 0 alone, per tile and stage, waits for the stage to be empty, arms
    its full barrier with the stage's bytes and issues one tensor copy per operand part and atom."""
    cfg, math = ring.cfg, ring.math
    with code.block("if (tid == 0)"):
        for j, job in enumerate(jobs):
            for op in job.ops:
                code(*(f"TMA_PREFETCH({tma.map_name(op, part, job_tag(jobs, j))});" for part in math.parts))
        code("int stage = 0;", "unsigned phase = 0u;")
        for j, (job, head) in enumerate(zip(jobs, heads, strict=True)):
            with code.block(head):
                emit_all(code, schedule.tile_lets(cfg, math, job.prob))
                for op in job.ops:
                    emit_all(code, tma.tile_lets(op, tma.box_rows(op, job.ops, cfg)))
                with code.block("for (int kt = kbeg; kt < kend; ++kt)"):
                    code(f"MBAR_WAIT({ring.empty('stage')}, phase ^ 1u);",
                         f"const unsigned sst = sbase + stage * {ring.stage_bytes}u, fb = {ring.full('stage')};")
                    tma.emit_stage(code, job.ops, cfg.stage(math), math.parts, job_tag(jobs, j), cfg)
                    ring.advance(code)


def job_tag(jobs: list[Job], j: int) -> str:
    """Job j's suffix on its tensor-map parameters (none with one job)."""
    return str(j) if len(jobs) > 1 else ""


def _issue(code: Code, stage: StageLayout, op: Operand, math: Math, copies: list[Copy]) -> None:
    """The cp.async of ``copies`` into the stage at ``sst``, for every part of the operand."""
    for part in math.parts:
        off = stage.offset(op.name, part)
        for cp in copies:
            src = f"(const float*)({op.buffer(part)} + {_guarded(cp.src, cp.pred)})"
            size = f", ({cp.pred}) ? 16u : 0u" if cp.pred else ""
            code(f"CP_ASYNC16(sst + {off}u + {cp.smem}, {src}{size});")


def _guarded(src: str, pred: str) -> str:
    """The source offset, 0 (a valid address) where the copy reads nothing."""
    return f"(({pred}) ? {src} : 0)" if pred else src


def wgmma_issue(cfg: TileConfig, math: Math) -> list[tuple[int, int, int]]:
    """The wgmma of one stage in issue order, as (m64 block, byte offset of its A operand from the
    stage base plus the consumer's first row, byte offset of its B operand from the stage base):
    per k step, per product of parts, per m64 block of the consumer."""
    stage, out = cfg.stage(math), []
    for kk in range(stage.a.steps):
        for pa, pb in math.products:
            for mi in range(cfg.wm):
                out.append((mi, stage.offset("a", pa) + stage.a.block_offset(mi) + stage.a.step_offset(kk),
                            stage.offset("b", pb) + stage.b.step_offset(kk)))
    return out


def consumer_rows(cfg: TileConfig) -> int:
    """Byte offset of consumer c's first A row, per c (its rows are 64 wm c ..; with ping-pong every
    consumer reads the whole tile: 0)."""
    return 0 if cfg.pp else cfg.a_tile().block_offset(cfg.wm)


def acc_names(cfg: TileConfig, prefix: str = "d") -> list[str]:
    return [acc_name(mi, i, prefix) for mi in range(cfg.wm) for i in range(cfg.bn // 2)]


def emit_consumer(code: Code, ring: Ring, jobs: list[Job]) -> None:
    """A consumer warpgroup (c = wg - 1): per tile, zero the accumulators, multiply every stage of its
    K range, release the stages, then store through the epilogue (each job through its own Output)."""
    _consumer_state(code, ring)
    if any(job.out.park for job in jobs):
        _check_joined(ring.cfg, jobs)
        code(f"unsigned {', '.join(epilogue.park_names(ring.cfg.wm, ring.cfg.bn))};  // the parked tile")
    for job, head in zip(jobs, schedule.job_heads(ring.cfg, [j.prob for j in jobs]), strict=True):
        _consumer_tiles(code, ring, job.prob, job.out, head, job.ops)
    if ring.cfg.es:  # the block's shared memory stays until the copy engine has read the last chunk
        with code.block("if (ct == 0)"):
            code("TMA_STORE_WAIT_READ(0);")


def _consumer_state(code: Code, ring: Ring) -> None:
    cfg = ring.cfg
    acc = acc_names(cfg)
    a_high, b_high = cfg.a_tile().desc_high, cfg.b_tile().desc_high
    code("const int ct = tid & 127, c = wg - 1, wq = ct >> 5, g = (tid & 31) >> 2, t = tid & 3;",
         f"const U64 dsc = {b_high}ull | (U64)(sbase >> 4);" + ("  // MN-major operands" if cfg.mn else ""),
         *([] if a_high == b_high else
           [f"const U64 dsa = {a_high}ull | (U64)(sbase >> 4);  // A's {cfg.sa}-byte swizzle"]),
         f"const U64 da0 = {'dsc' if a_high == b_high else 'dsa'} + (U64)(c * {consumer_rows(cfg) // 16});"
         "  // this warpgroup's rows of A",
         f"float* const est = tc_smem + ((sbase - SMEM_U32(tc_smem)) >> 2) + "
         f"({ring.staging_offset} + c * {epilogue.staging_bytes(cfg.wm, bool(cfg.es))}) / 4;  // its staging",
         *([f"const unsigned esa = sbase + {ring.staging_offset}u + (unsigned)c * "
            f"{epilogue.staging_bytes(cfg.wm, True)}u;  // its staging's shared address (TMA stores)"]
           if cfg.es else []),
         f"float {', '.join(acc)};")
    for prefix in ("f", "e")[:cfg.sets - 1]:
        code(f"float {', '.join(acc_names(cfg, prefix))};")
    code("int stage = 0, pstage = 0;", "unsigned phase = 0u;")
    if cfg.pp:
        code("int lt = 0, turn = 0;  // the block's tiles so far (consumer c takes lt % 2 == c); its own")


def _consumer_tiles(code: Code, ring: Ring, prob: Problem, out: Output, head: str, ops: list[Operand]) -> None:
    cfg, math = ring.cfg, ring.math
    acc = acc_names(cfg)
    tied = ", ".join(acc)
    with code.block(head):
        emit_all(code, schedule.tile_lets(cfg, math, prob))
        if cfg.pp:
            with code.block("if ((lt++ & 1) != c)"):
                code("// the other consumer's tile: step over its stages in the ring",
                     "const int s2 = stage + (kend - kbeg);",
                     f"phase ^= (unsigned)((s2 / {cfg.st}) & 1);",
                     f"stage = s2 % {cfg.st};",
                     "continue;")
        rows = "ra0" if cfg.pp else f"(ra0 + c * {64 * cfg.wm})"
        if cfg.rs:  # the residual's loads in flight under the main loop's
            epilogue.residual_prefetch(code, out, cfg.wm, cfg.bn, rows, "rb0", "zs")
        code(*(f"{d} = 0.0f;" for prefix in ("d", "f", "e")[:cfg.sets] for d in acc_names(cfg, prefix)))
        if cfg.pp:  # consumer 0 first (a fresh barrier passes parity 1), then each after the other
            code(f"MBAR_WAIT({ring.turn('c')}, ((unsigned)turn & 1u) ^ (unsigned)(c == 0));")
        if cfg.kr:
            _restart_loop(code, ring)
        else:
            _stage_loop(code, ring, tied)
        if cfg.pp:
            code(f"MBAR_ARRIVE({ring.turn('1 - c')});  // every full wait of this tile done: the other's turn",
                 "++turn;")
        if cfg.kr:
            code(f"WGMMA_WAIT(0, {', '.join(acc_names(cfg, 'd') + acc_names(cfg, 'e'))});", ring.release("pstage"))
            _add_into_sums(code, cfg, "e")  # the tile's last k step (an odd one: stages hold an even number)
        else:
            code(f"WGMMA_WAIT(0, {tied});", ring.release("pstage"))
            if cfg.pi:
                _promote(code, cfg, tied, wait=False)
        if math.scaled:
            _unscale(code, cfg, ops, cfg.summed)
        if out.park:
            epilogue.emit_park(code, out.dtype, cfg.wm, cfg.bn, cfg.summed)
        elif out.joined:
            epilogue.emit_joined_epilogue(code, out, cfg.wm, cfg.bn, "est", "(1 + c)", rows, "rb0", "zs", cfg.summed)
        else:
            epilogue.emit_consumer_epilogue(code, out, cfg.wm, cfg.bn, "est", "(1 + c)", rows, "rb0", "zs",
                                            cfg.summed, half=bool(cfg.eh), tma="esa" if cfg.es else "",
                                            res_staged=bool(cfg.rs))


def _check_joined(cfg: TileConfig, jobs: list[Job]) -> None:
    """Jobs that park a tile come in (park, joined) pairs, every job of the kernel of one tile count,
    so that each block takes the same tile of every job in turn (``ps=0``, no clusters, one consumer
    a tile, no split): the parked registers hold the first job's tile until the second's epilogue."""
    why = []
    if cfg.ps or cfg.cl > 1 or cfg.pp or cfg.ks > 1:
        why.append(f"tile {cfg.params().short()} is not ps=0 without clusters, ping-pong or split")
    if len({cfg.tiles(job.prob) for job in jobs}) > 1:  # block b then takes tile b of every job
        why.append("the jobs' tile counts differ")
    for j, job in enumerate(jobs):
        if job.out.park and (j + 1 == len(jobs) or not jobs[j + 1].out.joined):
            why.append(f"job {j} parks a tile no next job joins")
        if job.out.joined and (j == 0 or not jobs[j - 1].out.park):
            why.append(f"job {j} joins a tile no job before it parked")
    if why:
        raise ValueError("joined column phases: " + "; ".join(why))


def _stage_loop(code: Code, ring: Ring, tied: str) -> None:
    """One wgmma group a stage into the ``d`` set; with ``pi`` its sums promoted every pi stages."""
    cfg, math = ring.cfg, ring.math
    acc = acc_names(cfg)
    with code.block("for (int kt = kbeg; kt < kend; ++kt)"):
        _acquire_stage(code, ring)
        code("WGMMA_FENCE();", f"const U64 so = (U64)(stage * {ring.stage_bytes // 16});")
        for mi, a_off, b_off in wgmma_issue(cfg, math):
            code(_wgmma("WGMMA", cfg, math, acc, mi, a_off, b_off))
        code("WGMMA_COMMIT();", f"WGMMA_WAIT(1, {tied});  // the group before is done: release its stage")
        _release_previous(code, ring)
        ring.advance(code)
        if cfg.pi:
            with code.block(f"if ((kt - kbeg) % {cfg.pi} == {cfg.pi - 1})"):
                _promote(code, cfg, tied)


def _restart_loop(code: Code, ring: Ring) -> None:
    """kr: one wgmma group a k step, its first product starting from zero (scale-d 0) in set ``d`` or
    ``e`` in turn; once the group before it is done (wait_group 1), that group's sums are added into
    the FP32 sums ``f`` (round to nearest) and, at a stage's first k step, the stage before released.
    The tensor core's truncation then spans one k step's products, never the running sum."""
    cfg, math = ring.cfg, ring.math
    steps = cfg.stage(math).a.steps
    if steps % 2:
        raise ValueError(f"kr alternates two register sets over a stage's k steps, which must be even, not {steps}")
    both = ", ".join(acc_names(cfg, "d") + acc_names(cfg, "e"))
    issue = wgmma_issue(cfg, math)
    per_step = len(issue) // steps
    with code.block("for (int kt = kbeg; kt < kend; ++kt)"):
        _acquire_stage(code, ring)
        code(f"const U64 so = (U64)(stage * {ring.stage_bytes // 16});")
        for kk in range(steps):
            cur, prev = ("d", "e") if kk % 2 == 0 else ("e", "d")
            acc = acc_names(cfg, cur)
            code("WGMMA_FENCE();")
            started = set()
            for mi, a_off, b_off in issue[kk * per_step:(kk + 1) * per_step]:
                code(_wgmma("WGMMA" if mi in started else "WGMMA_Z", cfg, math, acc, mi, a_off, b_off))
                started.add(mi)
            code("WGMMA_COMMIT();", f"WGMMA_WAIT(1, {both});  // the k step before is done")
            if kk == 0:
                _release_previous(code, ring)
            _add_into_sums(code, cfg, prev)
        ring.advance(code)


def _acquire_stage(code: Code, ring: Ring) -> None:
    """Wait until the producer's copies of the current stage have landed (and, for cp.async, make its
    generic-proxy writes visible to wgmma's async-proxy reads)."""
    code(f"MBAR_WAIT({ring.full('stage')}, phase);")
    if not ring.cfg.tm:
        code("FENCE_PROXY_ASYNC();  // the producer's cp.async (generic proxy) writes, seen by wgmma")


def _release_previous(code: Code, ring: Ring) -> None:
    """After a wait that retired the stage before's wgmma: release it (not on the tile's first stage)."""
    release = ring.release("pstage")
    code(f"if (kt > kbeg) {release}" if ring.cfg.cl == 1 else f"if (kt > kbeg) {{ {release} }}", "pstage = stage;")


def _wgmma(op: str, cfg: TileConfig, math: Math, acc: list[str], mi: int, a_off: int, b_off: int) -> str:
    """One wgmma (``op``: WGMMA adds into the m64 block's accumulators, WGMMA_Z starts them from zero) of
    the stage at ``so``: A at byte offset ``a_off`` from this consumer's rows, B at ``b_off``."""
    regs = ", ".join(acc[mi * cfg.bn // 2:(mi + 1) * cfg.bn // 2])
    if cfg.mn:  # both operands MN-major: the transposing forms
        op = {"WGMMA": "WGMMA_T", "WGMMA_Z": "WGMMA_TZ"}[op]
    return f"{op}({math.ptx}, {math.k}, {cfg.bn}, da0 + so + {a_off // 16}, dsc + so + {b_off // 16}, {regs});"


def _add_into_sums(code: Code, cfg: TileConfig, prefix: str) -> None:
    """kr: the finished k step's wgmma sums (set ``prefix``) added into the FP32 sums."""
    for d, f in zip(acc_names(cfg, prefix), acc_names(cfg, "f"), strict=True):
        code(f"{f} += {d};")


def _unscale(code: Code, cfg: TileConfig, ops: list[Operand], prefix: str) -> None:
    """Scaled operands (3xFP16): the sums times both operands' inverse scales (powers of two: exact)."""
    scales = [arg.name for op in ops for arg in op.scale_args()]
    if len(scales) != 2:
        raise ValueError(f"a scaled GEMM needs the inverse scale of both operands, got {scales}")
    code(f"const float osc = {scales[0]}[0] * {scales[1]}[0];  // 2^-(ea + eb): the operands' scales undone",
         *(f"{d} *= osc;" for d in acc_names(cfg, prefix)))


def _promote(code: Code, cfg: TileConfig, tied: str, wait: bool = True) -> None:
    """Add the wgmma sums into the FP32 registers and restart them."""
    if wait:
        code(f"WGMMA_WAIT(0, {tied});")
    for d, f in zip(acc_names(cfg), acc_names(cfg, "f"), strict=True):
        code(f"{f} += {d}; {d} = 0.0f;")
