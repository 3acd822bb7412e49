"""``convforge tune --devices`` and torchrun ranks (tune/parallel.py, tune/worker.py) on CI: worker
processes sharing the PoCL device and one tuning database, a worker killed mid-run, the static
split and the shared counter of torchrun ranks, rank 0's merge of per-rank databases, and the errors
of ``--devices``. No GPU: the two-GPU runs are in test_gpu_multi.py; the two-"host" torchrun runs on
the CPU (OpenCL) need torch and skip without it."""

from __future__ import annotations

import io
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
from rich.console import Console

from convforge.apps.tune import parallel
from convforge.apps.tune.parallel import Ranks, Task, parse_devices, run_ranked, run_tasks, split_static, torchrun_ranks
from convforge.apps.tune.worker import TEST_HOOK, Settings
from convforge.plan import Epilogue
from convforge.spec import ConvSpec
from convforge.tune.db import TuningDB
from convforge.tune.tuner import Budget, Tuner
from helpers import run_main

# tiny layers: a 3x3 with padding, a strided one with asymmetric padding, a 1x1 (each a distinct cost)
SPECS = {"a3x3": ConvSpec.make(1, 3, 11, 11, 5, 3, 3, 1, 1),
         "b_s2": ConvSpec.make(2, 2, 11, 9, 3, 3, 3, 2, (1, 0, 2, 1)),
         "c1x1": ConvSpec.make(1, 4, 7, 7, 4, 1, 1)}
BUDGET = (None, 2)  # two candidates per layer, no time limit: the same candidates on every run


