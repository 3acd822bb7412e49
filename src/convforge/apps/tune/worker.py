"""A tuning worker: one process on one device, tuning the layers its parent hands it one at a time
(``convforge tune --devices``, :mod:`convforge.apps.tune.parallel`); :class:`Worker` is also used
in-process by a ``torchrun`` rank for its share.

``python -m convforge.apps.tune.worker`` speaks JSON lines. The parent writes the :class:`Settings` on
the first line of the worker's stdin, then one task per line (``{"id", "name", "kind", "spec",
"epi", ...}``), then ``{"stop": true}`` (or closes stdin). The worker answers on its ORIGINAL
stdout, kept for the protocol alone (fd 1 is pointed at stderr, so whatever else Python or a C
library prints cannot corrupt it): ``{"ready": {...device...}}`` once the back-end is up,
``{"cand": id, "what": ...}`` per candidate timed, ``{"done": id, "ok": ..., ...}`` per task, and
``{"fatal": why}`` just before it exits with status 3 (the back-end could not start, or the device
is broken after a task: a sticky CUDA error). Its log lines go to stderr, which the parent shows.

A task of kind ``layer`` is ``Tuner.tune(spec, epilogue, force=...)``, as ``convforge tune`` runs
it in one process; kind ``auto`` is exactly what dispatch does on first sight of a layer with
``config.autotune`` on (``tune --model``): ``dispatch.choice._tune_now`` with the task's precision
class, bound and workspace limit. Every worker writes the one tuning database (WAL, short
``BEGIN IMMEDIATE`` transactions under a busy timeout: tune/db.py).

Test hook (the parent's tests only), ``CONVFORGE_TEST_WORKER`` with comma-separated items:
``kill=SLOT:N`` makes the worker in slot SLOT kill itself (SIGKILL) on receiving its N-th task,
``kill=@NAME`` makes any worker do so on the task named NAME, ``broken=SLOT:N`` or ``broken=@NAME``
makes the device check after that task fail (as a sticky CUDA error would), ``slow=S`` makes every task take at
least S seconds (so that every worker of a short test gets work).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from convforge.config import config
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from convforge.tune.db import TuningDB
from convforge.tune.tuner import Budget, Candidate, TuneError, Tuner

TEST_HOOK = "CONVFORGE_TEST_WORKER"
FATAL_EXIT = 3


@dataclass(frozen=True)
class Settings:
    """What every task of a worker shares: the header line of the protocol."""

    backend: str
    device: str | None
    db: str
    budget: tuple[float | None, int | None]
    seed: int = 0
    threads: int | None = None
    precision: str = "fp32"
    max_error: float | None = None
    force: bool = False
    verbose: bool = False
    label: str = ""
    slot: int = 0

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Settings:
        doc = dict(doc)
        seconds, candidates = doc.pop("budget")
        return cls(budget=(seconds, candidates), **doc)

    def doc(self) -> dict[str, Any]:
        return asdict(self)


class Worker:
    """Tunes tasks on one back-end instance into one database (the settings' ``db``)."""

    def __init__(self, settings: Settings, on_candidate: Callable[[str, Candidate], None] | None = None) -> None:
        from convforge.backends import get_backend
        from convforge.tune import clear_choices

        self.settings = settings
        config.db_path = Path(settings.db)
        config.precision = settings.precision
        config.max_error = settings.max_error
        clear_choices()
        self.backend = get_backend(settings.backend, settings.device)
        self.db = TuningDB(settings.db)
        self.budget = Budget(*settings.budget)
        self.current = ""  # the task being tuned (its id), for candidate reports
        tick = (lambda c: on_candidate(self.current, c)) if on_candidate is not None else None
        self.tuner = Tuner(self.backend, self.db, self.budget, settings.seed, workers=settings.threads,
                           on_candidate=tick, precision=settings.precision, max_error=settings.max_error)

    def device_doc(self) -> dict[str, Any]:
        dev = self.backend.device
        return {"name": dev.name, "driver": dev.driver, "backend": self.backend.name, "key": dev.key(),
                "pid": os.getpid()}

    def run(self, task: dict[str, Any]) -> dict[str, Any]:
        """One task's reply: ``ok`` and what was chosen, or ``ok`` False and ``error``."""
        self.current = str(task.get("id", ""))
        try:
            spec = ConvSpec.from_dict(task["spec"])
            epi = Epilogue(**task["epi"])
            if task["kind"] == "auto":
                return self._auto(spec, epi, task)
            res = self.tuner.tune(spec, epi, force=self.settings.force)
        except TuneError as err:
            return {"ok": False, "error": str(err)}
        except Exception as err:  # noqa: BLE001 - a layer's failure is reported with it, never a silent loss
            return {"ok": False, "error": f"{type(err).__name__}: {err}"}
        timed = sum(1 for c in res.candidates if c.status == "ok")
        return {"ok": True, "entry": asdict(res.entry), "from_db": res.from_db, "timed": timed}

    def _auto(self, spec: ConvSpec, epi: Epilogue, task: dict[str, Any]) -> dict[str, Any]:
        """What dispatch does for a layer with autotuning on (``tune --model``): the database's
        entry when it has one that serves (``from_db``), else tuning on first sight."""
        import convforge.tune as tune_pkg
        from convforge.dispatch import choice

        prec, bound, limit = task["precision"], task.get("bound"), task.get("workspace_limit")
        saved = tune_pkg.AUTOTUNE_BUDGET, config.autotune
        tune_pkg.AUTOTUNE_BUDGET, config.autotune = self.budget, True
        try:
            ch = choice._from_db(spec, self.backend, epi, prec, bound, limit)
            known = ch is not None
            if ch is None:
                ch = choice._tune_now(spec, self.backend, epi, prec, bound, limit)
        finally:
            tune_pkg.AUTOTUNE_BUDGET, config.autotune = saved
        if ch is None:
            return {"ok": False, "error": f"tuning {spec.short()}{epi.tag()} failed (see the worker's log)"}
        return {"ok": True, "variant": ch.variant.name, "params": ch.params.to_json(), "rel_err": ch.error,
                "from_db": known, "timed": 0}

    def healthy(self) -> str | None:
        """None when the device still works; else why not (a sticky CUDA error surfaces here)."""
        try:
            self.backend.synchronize()
        except Exception as err:  # noqa: BLE001 - any failure here means the device is unusable
            return f"{type(err).__name__}: {err}"
        return None


def _claim_stdout() -> IO[str]:
    """The protocol channel: a copy of fd 1, which is then pointed at stderr."""
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    return channel


class _TestHook:
    """The test hook (module docstring): nothing happens unless ``CONVFORGE_TEST_WORKER`` is set."""

    def __init__(self, slot: int) -> None:
        parts = (item.partition("=") for item in os.environ.get(TEST_HOOK, "").split(","))
        items = {key.strip(): value.strip() for key, _, value in parts if key.strip()}
        self.slot, self.kill, self.broken = slot, items.get("kill", ""), items.get("broken", "")
        self.slow = float(items.get("slow") or 0)

    def _hit(self, what: str, n: int, name: str) -> bool:
        """Whether ``what`` (``SLOT:N`` or ``@NAME``) names this worker's ``n``-th task, ``name``."""
        if what.startswith("@"):
            return name == what[1:]
        want_slot, _, want_n = what.partition(":")
        return bool(what) and want_slot == str(self.slot) and want_n == str(n)

    def before(self, n: int, name: str) -> None:
        """Called on receiving the ``n``-th task, named ``name``."""
        if self._hit(self.kill, n, name):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.slow:
            time.sleep(self.slow)

    def device_error(self, n: int, name: str) -> str | None:
        """A made-up device error after the task ``broken`` names."""
        return "test hook: the device is broken" if self._hit(self.broken, n, name) else None


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    for name in ("convforge", "convforge.tune", "convforge.dispatch"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(logging.INFO if verbose and name == "convforge.tune" else logging.WARNING)


def main() -> int:
    """The worker process: settings, then tasks until ``stop`` or the end of stdin."""
    channel = _claim_stdout()

    def send(doc: dict[str, Any]) -> None:
        channel.write(json.dumps(doc) + "\n")
        channel.flush()

    try:
        settings = Settings.from_doc(json.loads(sys.stdin.readline()))
        _setup_logging(settings.verbose)
        worker = Worker(settings, on_candidate=lambda tid, c: send({"cand": tid, "what": c.describe()}))
    except Exception as err:  # noqa: BLE001 - said to the parent, which names this worker
        send({"fatal": f"could not start: {type(err).__name__}: {err}"})
        return FATAL_EXIT
    send({"ready": worker.device_doc()})
    hook = _TestHook(settings.slot)
    count = 0
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("stop"):
            break
        count += 1
        name = str(msg.get("name", ""))
        hook.before(count, name)
        reply = worker.run(msg)
        why = worker.healthy() or hook.device_error(count, name)
        if why is not None:
            send({"fatal": f"device error after {msg.get('name')}: {why}"})
            return FATAL_EXIT
        send({"done": msg["id"], **reply})
    return 0


if __name__ == "__main__":
    sys.exit(main())
