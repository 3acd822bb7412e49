"""Tuning on several devices at once: ``convforge tune ... --devices all|0,1,...`` and ``torchrun``.

**Worker processes** (``--devices``): one ``python -m convforge.apps.tune.worker`` subprocess per device
(:mod:`convforge.apps.tune.worker`; subprocesses rather than ``multiprocessing`` so that each one's
environment is set before CUDA starts: a worker sees only its own GPU, ``CUDA_VISIBLE_DEVICES``, and
nothing in it can touch another device; its stdout carries only the JSON-lines protocol, and a
worker killed halfway through a message cannot leave a shared queue broken). The layers wait in one
queue ordered by estimated cost (FLOPs), largest first; a worker takes the next one whenever it is
idle, so the least loaded worker always gets the largest layer left (longest-processing-time first,
dynamically). Every worker writes the one tuning database (tune/db.py: WAL, busy timeouts). The
parent shows ONE progress bar over all workers (with a status line per worker), prints the workers'
log lines prefixed with their device, and builds the closing table from their replies, as a
one-process run does.

A worker that dies (killed, crashed, or stopped by a device error after a task: a sticky CUDA error
makes it exit) is reported by name with the reason, and the layer it was tuning goes back to the
queue for the others, once: a layer that was in flight on two workers that died is reported failed.
Identical layers (same spec and epilogue) are tuned once; the others are reported as found in the
database, as they would be in one process.

With OpenCL, ``--devices`` names ``PLATFORM:DEVICE`` entries and may repeat one (``--backend
opencl --devices 0:0,0:0``: two workers sharing the PoCL device; their timings disturb each other,
so this is for exercising the worker logic, as CI does). A CUDA device may not repeat.

**torchrun** (environment ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` present; one host or several,
``--nnodes N --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:PORT``): every rank joins a gloo
process group over torchrun's rendezvous (:class:`convforge.torch.distributed.RankGroup`) and takes
layers one at a time from a counter in its store, the largest left first, as a worker takes them
from the queue above (dynamic longest-processing-time across every rank of every host, with no
scheduler of ours; a rank whose device breaks stops taking layers and the others take the rest).
With one rank per GPU (``--nproc-per-node`` = GPUs) a rank tunes in-process on ``LOCAL_RANK``'s GPU
(``--devices all`` says the same); with one rank per host (``--nproc-per-node 1``) ``--devices``
names that host's devices and the rank runs a worker process on each, fed from the shared counter.
On one host (``WORLD_SIZE == LOCAL_WORLD_SIZE``) every rank writes the shared database; across
hosts rank 0 writes it and every other rank writes its own file beside it (``NAME.rankR.sqlite``);
then every rank sends its replies (and, across hosts, its database's entries) to rank 0, which
merges the entries as ``convforge db import`` does (each validated, kept only where faster:
``TuningDB.import_json`` with ``only_if_faster``) and prints the closing table. The ranks must
build the same layer list (they run the same command): its digest keys the counter, and rank 0
reports a rank that built another. Without a usable store the shares are a static
longest-processing-time split of the same cost-ordered list (:func:`split_static`).

The tuner is per-layer independent (its candidates, sample order and inputs are seeded from the
layer's key; it reads and writes only that layer's database key), so the choices are the ones a
one-process run makes given the same measurements.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from convforge.apps.tune.worker import FATAL_EXIT, Settings, Worker

DEVICES_HELP = ("tune on several devices at once, one worker process per device: 'all' or indices such as 0,1 "
                "(CUDA; OpenCL: PLATFORM:DEVICE entries, which may repeat to run several workers on one device, "
                "e.g. --backend opencl --devices 0:0,0:0). Under torchrun (one host or several) the ranks share "
                "the layers: with one rank per GPU each tunes on LOCAL_RANK's GPU ('all' or nothing here); "
                "with one rank per host (--nproc-per-node 1) these are that host's devices")
STOP_WAIT_S = 60.0


@dataclass(frozen=True)
class Slot:
    """One worker: its label (``cuda:1``), back-end, the device it opens, extra environment."""

    label: str
    backend: str
    device: str
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Task:
    """One layer to tune: ``body`` is what the worker receives (worker.py ``Worker.run``)."""

    id: int
    name: str
    cost: float
    body: dict[str, Any]
    deaths: list[str] = field(default_factory=list)  # workers that died with it in flight


@dataclass
class Outcome:
    """How a task ended: the worker's reply, or why it failed; which worker answered."""

    ok: bool
    reply: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    worker: str = ""


