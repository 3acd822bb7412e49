"""The autotuner: candidates (defaults of every applicable variant, then a seeded, pruned sample of
each space) compiled in parallel, checked against the float64 reference, timed by device events
(warm-up, median of repeats); the fastest correct one is stored in the tuning database.

A candidate that fails to build, compile, launch or check scores infinity with its reason logged on
``convforge.tune``; the search goes on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import sqlite3
import statistics
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convforge.backends.base import Backend, Executable
from convforge.check import expected, from_layout, in_layout, pass_inputs, stored_shape
from convforge.config import FP32_SLACK, PRECISIONS, config, precision_key
from convforge.dtypes import to_storage
from convforge.params import Params
from convforge.plan import Epilogue, Plan, Variant
from convforge.reference import rel_l2
from convforge.spec import ConvSpec
from convforge.tune.db import KEY_FIELDS, Entry, Measurement, TuningDB, now
from convforge.tune.heuristic import NO_EPILOGUE, applicable, epilogue_key, prune_reason
from convforge.version import __version__

log = logging.getLogger("convforge.tune")

INF = float("inf")
FOCUS = 2.0  # after the defaults, only variants whose default ran within FOCUS x the best are sampled
REF_FLOP_LIMIT = 4e8  # reference on at most this many FLOPs; later images are compared with a verified output


def _focus(done: Sequence[Candidate]) -> set[str]:
    """Variants whose timed defaults came within FOCUS x the fastest (all of them if none ran)."""
    ok = [c for c in done if c.status == "ok"]
    if not ok:
        return {c.variant.name for c in done}
    best = min(c.time_ms for c in ok)
    keep = {c.variant.name for c in ok if c.time_ms <= FOCUS * best}
    log.info("sampling only %s (defaults within %gx of the best)", ", ".join(sorted(keep)), FOCUS)
    return keep


class TuneError(RuntimeError):
    """No candidate produced a correct result."""


@dataclass(frozen=True)
class Budget:
    """Tuning effort per layer: seconds, candidates, or both (whichever runs out first)."""

    seconds: float | None = 10.0
    candidates: int | None = 24

    @classmethod
    def parse(cls, text: str, name: str = "budget") -> Budget:
        """``"30s"``, ``"2m"`` (seconds), ``"20"`` (candidates), or both: ``"30s,20"``; each at most
        once and > 0. ``name`` (e.g. ``--budget``) starts every error message."""
        seconds: float | None = None
        candidates: int | None = None
        for part in filter(None, text.replace(" ", "").lower().split(",")):
            if part[-1] in "sm" and part[:-1].replace(".", "", 1).isdigit():
                kind, value = "seconds", float(part[:-1]) * (60 if part[-1] == "m" else 1)
            elif part.isdigit():
                kind, value = "candidates", int(part)
            else:
                raise ValueError(f"{name} ({part!r}) must be seconds ('30s', '2m') "
                                 "or a candidate count ('20')")
            if value <= 0:
                raise ValueError(f"{name} ({part!r}) must be > 0")
            if (seconds if kind == "seconds" else candidates) is not None:
                what = "a time" if kind == "seconds" else "a candidate count"
                raise ValueError(f"{name} ({text!r}) gives {what} twice (at most one of each: '12s,24')")
            if kind == "seconds":
                seconds = value
            else:
                candidates = int(value)
        if seconds is None and candidates is None:
            raise ValueError(f"{name} ({text!r}) is empty: give seconds ('30s'), a count ('20') or both ('12s,24')")
        return cls(seconds, candidates)

    def __str__(self) -> str:
        parts = ([f"{self.seconds:g}s"] if self.seconds is not None else []) + (
            [f"{self.candidates} candidates"] if self.candidates is not None else [])
        return " or ".join(parts) + " per layer"


@dataclass
class Candidate:
    """One (variant, parameters) point and what became of it."""

    variant: Variant
    params: Params
    plan: Plan | None = None
    time_ms: float = INF
    error: float | None = None
    status: str = "pending"  # "ok" or why it scored infinity
    is_default: bool = False

    def describe(self) -> str:
        return f"{self.variant.name}({self.params.short()})"

    def measurement(self) -> Measurement:
        return Measurement(self.variant.name, self.params.to_json(),
                           self.time_ms if self.status == "ok" else None, self.error, self.status)


@dataclass
class TuneResult:
    """The outcome for one layer; ``from_db`` when the database already knew it (nothing was timed)."""

    spec: ConvSpec
    epilogue: Epilogue
    entry: Entry
    variant: Variant
    params: Params
    from_db: bool
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def choice(self) -> tuple[Variant, Params]:
        return self.variant, self.params


class _Bench:
    """Inputs, buffers and the judges for one layer, shared by every candidate.

    The float64 reference judges every image it covers (the first ``n_ref``, at most
    REF_FLOP_LIMIT FLOPs); the rest of the batch is judged against the output of the most accurate
    family (an exact variant: direct or GEMM, itself checked against the reference first), never
    against whichever candidate happened to pass first.
    """

    def __init__(self, backend: Backend, spec: ConvSpec, epi: Epilogue, seed: int) -> None:
        self.backend, self.spec, self.epi = backend, spec, epi
        inputs = pass_inputs(spec, np.random.default_rng(seed), epi)
        self.out, self.shape = spec.output, spec.shape_of(spec.output)
        self.bufs: dict[str, Any] = {name: backend.upload(to_storage(in_layout(spec, name, a), spec.dtype))
                                     for name, a in inputs.items()}
        self.bufs[self.out] = backend.empty(spec.itemsize * int(np.prod(self.shape)))
        self.inputs = inputs
        per_image = max(1, spec.flops // max(spec.n, 1))
        # wgrad reduces over the batch: only the whole batch has a reference answer
        whole = spec.conv_pass == "wgrad"
        self.n_ref = spec.n if whole else max(1, min(spec.n, int(REF_FLOP_LIMIT // per_image)))
        self.ref = expected(spec, inputs, epi, self.n_ref)
        self._rest: np.ndarray | None = None  # the verifier's output for images n_ref..n-1
        self.verifier = ""  # which variant produced it

    def _judged(self, out: np.ndarray) -> np.ndarray:
        """The part of an output the reference answers: the first n_ref images (all of wgrad's)."""
        return out if self.spec.conv_pass == "wgrad" else out[: self.n_ref]

    def _run(self, exe: Executable) -> np.ndarray:
        """Run once on NaN-poisoned output and workspace; the whole output on the host."""
        be, spec = self.backend, self.spec
        be.fill(self.bufs[self.out], float("nan"), spec.itemsize * int(np.prod(self.shape)), spec.dtype)
        for buf, (_, nbytes) in zip(exe.workspace().values(), exe.plan.workspace, strict=True):
            be.fill(buf, float("nan"), nbytes)
        exe(self.bufs)
        be.synchronize()
        return from_layout(spec, self.out, be.download(self.bufs[self.out], stored_shape(spec, self.out), spec.dtype))

    def rest(self) -> np.ndarray:
        """The verified output of the images past the reference's slice, made once by the first
        exact variant (most specialised first) whose own output passes the reference."""
        if self._rest is None:
            from convforge.kernels import all_variants

            dev = self.backend.device
            spec = self.spec
            exact = [v for v in all_variants() if v.exact and v.applies(spec, dev) is None]
            if not exact and spec.layout != "nchw":  # no exact kernel reads this layout: its NCHW twin
                spec = dataclasses.replace(spec, layout="nchw")
                exact = [v for v in all_variants() if v.exact and v.applies(spec, dev) is None]
            for v in sorted(exact, key=lambda v: -v.rank(spec, dev)):
                try:
                    exe = self.backend.executable(v.plan(spec, v.default(spec, dev), dev, self.epi))
                    out = self._run(exe) if spec is self.spec else self._run_twin(exe)
                except Exception as err:  # noqa: BLE001 - try the next exact variant
                    log.info("verifier %s unusable on %s: %s", v.name, self.spec.short(), err)
                    continue
                if rel_l2(self._judged(out), self.ref) <= exe.plan.tolerance and not np.isnan(out).any():
                    self._rest, self.verifier = out[self.n_ref:].astype(np.float64), v.name
                    break
            else:
                raise TuneError(f"no exact variant verifies {self.spec.short()} past image {self.n_ref}")
        return self._rest

    def _run_twin(self, exe: Executable) -> np.ndarray:
        """Run an NCHW plan of this layer on the same inputs laid out NCHW (own buffers)."""
        be, spec = self.backend, exe.plan.spec
        bufs = {name: be.upload(to_storage(a, spec.dtype)) for name, a in self.inputs.items()}
        bufs[self.out] = be.empty(spec.itemsize * int(np.prod(self.shape)))
        be.fill(bufs[self.out], float("nan"), spec.itemsize * int(np.prod(self.shape)), spec.dtype)
        exe(bufs)
        be.synchronize()
        return be.download(bufs[self.out], self.shape, spec.dtype)  # type: ignore[no-any-return]

    def check(self, exe: Executable, tolerance: float) -> tuple[float, str | None]:
        """Run once on NaN-poisoned output and workspace; (rel error, None or why it is wrong)."""
        out = self._run(exe)
        unwritten = int(np.isnan(out).sum())
        err = rel_l2(self._judged(out), self.ref)
        if self.n_ref < self.spec.n and not unwritten:
            err = max(err, rel_l2(out[self.n_ref:], self.rest()))
        if unwritten:
            return err, f"wrong: {unwritten}/{out.size} outputs never written"
        if not math.isfinite(err) or err > tolerance:
            return err, f"wrong: rel L2 error {err:.2e} > tolerance {tolerance:.0e}"
        return err, None


class Tuner:
    """Tunes layers on one back-end into an (optional) database. Usable without the CLI."""

    def __init__(self, backend: Backend, db: TuningDB | None = None, budget: Budget = Budget(),
                 seed: int = 0, repeats: int | None = None, workers: int | None = None,
                 variants: Sequence[Variant] | None = None,
                 on_candidate: Callable[[Candidate], None] | None = None,
                 precision: str | None = None, max_error: float | None = None) -> None:
        self.backend, self.db, self.budget, self.seed = backend, db, budget, seed
        self.precision = precision or config.precision
        self.max_error = max_error if max_error is not None else config.max_error
        self.repeats = repeats or (25 if backend.device.is_gpu else 5)
        self.workers = workers or min(16, os.cpu_count() or 4)
        self.variants = variants
        self.on_candidate = on_candidate
        self.timings = 0  # candidates timed by this tuner (a warm database leaves it at zero)

    # -- keys and the database ------------------------------------------------------------
    def key(self, spec: ConvSpec, epi: Epilogue, precision: str | None = None) -> tuple[str, ...]:
        """The database key (``KEY_FIELDS`` order); the precision field is ``precision`` (a
        ``precision_key`` value) or this tuner's class / max_error."""
        dev = self.backend.device
        prec = precision or precision_key(self.precision, self.max_error)
        return (dev.key(), self.backend.name, spec.key(), spec.dtype, epilogue_key(epi), prec)

    def lookup(self, spec: ConvSpec, epi: Epilogue = NO_EPILOGUE, precision: str | None = None) -> Entry | None:
        return self.db.get(*self.key(spec, epi, precision)) if self.db is not None else None

    def _known(self, entry: Entry) -> Variant | None:
        pool = self.variants
        if pool is None:
            from convforge.kernels import all_variants

            pool = all_variants()
        return next((v for v in pool if v.name == entry.variant), None)

    # -- the search -----------------------------------------------------------------------
    def tune(self, spec: ConvSpec, epilogue: Epilogue = NO_EPILOGUE, workspace_limit: int | None = None,
             force: bool = False) -> TuneResult:
        """Best correct (variant, params) for ``spec``: from the database, or measured and stored."""
        entry = None if force else self.lookup(spec, epilogue)
        if entry is not None:
            variant = self._known(entry)
            if variant is not None and (workspace_limit is None or entry.workspace <= workspace_limit):
                return TuneResult(spec, epilogue, entry, variant, Params.from_json(entry.params), True)
        start = time.perf_counter()
        cands = self.search(spec, epilogue, workspace_limit)
        ok = [c for c in cands if c.status == "ok"]
        if not ok:
            reasons = "; ".join(f"{c.describe()}: {c.status}" for c in cands) or "no candidates"
            raise TuneError(f"no correct candidate for {spec.short()}: {reasons}")
        best = self.select(spec, ok)
        heur = cands[0] if cands[0].is_default else None
        least = min((c.error for c in ok if c.error is not None), default=None)
        entry = self._entry(spec, epilogue, best, heur, len(cands), time.perf_counter() - start, least)
        if self.db is not None:
            try:
                self.db.put(entry)
                self.db.add_measurements(entry.key, [c.measurement() for c in cands])
            except sqlite3.Error as err:  # a full disk or a file broken under us: keep the answer
                log.warning("could not store the tuning result in %s: %s", self.db.path, err)
        return TuneResult(spec, epilogue, entry, best.variant, best.params, False, cands)

    def bound(self, ok: Sequence[Candidate], dtype: str = "float32") -> float:
        """The largest measured error admitted on this layer: ``max_error`` when set; 1e-3 for
        'relaxed'; for 'fp32' 5e-6, or FP32_SLACK x the most accurate candidate's error where
        even that exceeds 5e-6 (very long reductions). Half storage (``dtype``) rounds every
        output: there each class also admits FP32_SLACK x the most accurate candidate's error."""
        if self.max_error is not None:
            return self.max_error
        limit = PRECISIONS[self.precision]
        if self.precision == "fp32" or dtype != "float32":
            least = min((c.error for c in ok if c.error is not None), default=limit)
            limit = max(limit, FP32_SLACK * least)
        return limit

    def select(self, spec: ConvSpec, ok: Sequence[Candidate]) -> Candidate:
        """The fastest correct candidate whose measured error the precision rule admits."""
        bound = self.bound(ok, spec.dtype)
        admitted = [c for c in ok if c.error is not None and c.error <= bound]
        if not admitted:
            least = min(ok, key=lambda c: c.error if c.error is not None else INF)
            raise TuneError(f"no candidate for {spec.short()} is within max_error {bound:.1e}: the most "
                            f"accurate, {least.describe()}, measured {least.error:.2e}")
        return min(admitted, key=lambda c: c.time_ms)

    def pool(self, spec: ConvSpec) -> list[Variant]:
        """The variants worth trying in this precision class: those whose stated class it admits
        (under ``max_error``: stated error within 4 x of it; relaxed: within the bound the class
        sets on the dtype, ``kernels.relaxed_limit``), and always the exact ones."""
        from convforge.kernels import accurate_enough, all_variants

        pool = list(self.variants) if self.variants is not None else [
            v for v in all_variants() if v.capturable and not v.named_only]  # 'auto' answers record into CUDA graphs
        pool = [v for v in pool if spec.dtype in v.dtypes and spec.conv_pass in v.passes]  # what states an error
        if self.max_error is not None:
            return [v for v in pool if v.exact or v.expected_error(spec) <= 4 * self.max_error]
        if self.precision == "fp32":
            return [v for v in pool if v.exact or v.precision == "fp32"]
        return [v for v in pool if accurate_enough(v, spec, self.precision) is None]

    def _entry(self, spec: ConvSpec, epi: Epilogue, best: Candidate, heur: Candidate | None,
               n: int, seconds: float, min_error: float | None = None,
               precision: str | None = None) -> Entry:
        assert best.plan is not None
        key = dict(zip(KEY_FIELDS, self.key(spec, epi, precision), strict=True))
        return Entry(**key, version=__version__, variant=best.variant.name, params=best.params.to_json(),
                     time_ms=best.time_ms, workspace=best.plan.workspace_bytes, error=best.error or 0.0,
                     date=now(), spec_json=json.dumps(spec.to_dict(), sort_keys=True),
                     heuristic_variant=heur.variant.name if heur else "",
                     heuristic_params=heur.params.to_json() if heur else "{}",
                     heuristic_ms=heur.time_ms if heur and heur.status == "ok" else None,
                     candidates=n, seconds=round(seconds, 3), min_error=min_error)

    def search(self, spec: ConvSpec, epi: Epilogue = NO_EPILOGUE,
               workspace_limit: int | None = None) -> list[Candidate]:
        """Compile ahead in a thread pool, check and time in order, within the budget. Space
        points (a random sample, after the variant's ``space_lead`` first points in order) wait
        until every default is timed; then only variants whose default came within
        FOCUS x the best default are sampled (a direct kernel 5x behind Winograd gets no more)."""
        focus: list[set[str] | None] = [None]
        gen = self.generate(spec, epi, workspace_limit, lambda: focus[0])
        limit = self.budget.candidates if self.budget.candidates is not None else 10**9
        deadline = time.perf_counter() + (self.budget.seconds if self.budget.seconds is not None else 1e9)
        done: list[Candidate] = []
        bench: _Bench | None = None
        held: Candidate | None = None
        with self._pool() as pool:
            queue: deque[tuple[Candidate, Future[None]]] = deque()
            issued = 0
            while True:
                while len(queue) < 2 * self.workers and issued < limit:
                    cand, held = held or next(gen, None), None
                    if cand is None:
                        limit = issued
                        break
                    if not cand.is_default and focus[0] is None:
                        if any(c.is_default for c, _ in queue):
                            held = cand  # until the defaults are timed
                            break
                        focus[0] = keep = _focus(done)
                        if cand.variant.name not in keep:
                            continue
                    queue.append((cand, pool.submit(self._compile, cand)))
                    issued += 1
                if not queue:
                    break
                cand, fut = queue.popleft()
                if time.perf_counter() > deadline and not cand.is_default and done:
                    for _, f in queue:
                        f.cancel()
                    break
                fut.result()
                self._retry_here(cand)
                if cand.status == "compiled":
                    bench = bench or _Bench(self.backend, spec, epi, self.seed)
                    self._measure(cand, bench, done)
                done.append(cand)
                if self.on_candidate is not None:
                    self.on_candidate(cand)
        return done

    def generate(self, spec: ConvSpec, epi: Epilogue, workspace_limit: int | None = None,
                 focus: Callable[[], set[str] | None] | None = None) -> Iterator[Candidate]:
        """Defaults of every applicable variant (the heuristic's first), then each space sampled
        round-robin in a seeded order, pruned by the cheap resource model, without repeats;
        ``focus()``, when it gives a set, names the only variants still sampled."""
        dev = self.backend.device
        ranked = applicable(spec, dev, workspace_limit, self.pool(spec))
        seen: set[tuple[str, Params]] = set()

        def make(v: Variant, prm: Params, is_default: bool) -> Candidate | None:
            if (v.name, prm) in seen:
                return None
            seen.add((v.name, prm))
            if workspace_limit is not None and v.workspace_bytes(spec, prm) > workspace_limit:
                return None
            cand = Candidate(v, prm, is_default=is_default)
            try:
                cand.plan = v.plan(spec, prm, dev, epi)
            except Exception as err:  # noqa: BLE001 - a generator bug scores infinity, not a crash
                return _failed(cand, f"plan failed: {type(err).__name__}: {err}")
            why = prune_reason(cand.plan, dev, v)
            if why is not None and not is_default:
                log.debug("pruned %s: %s", cand.describe(), why)
                return None
            return cand

        for v in ranked:
            try:
                default = v.default(spec, dev)
            except Exception as err:  # noqa: BLE001 - a variant's bug costs its candidates only
                log.warning("%s has no default for %s: %s", v.name, spec.short(), err)
                continue
            cand = make(v, default, True)
            if cand is not None:
                yield cand
        rng = random.Random(self.seed ^ zlib.crc32(spec.key().encode()))
        spaces = []
        for v in ranked:
            try:
                pts = list(v.space(spec, dev))
            except Exception as err:  # noqa: BLE001
                log.warning("%s has no space for %s: %s", v.name, spec.short(), err)
                continue
            lead, rest = pts[:v.space_lead], pts[v.space_lead:]
            rng.shuffle(rest)
            spaces.append((v, iter(lead + rest)))
        while spaces:
            for item in list(spaces):
                keep = focus() if focus is not None else None
                prm = next(item[1], None) if keep is None or item[0].name in keep else None
                if prm is None:
                    spaces.remove(item)
                    continue
                cand = make(item[0], prm, False)
                if cand is not None:
                    yield cand

    def measure_many(self, spec: ConvSpec, epi: Epilogue,
                     points: Sequence[tuple[Variant, Params]]) -> list[Candidate]:
        """Compile (in parallel), check and time the given points on one layer, outside any budget."""
        dev = self.backend.device
        cands = []
        for v, prm in points:
            cand = Candidate(v, prm)
            why = v.applies(spec, dev)
            if why is not None:
                _failed(cand, f"does not apply: {why}")
            else:
                try:
                    cand.plan = v.plan(spec, prm, dev, epi)
                except Exception as err:  # noqa: BLE001
                    _failed(cand, f"plan failed: {type(err).__name__}: {err}")
            cands.append(cand)
        with self._pool() as pool:
            list(pool.map(self._compile, cands))
        for cand in cands:
            self._retry_here(cand)
        bench: _Bench | None = None
        for cand in cands:
            if cand.status == "compiled":
                bench = bench or _Bench(self.backend, spec, epi, self.seed)
                self._measure(cand, bench, [])
        return cands

    # -- compiling and measuring ----------------------------------------------------------
    def _pool(self) -> ThreadPoolExecutor:
        """Compile threads; each first makes a device call so that (on CUDA) the device's context
        is current in the thread before a module is loaded there."""

        def init() -> None:
            try:
                self.backend.synchronize()
            except Exception as err:  # noqa: BLE001 - the main-thread retry covers it
                log.debug("compile thread could not touch the device: %s", err)

        return ThreadPoolExecutor(self.workers, thread_name_prefix="convforge-compile", initializer=init)

    def _retry_here(self, cand: Candidate) -> None:
        """A compile that failed in a worker is tried once more on this thread before it scores
        infinity (a driver that wants modules loaded on the thread owning the context)."""
        if cand.plan is None or not cand.status.startswith("compile failed"):
            return
        try:
            self.backend.program(cand.plan.source(self.backend.name))
        except Exception:  # noqa: BLE001 - really broken: keep the worker's reason
            return
        log.warning("%s compiled only on the main thread; compile threads do not work here",
                    cand.describe())
        cand.status, cand.time_ms = "compiled", INF

    def _compile(self, cand: Candidate) -> None:
        """Runs in a worker thread: the compilers release the GIL."""
        if cand.plan is None or cand.status != "pending":
            return
        try:
            self.backend.program(cand.plan.source(self.backend.name))
            cand.status = "compiled"
        except Exception as err:  # noqa: BLE001 - CompileError or a resource error: score infinity
            _failed(cand, f"compile failed: {_first_lines(err)}")

    def _measure(self, cand: Candidate, bench: _Bench, done: list[Candidate]) -> None:
        assert cand.plan is not None
        try:
            exe = self.backend.executable(cand.plan)
            cand.error, wrong = bench.check(exe, cand.plan.tolerance)
        except Exception as err:  # noqa: BLE001 - launch failures (resources) score infinity
            _failed(cand, f"launch failed: {_first_lines(err)}")
            return
        if wrong is not None:
            log.warning("%s on %s is %s", cand.describe(), bench.spec.short(), wrong)
            _failed(cand, wrong)
            return
        best = min((c.time_ms for c in done if c.status == "ok"), default=INF)
        run = lambda: exe.call(bench.bufs)  # noqa: E731  (the path conv2d takes)
        try:
            run()  # warm-up (the check run was the first)
            self.backend.synchronize()
            first = self.backend.time_ms(run, 1)[0]
            self.timings += 1
            if first > 3 * best:  # clearly slower: one timing is enough to lose
                times = [first]
            else:
                reps = max(3, min(self.repeats, int(200.0 / max(first, 1e-3))))
                times = self.backend.time_ms(run, reps)
        except Exception as err:  # noqa: BLE001
            _failed(cand, f"timing failed: {_first_lines(err)}")
            return
        cand.time_ms = float(statistics.median(times))
        cand.status = "ok"
        log.debug("%s: %.4f ms (err %.1e)", cand.describe(), cand.time_ms, cand.error)


def _failed(cand: Candidate, why: str) -> Candidate:
    cand.status, cand.time_ms = why, INF
    log.info("candidate %s scores infinity: %s", cand.describe(), why)
    return cand


def _first_lines(err: BaseException, n: int = 6) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " | ".join(lines[:n])
