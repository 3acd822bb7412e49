"""The native fast path for torch tensors: native.cpp, built once per machine and torch version.

``load()`` answers the loaded module, or None (no CUDA device, ``CONVFORGE_NATIVE=0``, no C++
compiler or CUDA headers, a failed build: logged once; calls then take the Python fast path,
which is correct, only slower: ~14 us of host time per call instead of ~5). The build runs the
C++ compiler against the installed torch's headers and libraries (about 30 s, once); the library
goes to ``<cache_dir>/native/`` under a name that hashes the source, torch, Python and the
compiler command, written to a temporary name first and renamed into place, so a crash or two
processes building at once never leave a broken library behind.

What the module does (native.cpp): ``run(13 conv2d arguments)`` answers the output or None;
``register(13 arguments, program, seed)`` files a call validated by the slow path
(``CudaExecutable.native_program``; ``seed``: filters the slow path made for the call's weights);
``wrap(conv2d)`` is conv2d as a C callable (warm calls never enter Python, others go to the
function it wraps); ``clear()`` forgets every entry (on a configuration change or
``clear_executables``); ``stats()`` answers the number of entries and two counters (filter
transforms run, op calls that went to Python); ``register_op(cuda_fallback, grad_apply)`` makes
the ``convforge::conv2d`` op's CUDA and Autograd kernels C++.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import torch

from convforge.config import config

log = logging.getLogger("convforge")
SOURCE = Path(__file__).with_name("native.cpp")
_STATE: dict[str, ModuleType | None] = {}


def load() -> ModuleType | None:
    """The native module, built if needed; None where it cannot run (the reason logged once)."""
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
    _STATE["module"] = module
    if module is not None:
        _install(module)
    return module


# conv2d's defaults as native.cpp's C entry assumes them (wrap): checked before it takes over
DEFAULTS = (None, 1, 0, 1, "auto", None, None, False, None, None, None)


def _install(module: ModuleType) -> None:
    """Route warm torch calls through ``module``: the Python conv2d asks it first, and where
    conv2d's defaults are the ones the C entry assumes, ``convforge.conv2d`` (and
    ``convforge.api.conv2d``) become that C entry, which hands every call it does not run, unchanged,
    to ``api.python_conv2d`` (conv2d past the native lookup); ``__wrapped__`` is conv2d (same
    signature and docstring)."""
    import convforge
    from convforge import api, dispatch

    python = api.conv2d
    params = list(inspect.signature(api.python_conv2d).parameters.values())[2:]
    fast = None
    if tuple(p.default for p in params) != DEFAULTS:
        log.warning("convforge: conv2d's defaults differ from native.cpp's: its C entry is not installed")
    else:  # a miss goes to the Python path past the native lookup it just made
        fast = functools.update_wrapper(module.wrap(api.python_conv2d), python)
    config.on_change(module.clear)
    dispatch.ON_CLEAR.append(module.clear)
    api.set_native(module)
    if fast is not None:
        api.conv2d = fast
        convforge.conv2d = fast  # type: ignore[attr-defined]


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
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (c++ or g++ on PATH, or CXX)")
    root = Path(torch.__file__).resolve().parent
    lib = root / "lib"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [cxx, "-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{_cuda_include()}", str(SOURCE), "-o", str(output),
            f"-L{lib}", "-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}", "-ldl"]


def _built() -> Path:
    """The library for this source, torch, Python and compiler command, built if missing."""
    folder = config.cache_dir / "native"
    probe = command(folder / "OUT")
    tag = hashlib.sha256("\0".join([SOURCE.read_text(), torch.__version__, sys.version, *probe]).encode())
    path = folder / f"convforge_native-{tag.hexdigest()[:16]}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    log.warning("convforge: building the native fast path for torch tensors (once per machine, ~30 s)")
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(command(Path(tmp)), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the C++ build of {SOURCE.name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("convforge_native", str(path))
    spec = importlib.util.spec_from_file_location("convforge_native", str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