@pytest.fixture(scope="module")
def pocl():  # type: ignore[no-untyped-def]
    from convforge.backends import opencl_available

    if not opencl_available():
        if os.environ.get("CI"):
            pytest.fail("no OpenCL device on CI: is pyopencl[pocl] installed?")
        pytest.skip("no OpenCL device")
    from convforge.backends.opencl import list_devices

    pi, di, _, _ = list_devices()[0]
    return f"{pi}:{di}"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A compile cache of the test's own, which the workers inherit through the environment; the
    settings an in-process worker (a simulated rank) or the command changes are restored after."""
    from convforge.config import config
    from convforge.tune import clear_choices

    folder = tmp_path / "cache"
    monkeypatch.setenv("CONVFORGE_CACHE_DIR", str(folder))
    monkeypatch.delenv(TEST_HOOK, raising=False)
    saved = {k: getattr(config, k) for k in ("db_path", "precision", "max_error", "cache_dir")}
    config.cache_dir = folder
    yield folder
    for k, v in saved.items():
        setattr(config, k, v)
    clear_choices()


def _tasks(names: list[str] | None = None) -> list[Task]:
    return [Task(i, n, float(SPECS[n].flops), {"kind": "layer", "spec": SPECS[n].to_dict(), "epi": asdict(Epilogue())})
            for i, n in enumerate(names or list(SPECS))]


def _settings(db: Path, device: str) -> Settings:
    return Settings(backend="opencl", device=device, db=str(db), budget=BUDGET, threads=1)


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200), buf


def _measured(db: TuningDB) -> dict[str, set[tuple[str, str]]]:
    """Per layer: the (variant, params) points measured (what the search tried)."""
    return {e.spec: {(m.variant, m.params) for m in db.measurements(e.key)} for e in db.entries()}


# -- no device: parsing, the split, the ranks ----------------------------------------------------------
@pytest.mark.parametrize("text", ["", " ", "a", "0,,1", "all,0", "-1", "0:x", "1.5"])
def test_bad_devices_values_are_one_clear_error(text: str, pocl: str) -> None:
    with pytest.raises(ValueError, match=r"--devices .* must be 'all' or a comma-separated list"):
        parse_devices(text, "opencl")


def test_devices_that_do_not_exist_are_named(pocl: str) -> None:
    with pytest.raises(ValueError, match="OpenCL device 7:0 does not exist"):
        parse_devices(f"{pocl},7:0", "opencl")
    slots = parse_devices(f"{pocl},{pocl}", "opencl")
    assert [s.label for s in slots] == [f"opencl:{pocl}#1", f"opencl:{pocl}#2"]
    assert {s.device for s in slots} == {pocl}


def test_devices_without_cuda_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from convforge.backends import cuda_available

    if cuda_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="one worker per CUDA device, but this machine has none"):
        parse_devices("all", "cuda")


@pytest.mark.parametrize("argv,match", [
    (["--devices", "0,,1"], "must be 'all' or a comma-separated list"),
    (["--devices", "zero", "--backend", "opencl"], "must be 'all' or a comma-separated list"),
    (["--devices", "0:0", "--backend", "opencl", "--device", "0:0"], "--device and --devices cannot be combined"),
    (["--devices", "0:0", "--backend", "opencl", "--report", "REPORT"], "--report measures on one device"),
    (["--devices", "0:0", "--backend", "opencl", "--dispatch-overhead"], "--dispatch-overhead measures on one"),
])
def test_tune_devices_errors_exit_2(argv: list[str], match: str, tmp_path: Path, capsys, pocl: str) -> None:  # type: ignore[no-untyped-def]
    argv = [a.replace("REPORT", str(tmp_path / "rep")) for a in argv]
    rc, out = run_main(["tune", "--spec", "N=1,C=3,H=9,W=9,K=4,R=3,S=3", "--db", str(tmp_path / "t.sqlite"),
                        *argv], capsys)
    assert rc == 2 and match in out and "Traceback" not in out, out
    assert out.count("error:") == 1


def test_cli_devices_without_cuda_exit_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from convforge.backends import cuda_available

    if cuda_available():
        pytest.skip("this machine has CUDA")
    rc, out = run_main(["tune", "--spec", "N=1,C=3,H=9,W=9,K=4,R=3,S=3", "--devices", "all",
                        "--db", str(tmp_path / "t.sqlite")], capsys)
    assert rc == 2 and "this machine has none" in out and "--backend opencl --devices 0:0,0:0" in out, out


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, local: int, local_world: int) -> None:
    for k, v in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": local, "LOCAL_WORLD_SIZE": local_world}.items():
        monkeypatch.setenv(k, str(v))


def test_devices_list_under_torchrun_with_ranks_per_gpu_is_refused(tmp_path: Path, capsys,  # type: ignore[no-untyped-def]
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch, 0, 2, 0, 2)
    rc, out = run_main(["tune", "--spec", "N=1,C=3,H=9,W=9,K=4,R=3,S=3", "--devices", "0,1", "--db",
                        str(tmp_path / "t.sqlite")], capsys)
    assert rc == 2 and "--devices 0,1 does not apply under torchrun with several ranks per host" in out, out
    assert out.count("error:") == 1 and "Traceback" not in out, out


def test_devices_under_torchrun_names_what_each_rank_runs(monkeypatch: pytest.MonkeyPatch, pocl: str) -> None:
    """One rank per GPU: ``--devices all`` (or nothing) is the rank's LOCAL_RANK device, in-process;
    one rank per host (LOCAL_WORLD_SIZE 1): ``--devices`` names that host's worker devices."""
    import argparse

    def args(**kw: object) -> argparse.Namespace:
        return argparse.Namespace(**{"devices": None, "device": None, "backend": "opencl", **kw})

    _torchrun_env(monkeypatch, 3, 4, 1, 2)
    for given in (None, "all"):
        how = parallel.how_from_args(args(devices=given))
        assert how is not None and how.ranks == Ranks(3, 4, 1, 2) and not how.slots
    assert "rank 3 of 4 (torchrun)" == how.describe()
    with pytest.raises(ValueError, match="--device and --devices cannot be combined"):
        parallel.how_from_args(args(devices="all", device=pocl))
    _torchrun_env(monkeypatch, 1, 2, 0, 1)
    how = parallel.how_from_args(args(devices=f"{pocl},{pocl}"))
    assert how is not None and how.ranks == Ranks(1, 2, 0, 1) and len(how.slots) == 2
    assert how.describe() == f"rank 1 of 2 (torchrun), 2 worker(s): opencl:{pocl}#1, opencl:{pocl}#2"


