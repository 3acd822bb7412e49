"""The native fast path for torch tensors: native.cpp, built once per machine and torch version.

``load()`` answers the loaded module, or None (no CUDA device, ``CONVFORGE_NATIVE=0``, no C++
compiler or CUDA headers, a failed build: logged once; calls then take the Python fast path,
which is correct, only slower: ~14 us of host time per call instead of ~5). The build runs the
C++ compiler against the installed torch's headers and libraries (about 30 s, once); the library
goes to ``<cache_dir>/native/`` under a name that hashes the source, torch, Python and the
compiler command, written to a temporary name first and renamed into place, so a crash or two
processes building at once never leave a broken library behind.

What the module does (native.cpp): ``run(14 conv2d arguments)`` answers the output or None;
``register(14 arguments, program, seed)`` files a call validated by the slow path
(``CudaExecutable.native_program``; ``seed``: filters the slow path made for the call's weights);
``wrap(conv2d)`` is conv2d as a C callable (warm calls never enter Python, others go to the
function it wraps); ``clear()`` forgets every entry (on a configuration change or
``clear_executables``); ``stats()`` answers the number of entries and two counters (filter
transforms run, op calls that went to Python); ``register_op(cuda_fallback, grad_apply)`` makes
the ``convforge::conv2d`` op's CUDA and Autograd kernels C++. native.cpp holds the fast call and
the module; it includes native_ops.inc (the ops' kernels), native_nodes.inc (the C++ autograd
nodes), native_mlp.inc (ConvNeXt's MLP nodes in training, torch/mlp_train.py), native_layers.inc
(max pooling and squeeze-and-excitation) and, built with
``CONVFORGE_NATIVE_PROFILE=1`` only (a library of its own), native_profile.inc (``parts()``: where a
warm call's host time goes, for scripts/host_cost.py).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from convforge.backends import native
from convforge.config import config

log = logging.getLogger("convforge")
SOURCE = Path(__file__).with_name("native.cpp")
# The files native.cpp includes, by concern (hashed with it: an edit to any rebuilds the library)
PARTS = tuple(Path(__file__).with_name(f"native_{part}.inc") for part in ("ops", "nodes", "mlp", "layers", "profile"))
_STATE: dict[str, ModuleType | None] = {}


def load() -> ModuleType | None:
    """The native module, built if needed; None where it cannot run (the reason logged once). It is
    only built and answered here: ``frontends/fast_path.py`` (``load_torch``) installs it."""
    if "module" in _STATE:
        return _STATE["module"]
    module = None
    if not config.native:
        log.info("convforge: native fast path off (CONVFORGE_NATIVE)")
    elif not torch.cuda.is_available():
        log.info("convforge: native fast path not built: torch sees no CUDA device")
    else:
        try:
            module = _import(_built())
        except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as err:
            log.warning("convforge: native fast path unavailable (%s); torch calls take the Python fast path", err)
    if module is not None:
        module.set_native_autograd(bool(config.native_autograd))  # CONVFORGE_NATIVE_AUTOGRAD, on by default
        module.set_residual_grad(bool(config.residual_grad))  # CONVFORGE_RESIDUAL_GRAD, on by default
    _STATE["module"] = module
    return module


def _cuda_include() -> str:
    """A folder holding cuda_runtime_api.h (the toolkit's, else the CUDA runtime wheel's)."""
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", "")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots.append("/usr/local/cuda")
    found = [os.path.join(r, "include") for r in roots if r]
    for entry in sys.path:
        found += glob.glob(os.path.join(entry, "nvidia", "cu*", "include"))
        found += glob.glob(os.path.join(entry, "nvidia", "cuda_runtime", "include"))
    for folder in found:
        if os.path.isfile(os.path.join(folder, "cuda_runtime_api.h")):
            return folder
    raise RuntimeError("no CUDA headers (cuda_runtime_api.h): set CUDA_HOME or install the CUDA toolkit")


def command(output: Path) -> list[str]:
    """The compiler command that builds native.cpp into ``output`` against the installed torch."""
    root = Path(torch.__file__).resolve().parent
    lib = root / "lib"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    profile = ["-DCONVFORGE_NATIVE_PROFILE"] if config.native_profile else []  # native_profile.inc: parts()
    return [native.compiler(), *native.base_flags(), *profile, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{_cuda_include()}", str(SOURCE),
            "-o", str(output), f"-L{lib}", "-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_python",
            f"-Wl,-rpath,{lib}", "-ldl"]


def _built() -> Path:
    """The library for this source, torch, Python and compiler command, built if missing (~30 s)."""
    return native.build("convforge_native", [SOURCE, *PARTS, native.CORE], command, f"torch {torch.__version__}")


def _import(path: Path) -> ModuleType:
    return native.import_extension("convforge_native", path)