@dataclass(frozen=True)
class Ranks:
    """This process's place under torchrun."""

    rank: int
    world: int
    local_rank: int
    local_world: int | None

    @property
    def one_host(self) -> bool:
        return self.local_world == self.world


@dataclass(frozen=True)
class How:
    """Where tasks run: worker processes on ``slots``, this torchrun rank's share in-process
    (``ranks``), or this rank's share through worker processes on its host's ``slots`` (both)."""

    slots: tuple[Slot, ...] = ()
    ranks: Ranks | None = None

    def describe(self) -> str:
        workers = f"{len(self.slots)} worker(s): {', '.join(s.label for s in self.slots)}"
        if self.ranks is not None:
            rank = f"rank {self.ranks.rank} of {self.ranks.world} (torchrun)"
            return f"{rank}, {workers}" if self.slots else rank
        return workers


@dataclass
class Run:
    """What :func:`execute` answers: every task's outcome (None on a torchrun rank other than 0)
    and how many of this process's own tasks failed."""

    outcomes: dict[int, Outcome] | None
    own_failed: int = 0
    per_worker: dict[str, int] = field(default_factory=dict)


# -- which devices ---------------------------------------------------------------------------
def _devices_error(text: str) -> ValueError:
    return ValueError(f"--devices ({text!r}) must be 'all' or a comma-separated list of device indices such as "
                      "0,1 (OpenCL: PLATFORM:DEVICE entries such as 0:0,0:0)")


def _cuda_count() -> int:
    """CUDA devices here; ValueError saying there are none (and how to use OpenCL instead)."""
    try:
        from convforge.backends.cuda import device_count
    except Exception as err:  # noqa: BLE001 - no CuPy, or a broken install: no CUDA
        why = f"CuPy cannot be imported: {type(err).__name__}: {err}"
    else:
        n = device_count()
        if n:
            return n
        why = "CuPy sees no CUDA device"
    raise ValueError(f"--devices runs one worker per CUDA device, but this machine has none ({why}); for several "
                     "worker processes on an OpenCL device: --backend opencl --devices 0:0,0:0")


def parse_devices(text: str, backend: str, env: Mapping[str, str] | None = None) -> list[Slot]:
    """The worker slots ``--devices`` names (module docstring); ValueError naming the problem."""
    env = os.environ if env is None else env
    items = [t.strip() for t in str(text).split(",")]
    if not str(text).strip() or any(not t for t in items) or ("all" in items and len(items) > 1):
        raise _devices_error(text)
    if backend == "opencl":
        return _opencl_slots(text, items)
    if backend != "cuda":
        raise ValueError(f"backend ({backend!r}) must be 'cuda' or 'opencl'")
    if any(t != "all" and not t.isdigit() for t in items):
        raise _devices_error(text)
    count = _cuda_count()
    wanted = list(range(count)) if items == ["all"] else [int(t) for t in items]
    for i in wanted:
        if i >= count:
            raise ValueError(f"--devices: CUDA device {i} does not exist (this machine has {count}: "
                             f"0-{count - 1})")
        if wanted.count(i) > 1:
            raise ValueError(f"--devices: CUDA device {i} is given twice (two workers on one GPU would time each "
                             "other's kernels)")
    visible = [v.strip() for v in env["CUDA_VISIBLE_DEVICES"].split(",")] if env.get("CUDA_VISIBLE_DEVICES") else None
    return [Slot(f"cuda:{i}", "cuda", "0", {"CUDA_VISIBLE_DEVICES": visible[i] if visible else str(i)})
            for i in wanted]