def test_torchrun_environment() -> None:
    assert torchrun_ranks({}) is None
    assert torchrun_ranks({"RANK": "1", "WORLD_SIZE": "2"}) is None
    r = torchrun_ranks({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert r == Ranks(3, 4, 1, 2) and not r.one_host
    assert torchrun_ranks({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).one_host
    with pytest.raises(ValueError, match="must be ints"):
        torchrun_ranks({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="RANK \\(2\\) must be in 0..WORLD_SIZE-1"):
        torchrun_ranks({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_static_split_is_deterministic_balanced_and_complete() -> None:
    costs = [50, 7, 7, 30, 1, 22, 22, 9, 3, 40]
    tasks = [Task(i, f"t{i}", float(c), {}) for i, c in enumerate(costs)]
    for n in (1, 2, 3, 4, 11):
        shares = split_static(tasks, n)
        assert len(shares) == n
        assert sorted(t.id for s in shares for t in s) == list(range(len(costs)))
        again = split_static(list(reversed(tasks)), n)
        assert [[t.id for t in s] for s in shares] == [[t.id for t in s] for s in again]
        loads = [sum(t.cost for t in s) for s in shares]
        assert max(loads) - min(loads) <= max(costs)  # LPT: no share ahead by more than one task
    # largest first, each to the least loaded share (ties: the lower share): 95 + 1 against 95
    assert [[t.id for t in s] for s in split_static(tasks, 2)] == [[0, 5, 7, 1, 2, 4], [9, 3, 6, 8]]


def test_claims_hand_every_layer_out_once_largest_first() -> None:
    """Ranks drawing from one counter (here interleaved by hand) take disjoint layers that together
    are every layer, in the cost order every rank computes the same way."""
    tasks = [Task(i, f"t{i}", float(c), {}) for i, c in enumerate([5, 50, 7, 50, 1])]
    order = parallel.cost_order(tasks)
    assert [t.id for t in order] == [1, 3, 2, 0, 4] and parallel.cost_order(list(reversed(tasks))) == order
    count = iter(range(100))
    ranks = [parallel.claimed(order, lambda: next(count)) for _ in range(3)]
    taken: list[list[int]] = [[], [], []]
    for step in [0, 1, 2, 2, 0, 1, 1, 0]:  # whichever rank is idle asks next
        t = next(ranks[step], None)
        if t is not None:
            taken[step].append(t.id)
    assert taken == [[1, 4], [3], [2, 0]]
    assert sorted(i for share in taken for i in share) == list(range(len(tasks)))


# -- worker processes on the PoCL device -----------------------------------------------------------------
def test_two_workers_share_the_device_and_one_database(pocl: str, cache: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Both workers tune (each task takes >= 1 s, so neither can take them all), every entry lands
    in the one database, the progress bar counts every layer once, and the search tried the same
    candidates as a one-process run with the same seed and budget."""
    monkeypatch.setenv(TEST_HOOK, "slow=2")
    db = tmp_path / "shared.sqlite"
    console, buf = _console()
    run = run_tasks(_tasks(), parse_devices(f"{pocl},{pocl}", "opencl"), _settings(db, pocl), console)
    out = buf.getvalue()
    assert run.outcomes is not None and all(o.ok for o in run.outcomes.values()), out
    assert sorted(run.per_worker.values()) == [1, 2] and sum(run.per_worker.values()) == len(SPECS), out
    assert {o.worker for o in run.outcomes.values()} == set(run.per_worker), out
    assert "layers ━" in out and f"{len(SPECS)}/{len(SPECS)}" in out and "died" not in out, out
    shared = TuningDB(db)
    assert {e.spec for e in shared.entries()} == {s.key() for s in SPECS.values()}
    for o in run.outcomes.values():  # each reply is the entry the worker stored
        assert shared.get(*[o.reply["entry"][k] for k in ("device", "backend", "spec", "dtype", "epilogue",
                                                          "precision")]) is not None
    from convforge.backends import get_backend

    alone = TuningDB(tmp_path / "alone.sqlite")
    tuner = Tuner(get_backend("opencl", pocl), alone, Budget(*BUDGET), seed=0, workers=1)
    for spec in SPECS.values():
        tuner.tune(spec)
    assert _measured(alone) == _measured(shared)


def test_killed_worker_is_reported_and_its_layer_requeued(pocl: str, cache: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TEST_HOOK, "kill=1:1,slow=1")  # the worker in slot 1 dies on its first task
    db = tmp_path / "shared.sqlite"
    console, buf = _console()
    slots = parse_devices(f"{pocl},{pocl}", "opencl")
    run = run_tasks(_tasks(), slots, _settings(db, pocl), console)
    out = buf.getvalue()
    assert run.outcomes is not None and all(o.ok for o in run.outcomes.values()), out
    assert f"worker {slots[1].label} (pid " in out and "died (killed by SIGKILL) while tuning" in out, out
    assert "re-queued for the other workers" in out and f"{len(SPECS)}/{len(SPECS)}" in out, out
    assert run.per_worker == {slots[0].label: len(SPECS), slots[1].label: 0}
    assert len(TuningDB(db).entries()) == len(SPECS)


def test_device_error_stops_the_worker_and_requeues_its_layer(pocl: str, cache: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose device check fails after a task (a sticky CUDA error) says why and exits;
    the parent names it with that reason and hands the task to the other worker."""
    monkeypatch.setenv(TEST_HOOK, "broken=1:1,slow=1")  # slot 1's device "breaks" during its first task
    console, buf = _console()
    slots = parse_devices(f"{pocl},{pocl}", "opencl")
    run = run_tasks(_tasks(), slots, _settings(tmp_path / "t.sqlite", pocl), console)
    out = buf.getvalue()
    assert run.outcomes is not None and all(o.ok for o in run.outcomes.values()), out
    assert f"worker {slots[1].label} (pid" in out, out
    assert "died (stopped: device error after " in out and "test hook: the device is broken) while tuning" in out, out
    assert "re-queued" in out and run.per_worker == {slots[0].label: len(SPECS), slots[1].label: 0}, out


def test_workers_that_cannot_start_fail_every_layer_with_the_reason(pocl: str, cache: Path, tmp_path: Path) -> None:
    console, buf = _console()
    slots = [parallel.Slot("opencl:0:9", "opencl", "0:9")]  # past parse_devices: a device that is not there
    run = run_tasks(_tasks(["c1x1"]), slots, _settings(tmp_path / "t.sqlite", pocl), console)
    out = buf.getvalue()
    assert run.outcomes is not None and not run.outcomes[0].ok, out
    assert "worker opencl:0:9 (pid" in out and "could not start" in out and "does not exist" in out, out
    assert run.outcomes[0].error == "no worker left: every worker died" and "1/1" in out


def test_layer_that_kills_two_workers_is_failed(pocl: str, cache: Path, tmp_path: Path, capsys,  # type: ignore[no-untyped-def]
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the command: the layer that killed both workers is failed with that reason (and
    whatever was left then has no worker: failed too); exit status 1; the bar still ends at 2/2."""
    monkeypatch.setenv(TEST_HOOK, "kill=@spec1")
    rc, out = run_main(["tune", "--backend", "opencl", "--devices", f"{pocl},{pocl}", "--budget", "2",
                        "--spec", "N=2,C=2,H=11,W=9,K=3,R=3,S=3,stride=2,pad=1x0x2x1",
                        "--spec", "N=1,C=4,H=7,W=7,K=4,R=1,S=1", "--db", str(tmp_path / "t.sqlite")], capsys)
    assert rc == 1, out
    assert "spec1: failed: killed two workers" in out and "which had killed" in out, out
    assert "2/2" in out and "failed" in out.split("tuned on opencl")[1], out


def test_duplicate_layers_are_tuned_once_through_the_command(pocl: str, cache: Path, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    spec = "N=1,C=3,H=11,W=11,K=5,R=3,S=3,pad=1"
    rc, out = run_main(["tune", "--backend", "opencl", "--devices", pocl, "--budget", "2", "--spec", spec,
                        "--spec", spec, "--db", str(tmp_path / "t.sqlite")], capsys)
    assert rc == 0, out
    assert "1 distinct layer(s) on 1 worker(s)" in out and "1 layer(s) tuned, 1 from the database, 0 failed" in out
    assert "1/1" in out


def test_net_on_two_workers(pocl: str, cache: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """``--net`` through the workers: every distinct conv/fc of a small prototxt lands once."""
    net = tmp_path / "tiny.prototxt"
    net.write_text("""name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 13 dim: 13 } } }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2"
  convolution_param { num_output: 5 kernel_size: 3 stride: 2 } }
""")
    db = tmp_path / "t.sqlite"
    rc, out = run_main(["tune", "--backend", "opencl", "--devices", f"{pocl},{pocl}", "--budget", "2",
                        "--net", str(net), "--db", str(db)], capsys)
    assert rc == 0, out
    assert "2 distinct conv/fc layer(s)" in out and "2 layer(s) tuned or known, 0 failed" in out, out
    assert len(TuningDB(db).entries()) == 2


# -- torchrun ranks, simulated in one process ------------------------------------------------------------
def test_ranks_across_hosts_write_their_own_files_and_rank0_merges(pocl: str, cache: Path, tmp_path: Path) -> None:
    """Two ranks on different hosts (LOCAL_WORLD_SIZE 1): rank 1 writes NAME.rank1.sqlite, rank 0
    the shared database; rank 0 imports rank 1's entries (only where faster) and answers every
    layer's outcome; the shares are the static split of the same list."""
    tasks = _tasks()
    db = tmp_path / "tuning.sqlite"
    sent: dict[int, dict] = {}
    console, buf = _console()

    def gather_from(rank: int):  # type: ignore[no-untyped-def]
        def gather(payload):  # type: ignore[no-untyped-def]
            sent[rank] = json.loads(json.dumps(payload))  # what torch.distributed would pickle across
            return [sent[r] for r in sorted(sent)] if rank == 0 else None
        return gather

    one = run_ranked(tasks, _settings(db, pocl), Ranks(1, 2, 0, 1), console, gather_from(1))
    assert one.outcomes is None and one.own_failed == 0
    own1 = parallel.rank_db_path(db, 1)
    assert own1.name == "tuning.rank1.sqlite"
    share1 = {t.name for t in split_static(tasks, 2)[1]}
    assert {e.spec for e in TuningDB(own1).entries()} == {SPECS[n].key() for n in share1}
    zero = run_ranked(tasks, _settings(db, pocl), Ranks(0, 2, 0, 1), console, gather_from(0))
    assert zero.outcomes is not None and sorted(zero.outcomes) == [t.id for t in tasks]
    assert all(o.ok for o in zero.outcomes.values()), buf.getvalue()
    assert {o.worker for o in zero.outcomes.values()} == {"rank 0", "rank 1"}
    assert {e.spec for e in TuningDB(db).entries()} == {s.key() for s in SPECS.values()}
    assert f"merged rank 1's database into {db}: {len(share1)} stored" in buf.getvalue()


def test_ranks_sharing_a_counter_take_layers_in_turn_and_rank0_merges(pocl: str, cache: Path,
                                                                      tmp_path: Path) -> None:
    """Two ranks across hosts drawing from one counter (its answers scripted: rank 1 gets 1 and
    then the end, rank 0 gets 0, 2 and the end): each tunes exactly the layers of its claims in cost
    order, rank 1 in its own file, and rank 0 answers every layer after merging it."""
    tasks = _tasks()
    order = parallel.cost_order(tasks)
    db = tmp_path / "tuning.sqlite"
    sent: dict[int, dict] = {}
    console, buf = _console()

    def gather_from(rank: int):  # type: ignore[no-untyped-def]
        def gather(payload):  # type: ignore[no-untyped-def]
            sent[rank] = json.loads(json.dumps(payload))
            return [sent[r] for r in sorted(sent)] if rank == 0 else None
        return gather

    answers = {1: iter([1, 3]), 0: iter([0, 2, 3])}
    one = run_ranked(tasks, _settings(db, pocl), Ranks(1, 2, 0, 1), console, gather_from(1), lambda: next(answers[1]))
    assert one.outcomes is None and one.per_worker == {"rank 1": 1}
    assert {e.spec for e in TuningDB(parallel.rank_db_path(db, 1)).entries()} == {SPECS[order[1].name].key()}
    zero = run_ranked(tasks, _settings(db, pocl), Ranks(0, 2, 0, 1), console, gather_from(0), lambda: next(answers[0]))
    assert zero.outcomes is not None and sorted(zero.outcomes) == [t.id for t in tasks]
    assert all(o.ok for o in zero.outcomes.values()), buf.getvalue()
    assert zero.outcomes[order[1].id].worker == "rank 1"
    assert {zero.outcomes[order[i].id].worker for i in (0, 2)} == {"rank 0"}
    assert {e.spec for e in TuningDB(db).entries()} == {s.key() for s in SPECS.values()}
    assert "layers per rank: rank 0 2, rank 1 1" in buf.getvalue()


@pytest.mark.parametrize("where", ["in-process", "workers"])
def test_two_hosts_through_torchrun_rendezvous(where: str, pocl: str, cache: Path, tmp_path: Path) -> None:
    """``convforge tune`` under torchrun on two "hosts" (two agents, c10d rendezvous on localhost,
    one rank each; OpenCL): the ranks take the layers from the shared counter (both tune some),
    rank 1 into its own file, rank 0 merges it and prints the whole table. ``workers``: each
    host's rank runs a worker process on its device (``--devices``, one rank per host)."""
    pytest.importorskip("torch", reason="torchrun needs torch")
    from multinode import run_hosts

    specs = [a for s in SPECS.values() for a in ("--spec", _spec(s))]
    db = tmp_path / "tuning.sqlite"
    dev = ["--device", pocl] if where == "in-process" else ["--devices", pocl]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(parallel.__file__).parents[3]),
                                                        os.environ.get("PYTHONPATH", "")]),
           TEST_HOOK: "slow=2"}  # each layer >= 2 s: neither host can take them all
    outs = run_hosts(["-m", "convforge.cli", "tune", *specs, "--backend", "opencl", *dev, "--budget", "2",
                      "--db", str(db)], env)
    zero = next(o for o in outs if "layers per rank:" in o)
    assert f"{len(SPECS)} layer(s) tuned, 0 from the database, 0 failed" in zero, outs
    assert "rank 0 of 2" in "".join(outs) and "rank 1 of 2" in "".join(outs), outs
    assert "merged rank 1's database into" in zero, zero
    import re

    per = dict(re.findall(r"(rank \d)[^,\n]* (\d+)", zero.split("layers per rank:")[1].splitlines()[0]))
    assert set(per) == {"rank 0", "rank 1"} and all(int(v) > 0 for v in per.values()), zero
    assert {e.spec for e in TuningDB(db).entries()} == {s.key() for s in SPECS.values()}


