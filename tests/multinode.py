"""Several "hosts" on one machine through torchrun's multi-node rendezvous, for the tests (not a test file).

Each host is one ``python -m torch.distributed.run --nnodes N --nproc-per-node K --rdzv-backend c10d
--rdzv-endpoint localhost:PORT`` agent, started at once; the first hosts the rendezvous store
(``is_host``), the others join it, as agents on separate machines would. torchrun assigns the
ranks in order of arrival (``--node-rank`` is for the static rendezvous only), so a test must not
assume which agent's processes get rank 0: it reads every host's output.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence


def free_port() -> int:
    """A TCP port nothing listens on now (the rendezvous store's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_argv(index: int, nodes: int, per_node: int, port: int, run_id: str = "cf") -> list[str]:
    """torchrun's arguments for host ``index`` of ``nodes``, ``per_node`` processes each."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={index}",
            f"--nproc-per-node={per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}",
            f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={'true' if index == 0 else 'false'}"]


def run_hosts(args: Sequence[str], env: Mapping[str, str], nodes: int = 2, per_node: int = 1,
              timeout: float = 900, host_env: Sequence[Mapping[str, str]] = ()) -> list[str]:
    """Run ``args`` (a script and its arguments, or ``-m module ...``) on ``nodes`` hosts of
    ``per_node`` processes each (``host_env[i]``: host i's own variables, such as the GPUs it sees,
    ``CUDA_VISIBLE_DEVICES``); every host's stdout + stderr, after asserting that all exited 0."""
    port = free_port()
    extra = list(host_env) + [{}] * (nodes - len(host_env))
    procs = [subprocess.Popen([*host_argv(i, nodes, per_node, port), *args], env={**env, **extra[i]},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(nodes)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    assert not bad, f"hosts {bad} failed:\n" + "\n----\n".join(o[-4000:] for o in outs)
    return outs
