"""NumPy arrays: an executable run on the host's arrays (uploaded, run, the output downloaded)."""

from __future__ import annotations

from typing import Any

import numpy as np

from convforge.backends.base import Backend, Executable, output_buffer


def run_host(be: Backend, exe: Executable, inputs: dict[str, Any]) -> np.ndarray:
    """Run ``exe`` on host arrays by buffer name (None: absent): upload them, allocate the buffer
    its plan writes (y, x, w or bias), run, download that buffer."""
    spec = exe.plan.spec
    out = output_buffer(exe.plan)
    shape = spec.shape_of(out)
    bufs = {name: be.upload(a) for name, a in inputs.items() if a is not None}
    bufs[out] = be.empty(spec.itemsize * int(np.prod(shape)))
    exe(bufs)
    got = be.download(bufs[out], shape, spec.dtype)
    return got.astype(np.float16) if spec.dtype == "float16" else got  # exact: the kernel stored float16