def _spec(s: ConvSpec) -> str:
    """``--spec`` text of a layer."""
    return (f"N={s.n},C={s.c},H={s.h},W={s.w},K={s.k},R={s.r},S={s.s},stride={s.stride[0]}x{s.stride[1]},"
            f"pad={'x'.join(map(str, s.pad))}")


def test_rank0_fails_layers_no_rank_took_and_lists_built_elsewhere(tmp_path: Path) -> None:
    """The merge answers every layer: one no rank reported (the ranks that would have taken it
    stopped) and those of a rank that built another layer list fail with the reason."""
    tasks = [Task(i, f"t{i}", float(10 - i), {"kind": "layer"}) for i in range(3)]
    ok = asdict(parallel.Outcome(True, {"entry": {}}, "", "rank 0"))
    docs = [{"rank": 0, "digest": parallel.digest(tasks), "export": None, "outcomes": {"0": ok}},
            {"rank": 1, "digest": "another", "export": None, "outcomes": {"1": ok}}]
    console, buf = _console()
    out = parallel._merge(docs, tasks, tmp_path / "t.sqlite", console)
    assert out[0].ok and not out[1].ok and not out[2].ok
    assert "no rank took it" in out[2].error and "rank 1 built another layer list" in buf.getvalue()


def test_ranks_on_one_host_share_the_database(pocl: str, cache: Path, tmp_path: Path) -> None:
    tasks = _tasks()
    db = tmp_path / "tuning.sqlite"
    console, _ = _console()
    payloads: list[dict] = []
    run_ranked(tasks, _settings(db, pocl), Ranks(1, 2, 1, 2), console, lambda p: payloads.append(p))  # type: ignore[func-returns-value]
    run = run_ranked(tasks, _settings(db, pocl), Ranks(0, 2, 0, 2), console, lambda p: [p, *payloads])
    assert not parallel.rank_db_path(db, 1).exists() and payloads[0]["export"] is None
    assert run.outcomes is not None and all(o.ok for o in run.outcomes.values())
    assert len(TuningDB(db).entries()) == len(SPECS)


