"""The variant registry's first use from several threads at once (``prepare`` and ``compile_ahead``
build layers on thread pools): every thread sees the whole registry. A half-filled registry answered
"no variant applies" to 7 of 8 threads, and ``prepare`` cached that as "convforge does not run this
layer". A fresh interpreter, so the registry is loaded by the threads themselves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
RACE = """
import threading
from convforge.plan import DeviceInfo
from convforge.spec import ConvSpec
import convforge.kernels as K
dev = DeviceInfo("cuda", "nominal sm_90", cc=(9, 0), shared_optin_bytes=227 * 1024, units=132)
spec = ConvSpec(n=2, c=6, h=19, w=17, k=6, r=3, s=3, stride=(2, 2), pad=(1, 1, 1, 1), groups=6)
out, start = [], threading.Barrier(8)
def go():
    start.wait()
    try:
        out.append(K.most_specialised("auto", spec, dev)[0].name)
    except ValueError as err:
        out.append("refused: " + str(err)[:80])
threads = [threading.Thread(target=go) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(sorted(set(out)))
"""


def test_every_thread_sees_the_whole_registry() -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['depthwise']", done.stdout