def _opencl_slots(text: str, items: list[str]) -> list[Slot]:
    try:
        from convforge.backends.opencl import list_devices
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"--devices with --backend opencl: PyOpenCL cannot be imported ({err})") from None
    have = [f"{pi}:{di}" for pi, di, _, _ in list_devices()]
    if not have:
        raise ValueError("--devices with --backend opencl: this machine has no OpenCL device")
    wanted: list[str] = []
    for t in (have if items == ["all"] else items):
        pi, sep, di = t.partition(":")
        if not pi.isdigit() or (sep and not di.isdigit()):
            raise _devices_error(text)
        key = f"{int(pi)}:{int(di or 0)}"
        if key not in have:
            raise ValueError(f"--devices: OpenCL device {t} does not exist (devices: {', '.join(have)})")
        wanted.append(key)
    slots = []
    for i, key in enumerate(wanted):
        label = f"opencl:{key}" + (f"#{wanted[:i].count(key) + 1}" if wanted.count(key) > 1 else "")
        slots.append(Slot(label, "opencl", key))
    return slots


def torchrun_ranks(env: Mapping[str, str] | None = None) -> Ranks | None:
    """This process's ranks when torchrun started it (RANK, WORLD_SIZE, LOCAL_RANK set), else None."""
    env = os.environ if env is None else env
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    try:
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
        local_world = int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE") else None
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE, LOCAL_RANK (and LOCAL_WORLD_SIZE) must be ints, as torchrun sets "
                         "them") from None
    if not (0 <= rank < world and 0 <= local):
        raise ValueError(f"RANK ({rank}) must be in 0..WORLD_SIZE-1 ({world - 1}) and LOCAL_RANK ({local}) >= 0")
    return Ranks(rank, world, local, local_world)


def how_from_args(args: Any) -> How | None:
    """Where ``convforge tune`` runs its layers: None (one process, as always), worker processes
    (``--devices``) or this torchrun rank's share; ValueError for bad or clashing options."""
    devices = getattr(args, "devices", None)
    ranks = torchrun_ranks()
    if ranks is not None:
        how: How | None = _ranked_how(args, ranks, devices)
    elif devices is None:
        return None
    else:
        if getattr(args, "device", None) is not None:
            raise ValueError("--device and --devices cannot be combined (--devices names every device)")
        how = How(slots=tuple(parse_devices(devices, getattr(args, "backend", None) or "cuda")))
    for flag, value in (("--report", getattr(args, "report", None)),
                        ("--dispatch-overhead", getattr(args, "dispatch_overhead", False))):
        if value:
            raise ValueError(f"{flag} measures on one device: run it without --devices or torchrun (the layers "
                             "tuned there are then found in the database)")
    return how


def _ranked_how(args: Any, ranks: Ranks, devices: str | None) -> How:
    """Under torchrun: the rank tunes in-process on LOCAL_RANK's device, or, with one rank per host
    and ``--devices``, through worker processes on that host's devices (module docstring)."""
    if getattr(args, "device", None) is not None:
        if devices is not None:
            raise ValueError("--device and --devices cannot be combined (--devices names every device)")
        if (getattr(args, "backend", None) or "cuda") == "cuda":
            raise ValueError("--device does not apply under torchrun: each rank tunes on LOCAL_RANK's GPU")
    if devices is None or (ranks.local_world != 1 and str(devices).strip() == "all"):
        return How(ranks=ranks)
    if ranks.local_world != 1:
        raise ValueError(f"--devices {devices} does not apply under torchrun with several ranks per host: each rank "
                         "tunes on LOCAL_RANK's GPU (give --devices all or nothing, or start one rank per host, "
                         "--nproc-per-node 1, to run worker processes on the devices named)")
    return How(slots=tuple(parse_devices(devices, getattr(args, "backend", None) or "cuda")), ranks=ranks)


def backend_name(args: Any, how: How) -> str:
    """The back-end the workers run: the slots', or under torchrun --backend or CUDA where present."""
    if how.slots:
        return how.slots[0].backend
    if getattr(args, "backend", None):
        return str(args.backend)
    from convforge.backends import cuda_available

    return "cuda" if cuda_available() else "opencl"