# -- bench --model --train --devices (bench/ddp.py): what runs without torch ----------------------------
@pytest.mark.parametrize("argv,match", [
    (["bench", "--suite", "mec", "--devices", "2"], "--devices goes with --model --train"),
    (["bench", "--model", "resnet50:32", "--devices", "2"], "--devices goes with --train"),
])
def test_bench_devices_errors_exit_2(argv: list[str], match: str, capsys) -> None:  # type: ignore[no-untyped-def]
    rc, out = run_main(argv, capsys)
    assert rc == 2 and match in out and "Traceback" not in out, out


def test_ddp_rows_scale_against_one_gpu() -> None:
    from convforge.apps.bench import ddp

    rows = [dict(model="resnet50", batch=32, impl="convforge", gpus=1, images_per_s=400.0, status="ok"),
            dict(model="resnet50", batch=32, impl="convforge", gpus=2, images_per_s=740.0, step_ms=43.0,
                 nosync_ms=40.5, status="ok"),
            dict(model="resnet50", batch=32, impl="pytorch_fp32", gpus=2, images_per_s=700.0, status="ok")]
    ddp.scale(rows)
    assert rows[0]["scaling"] == 1.0 and rows[1]["scaling"] == pytest.approx(1.85)
    assert rows[1]["efficiency"] == pytest.approx(0.925) and "scaling" not in rows[2]  # no one-GPU row of its own
    assert rows[1]["comm_ms"] == pytest.approx(2.5) and "comm_ms" not in rows[0]  # step - no-sync step
    assert ddp.parse_impls(None) == ddp.IMPLS and ddp.parse_impls("convforge") == ("convforge",)
    assert ddp.parse_impls("pytorch_fp32,convforge_fused") == ("pytorch", "convforge_fused")
    with pytest.raises(ValueError, match="--impl"):
        ddp.parse_impls("convforge,cudnn")


def test_ddp_rows_of_every_mode_compare_within_their_mode() -> None:
    """Scaling against the one-GPU row of the same mode and impl, vs PyTorch against the PyTorch row
    of the same mode and GPU count, the comm share of the step."""
    from convforge.apps.bench import ddp

    def row(mode: str, impl: str, gpus: int, ips: float, **kw: float) -> dict:
        return dict(model="resnet50", batch=32, precision=mode, impl=ddp._name(impl, mode), gpus=gpus,
                    images_per_s=ips, status="ok", **kw)

    rows = [row("fp32", "pytorch", 1, 800.0), row("fp32", "pytorch", 2, 1500.0, step_ms=42.0, nosync_ms=40.0),
            row("fp32", "convforge_fused", 1, 1200.0), row("fp32", "convforge_fused", 2, 2250.0),
            row("fp16", "pytorch", 1, 2000.0), row("fp16", "convforge_fused", 1, 2400.0),
            row("fp16", "convforge_fused", 2, 3000.0)]
    ddp.scale(rows)
    assert rows[0]["impl"] == "pytorch_fp32" and rows[4]["impl"] == "pytorch_fp16_amp_cl"
    assert rows[1]["scaling"] == pytest.approx(1.875) and rows[3]["scaling"] == pytest.approx(1.875)
    assert rows[1]["comm_ms"] == pytest.approx(2.0) and rows[1]["comm_pct"] == pytest.approx(100 * 2 / 42)
    assert rows[3]["vs_pytorch"] == pytest.approx(1.5) and rows[2]["vs_pytorch"] == pytest.approx(1.5)
    assert rows[6]["scaling"] == pytest.approx(1.25) and "vs_pytorch" not in rows[6]  # no 2-GPU fp16 PyTorch row
    assert ddp.parse_modes("fp32,fp16,fp32") == ("fp32", "fp16") and ddp.parse_modes(None) == ("fp32",)
    with pytest.raises(ValueError, match="--modes"):
        ddp.parse_modes("fp8")
    assert ddp.modes_of(("fp32", "relaxed"), None) == ("fp32", "relaxed")
    assert ddp.modes_of(("fp32",), "bfloat16") == ("bf16",) and ddp.modes_of(("fp32",), "float32") == ("fp32",)