def base_settings(args: Any, budget: Any, backend: str, db: Path, how: How) -> Settings:
    """The workers' shared settings from the command's arguments and the configuration."""
    from convforge.config import config

    per_host = len(how.slots) if how.slots else (how.ranks.local_world if how.ranks and how.ranks.local_world else 1)
    threads = getattr(args, "workers", None) or max(1, min(16, (os.cpu_count() or 4) // max(per_host, 1)))
    return Settings(backend=backend, device=getattr(args, "device", None), db=str(db),
                    budget=(budget.seconds, budget.candidates), seed=int(getattr(args, "seed", 0) or 0),
                    threads=threads, precision=config.precision, max_error=config.max_error,
                    force=bool(getattr(args, "force", False)), verbose=bool(getattr(args, "verbose", False)))


def split_static(tasks: list[Task], n: int) -> list[list[Task]]:
    """``n`` shares of ``tasks``: by cost, largest first (ties: task order), each to the share with
    the least cost so far (ties: the lower share). Deterministic: every rank computes the same."""
    shares: list[list[Task]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for t in sorted(tasks, key=lambda t: (-t.cost, t.id)):
        i = min(range(n), key=lambda j: (loads[j], j))
        shares[i].append(t)
        loads[i] += t.cost
    return shares


def execute(tasks: list[Task], settings: Settings, how: How, console: Any) -> Run:
    """Run ``tasks`` as ``how`` says (module docstring)."""
    if how.ranks is not None:
        return _run_torchrun(tasks, settings, how, console)
    return run_tasks(tasks, list(how.slots), settings, console)


def cost_order(tasks: list[Task]) -> list[Task]:
    """The order every rank hands layers out in: largest estimated cost first (ties: task order)."""
    return sorted(tasks, key=lambda t: (-t.cost, t.id))


def digest(tasks: list[Task]) -> str:
    """A short digest of the layer list (ids, names, costs, bodies): ranks that built the same
    list agree on it."""
    text = json.dumps([[t.id, t.name, t.cost, t.body] for t in tasks], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def claimed(order: list[Task], claim: Callable[[], int]) -> Iterator[Task]:
    """The tasks of ``order`` at the indices ``claim()`` answers, until it answers one past the end
    (the counter is shared: every index goes to one claimant)."""
    while True:
        i = claim()
        if i >= len(order):
            return
        yield order[i]


# -- worker processes --------------------------------------------------------------------------
class _Board(Progress):
    """One progress bar (the layers), then a status line per worker."""

    def __init__(self, lines: Callable[[], list[str]], *args: Any, **kwargs: Any) -> None:
        self._lines = lines  # before Progress.__init__, which renders once
        super().__init__(*args, **kwargs)

    def get_renderables(self) -> Any:
        yield from super().get_renderables()
        for line in self._lines():
            yield Text(line)


class _Proc:
    """The parent's view of one worker process."""

    def __init__(self, index: int, slot: Slot) -> None:
        self.index, self.slot = index, slot
        self.popen: subprocess.Popen[str] | None = None
        self.task: Task | None = None
        self.ready = self.stopped = False
        self.live = True
        self.fatal = ""
        self.tail: deque[str] = deque(maxlen=8)  # its last stderr lines: why it died
        self.done = 0
        self.what = "starting"
        self.readers: list[threading.Thread] = []

    def status(self) -> str:
        if not self.live:
            return f"  {self.slot.label}: {self.what}"
        state = f"{self.task.name}: {self.what}" if self.task is not None else self.what
        return f"  {self.slot.label} ({self.done} done): {state}"


def _source_root() -> str:
    """The folder holding the ``convforge`` package this process runs (the workers import the same)."""
    import convforge

    return str(Path(convforge.__file__).resolve().parent.parent)


def _reason(rc: int | None, fatal: str, tail: deque[str]) -> str:
    if rc is not None and rc < 0:
        try:
            what = f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            what = f"killed by signal {-rc}"
    elif rc == FATAL_EXIT and fatal:
        what = "stopped"
    elif rc:
        what = f"exit status {rc}"
    else:
        what = "exited"
    detail = fatal or (tail[-1] if tail else "")
    return f"{what}: {detail}" if detail else what


class _Pool:
    """The worker processes of one run, fed from one cost-ordered queue (module docstring)."""

    def __init__(self, slots: list[Slot], settings: Settings, console: Any) -> None:
        self.procs = [_Proc(i, s) for i, s in enumerate(slots)]
        self.settings, self.console = settings, console
        self.events: queue.Queue[tuple[int, str, str | None]] = queue.Queue()
        self.pending: list[tuple[float, int]] = []
        self.tasks: dict[int, Task] = {}
        self.source: Iterator[Task] | None = None  # more tasks, taken when a worker is idle (shared counter)
        self.outcomes: dict[int, Outcome] = {}
        self.bar: Any = None
        self.layers: Any = None

    # -- processes ---------------------------------------------------------------------------
    def start(self, p: _Proc) -> None:
        root = _source_root()
        env = {**os.environ, **p.slot.env}
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        p.popen = subprocess.Popen([sys.executable, "-m", "convforge.apps.tune.worker"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env,
                                   start_new_session=True)  # Ctrl-C reaches the parent, which stops them
        header = replace(self.settings, backend=p.slot.backend, device=p.slot.device, label=p.slot.label,
                         slot=p.index)
        for stream, kind in ((p.popen.stdout, "msg"), (p.popen.stderr, "log")):
            t = threading.Thread(target=self._read, args=(p.index, stream, kind), daemon=True)
            t.start()
            p.readers.append(t)
        self._send(p, header.doc())

    def _read(self, index: int, stream: IO[str] | None, kind: str) -> None:
        assert stream is not None
        for line in stream:
            line = line.rstrip("\n")
            if kind == "log" and line.strip():
                self.procs[index].tail.append(line.strip())  # read by died() after joining this thread
            self.events.put((index, kind, line))
        if kind == "msg":
            self.events.put((index, "eof", None))

    def _send(self, p: _Proc, doc: dict[str, Any]) -> bool:
        assert p.popen is not None and p.popen.stdin is not None
        try:
            p.popen.stdin.write(json.dumps(doc) + "\n")
            p.popen.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # it died: its end of stdout says so next
            return False
        return True

    def stop(self, p: _Proc) -> None:
        if p.popen is None or p.stopped:
            return
        p.stopped = True
        self._send(p, {"stop": True})
        try:
            assert p.popen.stdin is not None
            p.popen.stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def terminate(self) -> None:
        """Stop every worker still running (an interrupt or an error in the parent)."""
        for p in self.procs:
            if p.popen is not None and p.popen.poll() is None:
                p.popen.terminate()
        for p in self.procs:
            if p.popen is not None:
                try:
                    p.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()

    # -- the queue -----------------------------------------------------------------------------
    def feed(self, p: _Proc) -> None:
        """Give an idle, ready, live worker the largest pending task (taking one from the source
        when none is pending)."""
        if not (p.live and p.ready and p.task is None):
            return
        if not self.pending and self.source is not None:
            t = next(self.source, None)
            if t is None:
                self.source = None
            else:
                self.tasks[t.id] = t
                heapq.heappush(self.pending, (-t.cost, t.id))
                self.bar.update(self.layers, total=len(self.tasks))
        if not self.pending:
            return
        _, tid = heapq.heappop(self.pending)
        p.task, p.what = self.tasks[tid], "compiling"
        self._send(p, {**p.task.body, "id": tid, "name": p.task.name})

    def finish(self, t: Task, outcome: Outcome) -> None:
        self.outcomes[t.id] = outcome
        self.bar.advance(self.layers)
        if not outcome.ok:
            self.console.print(f"{t.name}: {outcome.error}", style="red", markup=False)

    def died(self, p: _Proc) -> None:
        """A worker's stdout ended: collect why, re-queue (or fail) its task, report it."""
        assert p.popen is not None
        p.live = False
        try:
            rc: int | None = p.popen.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            p.popen.kill()
            rc = p.popen.wait()
        for reader in p.readers:
            reader.join(timeout=5)
        reason = _reason(rc, p.fatal, p.tail)
        t, p.task = p.task, None
        p.what = "finished" if p.stopped and rc == 0 and t is None else f"died ({reason})"
        if t is None:
            if not (p.stopped and rc == 0):
                what = "could not start" if not p.ready else "exited"
                self.console.print(f"worker {p.slot.label} (pid {p.popen.pid}) {what}: {reason}", style="yellow",
                                   markup=False)
            return
        t.deaths.append(p.slot.label)
        if len(t.deaths) >= 2:
            self.console.print(f"worker {p.slot.label} (pid {p.popen.pid}) died ({reason}) while tuning {t.name}, "
                               f"which had killed {t.deaths[0]} too: reported failed", style="red", markup=False)
            self.finish(t, Outcome(False, error=f"failed: killed two workers ({', '.join(t.deaths)}); last: {reason}",
                                   worker=p.slot.label))
        else:
            self.console.print(f"worker {p.slot.label} (pid {p.popen.pid}) died ({reason}) while tuning {t.name}: "
                               "re-queued for the other workers", style="yellow", markup=False)
            heapq.heappush(self.pending, (-t.cost, t.id))
        for q in self.procs:
            self.feed(q)

    # -- messages ------------------------------------------------------------------------------
    def on_log(self, p: _Proc, line: str) -> None:
        if line.strip():
            self.console.print(f"[{p.slot.label}] {line}", style="dim", markup=False, highlight=False)

    def on_message(self, p: _Proc, line: str) -> None:
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            self.on_log(p, line)
            return
        if "ready" in msg:
            p.ready, p.what = True, "idle"
            dev = msg["ready"]
            self.console.print(f"worker {p.slot.label}: {dev['name']} ({dev['backend']}, {dev['driver']}), "
                               f"pid {dev['pid']}", markup=False)
            self.feed(p)
        elif "cand" in msg:
            p.what = str(msg.get("what", ""))[:70]
        elif "fatal" in msg:
            p.fatal = str(msg["fatal"])
        elif "done" in msg and p.task is not None:
            t, p.task = p.task, None
            p.done += 1
            p.what = "idle"
            reply = {k: v for k, v in msg.items() if k not in ("done", "ok", "error")}
            self.finish(t, Outcome(bool(msg.get("ok")), reply, str(msg.get("error") or ""), p.slot.label))
            self.feed(p)

    def run(self, tasks: list[Task], source: Iterator[Task] | None = None) -> dict[int, Outcome]:
        """Every task of ``tasks``, and of ``source`` while it gives more (taken one at a time, as
        workers become idle)."""
        self.tasks = {t.id: t for t in tasks}
        self.pending = [(-t.cost, t.id) for t in tasks]
        heapq.heapify(self.pending)
        self.source = source
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with _Board(lambda: [p.status() for p in self.procs], *columns, console=self.console) as bar:
            self.bar = bar
            self.layers = bar.add_task("layers", total=len(tasks))
            try:
                for p in self.procs:
                    self.start(p)
                self._loop()
            except BaseException:
                self.terminate()
                raise
            for p in self.procs:
                self.stop(p)
            for p in self.procs:
                if p.live:
                    self._await_exit(p)
        return self.outcomes

    def _loop(self) -> None:
        while self.source is not None or len(self.outcomes) < len(self.tasks):
            if not any(p.live for p in self.procs):
                for tid in sorted(set(self.tasks) - set(self.outcomes)):
                    self.finish(self.tasks[tid], Outcome(False, error="no worker left: every worker died"))
                self.source = None  # take no more: other ranks take what is left
                return
            index, kind, payload = self.events.get()
            p = self.procs[index]
            if kind == "log":
                self.on_log(p, payload or "")
            elif kind == "eof":
                self.died(p)
            else:
                self.on_message(p, payload or "")

    def _await_exit(self, p: _Proc) -> None:
        """After ``stop``: wait for the worker's end of stdout, printing what it still says."""
        while p.live:
            try:
                index, kind, payload = self.events.get(timeout=STOP_WAIT_S)
            except queue.Empty:
                assert p.popen is not None
                p.popen.kill()
                continue
            q = self.procs[index]
            if kind == "log":
                self.on_log(q, payload or "")
            elif kind == "eof":
                self.died(q)
            else:
                self.on_message(q, payload or "")


def run_tasks(tasks: list[Task], slots: list[Slot], settings: Settings, console: Any,
              source: Iterator[Task] | None = None) -> Run:
    """Every task (and those ``source`` gives: a torchrun rank's claims) through worker processes
    on ``slots`` (module docstring)."""
    pool = _Pool(slots, settings, console)
    outcomes = pool.run(tasks, source)
    per_worker = {p.slot.label: p.done for p in pool.procs}
    console.print("layers per worker: " + ", ".join(f"{k} {v}" for k, v in per_worker.items()), markup=False)
    return Run(outcomes, sum(not o.ok for o in outcomes.values()), per_worker)


# -- torchrun ----------------------------------------------------------------------------------
def rank_db_path(db: Path, rank: int) -> Path:
    """The database file of a rank other than 0 across hosts: ``NAME.rankR.SUFFIX`` beside ``db``."""
    return db.with_name(f"{db.stem}.rank{rank}{db.suffix}")


def _run_torchrun(tasks: list[Task], settings: Settings, how: How, console: Any) -> Run:
    """This rank's part in a process group over torchrun's rendezvous: layers claimed from the
    shared counter, results gathered at rank 0 (module docstring)."""
    assert how.ranks is not None
    try:
        from convforge.torch.distributed import RankGroup
    except ImportError as err:
        raise ValueError(f"under torchrun, tuning shares the layers and gathers the results through "
                         f"torch.distributed: {err}") from None
    with RankGroup() as group:
        return run_ranked(tasks, settings, how.ranks, console, group.gather, group.counter(f"tune/{digest(tasks)}"),
                          how.slots)


def run_ranked(tasks: list[Task], settings: Settings, ranks: Ranks, console: Any,
               gather: Callable[[dict[str, Any]], list[dict[str, Any]] | None],
               claim: Callable[[], int] | None = None, slots: tuple[Slot, ...] = ()) -> Run:
    """This rank's layers (taken one at a time through ``claim``, a counter every rank shares over
    :func:`cost_order`; None: this rank's :func:`split_static` share), in-process or through worker
    processes on ``slots``; then the gather at rank 0, which merges the other ranks' entries into
    the shared database (across hosts) and answers every outcome."""
    order = cost_order(tasks)
    source = claimed(order, claim) if claim is not None else iter(split_static(tasks, ranks.world)[ranks.rank])
    main = Path(settings.db)
    own = main if ranks.one_host or ranks.rank == 0 else rank_db_path(main, ranks.rank)
    label = f"rank {ranks.rank}"
    how = "layers taken in turn with the other ranks" if claim is not None else "its static share of the layers"
    if slots:
        console.print(f"{label} of {ranks.world}: {how}, of {len(tasks)}, on {len(slots)} worker(s) "
                      f"({', '.join(s.label for s in slots)}); database {own}", markup=False)
        run = run_tasks([], list(slots), replace(settings, db=str(own)), console, source)
        outcomes = run.outcomes or {}
        for o in outcomes.values():
            o.worker = f"{label} {o.worker}"
        per_worker = run.per_worker
        export = None if own == main else _export(own)
    else:
        head = f"{label} of {ranks.world}: {how}, of {len(tasks)},"
        outcomes, export = _in_process(source, claim is None, settings, ranks, own, main, console, head)
        per_worker = {label: len(outcomes)}
    payload = {"rank": ranks.rank, "digest": digest(tasks), "export": export,
               "outcomes": {str(k): asdict(v) for k, v in outcomes.items()}}
    own_failed = sum(not o.ok for o in outcomes.values())
    gathered = gather(payload)
    if gathered is None:
        return Run(None, own_failed, per_worker)
    return Run(_merge(gathered, tasks, main, console), own_failed, per_worker)


def _in_process(source: Iterator[Task], static: bool, settings: Settings, ranks: Ranks, own: Path, main: Path,
                console: Any, head: str) -> tuple[dict[int, Outcome], dict[str, Any] | None]:
    """A rank's layers tuned in this process on LOCAL_RANK's device: (outcomes, its database's
    export when it is not the shared one). A device that breaks stops the rank taking layers (with a
    shared counter the other ranks take the rest; the rest of a ``static`` share is failed)."""
    device = str(ranks.local_rank) if settings.backend == "cuda" else settings.device
    if settings.backend == "cuda":
        _set_torch_device(ranks.local_rank)
    label = f"rank {ranks.rank}"
    worker = Worker(replace(settings, db=str(own), device=device, label=label, slot=ranks.rank))
    console.print(f"{head} on {worker.backend.device.name} ({worker.backend.name} {device}); database {own}",
                  markup=False)
    outcomes: dict[int, Outcome] = {}
    for t in source:
        reply = worker.run({**t.body, "id": t.id, "name": t.name})
        broken = worker.healthy() or ""
        o = Outcome(bool(reply.get("ok")) and not broken, {k: v for k, v in reply.items() if k not in ("ok", "error")},
                    str(reply.get("error") or (f"device error: {broken}" if broken else "")), label)
        outcomes[t.id] = o
        chosen = reply.get("entry", {}).get("variant") or reply.get("variant", "")
        console.print(f"{label}: {t.name}: {chosen if o.ok else o.error}", markup=False)
        if broken:
            console.print(f"{label}: its device failed ({broken}); it takes no more layers", style="red",
                          markup=False)
            for rest in source if static else ():
                outcomes[rest.id] = Outcome(False, error=f"not tuned: {label}'s device failed earlier ({broken})",
                                            worker=label)
            break
    return outcomes, None if own == main else worker.db.export_json()


def _export(path: Path) -> dict[str, Any]:
    from convforge.tune.db import TuningDB

    return TuningDB(path).export_json()


def _merge(gathered: list[dict[str, Any]], tasks: list[Task], main: Path, console: Any) -> dict[int, Outcome]:
    """Rank 0: every rank's outcomes; the entries of ranks with their own database imported into
    the shared one (validated, kept only where faster), each import reported; a layer no rank
    tuned (every device of the ranks that would have taken it failed) or a rank that built another
    layer list is reported failed."""
    from convforge.tune.db import TuningDB

    outcomes: dict[int, Outcome] = {}
    mine = digest(tasks)
    for doc in sorted(gathered, key=lambda d: d["rank"]):
        if doc.get("digest", mine) != mine:
            console.print(f"rank {doc['rank']} built another layer list than rank 0 (ranks must run the same "
                          "command): its results are left out", style="red", markup=False)
            continue
        if doc.get("export") is not None:
            rep = TuningDB(main).import_json(doc["export"], only_if_faster=True)
            console.print(f"merged rank {doc['rank']}'s database into {main}: {len(rep.stored)} stored, "
                          f"{len(rep.kept)} kept (an entry there is faster), {len(rep.rejected)} rejected",
                          markup=False)
            for label, why in rep.rejected:
                console.print(f"  rejected {label}: {why}", style="red", markup=False)
        for tid, o in doc["outcomes"].items():
            outcomes[int(tid)] = Outcome(**o)
    for t in tasks:
        if t.id not in outcomes:
            outcomes[t.id] = Outcome(False, error="not tuned: no rank took it (their devices failed, or a rank "
                                                  "built another layer list)")
    counts: dict[str, int] = {}
    for o in outcomes.values():
        if o.worker:
            counts[o.worker] = counts.get(o.worker, 0) + 1
    console.print("layers per rank: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), markup=False)
    return outcomes


def _set_torch_device(local_rank: int) -> None:
    """Make LOCAL_RANK's GPU torch's current device where torch is present (the --model discovery
    runs torch there); convforge's own calls name the device anyway."""
    try:
        from convforge.torch.distributed import set_device
    except ImportError:
        return
    set_device(local_rank)


__all__ = ["DEVICES_HELP", "How", "Outcome", "Ranks", "Run", "Slot", "Task", "base_settings", "execute",
           "how_from_args", "parse_devices", "rank_db_path", "run_ranked", "run_tasks", "split_static",
           "torchrun_ranks"]