def test_ddp_profile_overlap_of_allreduce_and_compute_kernels() -> None:
    """The all-reduce's time a step, the share of it beside compute, beside our kernels, exposed."""
    from convforge.apps.bench import ddp

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "cf_dgrad_a", "ts": 0.0, "dur": 400.0},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "ts": 300.0, "dur": 500.0},
        {"ph": "X", "cat": "kernel", "name": "cudnn_wgrad", "ts": 500.0, "dur": 100.0},
        {"ph": "X", "cat": "kernel", "name": "cf_wgrad_b", "ts": 550.0, "dur": 100.0},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_Broadcast_RING_LL", "ts": 900.0, "dur": 50.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 2000.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 10.0}]}
    ks = ddp.kernels_of(trace)
    assert len(ks) == 5 and ks[1] == ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 300.0, 800.0)
    got = ddp.overlap(ks, {"cf_dgrad_a", "cf_wgrad_b"}, steps=1)
    # all-reduce 300..800: compute beside it 300..400 and 500..650 (250 us), ours 300..400 and 550..650
    assert got["allreduce_ms"] == pytest.approx(0.5) and got["overlap"] == pytest.approx(0.5)
    assert got["overlap_ours_ms"] == pytest.approx(0.2) and got["exposed_ms"] == pytest.approx(0.25)
    assert got["ours_beside"] == 2
    none = ddp.overlap([("k", 0.0, 1.0)], set())
    assert none["allreduce_ms"] == 0 and none["overlap"] == 0
