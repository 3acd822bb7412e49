"""Native fast paths: building them, and the one for CuPy arrays (cupy_native.cpp).

A native fast path is a C++ Python module that runs a warm ``convforge.conv2d`` call (a key from
the arrays and arguments, a table lookup, the output, the launches) without entering Python. Its
code that knows no array library is ``native_core.h``; ``convforge/torch/native.cpp`` is the one
for torch tensors, ``cupy_native.cpp`` the one for CuPy arrays.

:func:`build` compiles a source once per machine: the library goes to ``<cache_dir>/native/``
under a name that hashes the sources, Python and the compiler command, written to a temporary name
first and renamed into place, so a crash or two processes building at once never leave a broken
library behind.

:func:`load_cupy` answers the CuPy module, or None where it cannot run (``CONVFORGE_NATIVE=0``, no
C++ compiler, no CUDA driver, a CuPy whose C API differs from the one checked: logged once; calls
then take the Python fast path, which is correct, only slower). It needs neither torch nor the
CUDA toolkit: Python's headers and a C++ compiler.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from convforge.config import config

log = logging.getLogger("convforge")
HERE = Path(__file__).resolve().parent
CORE = HERE / "native_core.h"
CUPY_SOURCE = HERE / "cupy_native.cpp"
_STATE: dict[str, ModuleType | None] = {}


def compiler() -> str:
    """The C++ compiler: $CXX, else c++ or g++ on PATH."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (c++ or g++ on PATH, or CXX)")
    return cxx


def base_flags() -> list[str]:
    """Flags every native module is built with: C++20, a shared library, Python's and the core's headers."""
    return ["-O2", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-I{sysconfig.get_paths()['include']}", f"-I{HERE}"]


def build(stem: str, sources: Sequence[Path], command: Callable[[Path], list[str]], extra_tag: str = "") -> Path:
    """The library ``<stem>-<hash>.so`` for these sources (their text is hashed, with Python's version,
    ``extra_tag`` and the command), built by ``command(output)`` if missing."""
    folder = config.cache_dir / "native"
    probe = [arg.replace(str(folder), "<cache>") for arg in command(folder / "OUT")]  # the same library
    # wherever the cache folder is (a copied or moved cache finds it)
    text = [src.read_text() for src in sources]
    tag = hashlib.sha256("\0".join([*text, extra_tag, sys.version, *probe]).encode())
    path = folder / f"{stem}-{tag.hexdigest()[:16]}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    log.warning("convforge: building the native fast path %s (once per machine)", stem)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(command(Path(tmp)), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"the C++ build of {sources[0].name} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def import_extension(name: str, path: Path) -> ModuleType:
    """Load the extension module ``name`` from ``path``."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def cupy_command(output: Path) -> list[str]:
    """The compiler command that builds cupy_native.cpp into ``output``."""
    return [compiler(), *base_flags(), str(CUPY_SOURCE), "-o", str(output), "-ldl"]


def cupy_api() -> tuple[Any, ...]:
    """(cupy.ndarray, float32 dtype, and the capsules of CuPy's current stream, current device and
    array constructor) for ``setup``; ImportError naming what is missing."""
    import cupy as cp

    wanted = [("cupy_backends.cuda.stream", "get_current_stream_ptr"), ("cupy.cuda.device", "get_device_id"),
              ("cupy._core.core", "_ndarray_init")]
    caps = []
    for module, name in wanted:
        capi = getattr(importlib.import_module(module), "__pyx_capi__", {})
        if name not in capi:
            raise ImportError(f"CuPy {cp.__version__} has no C API entry {module}.{name}")
        caps.append(capi[name])
    return (cp.ndarray, cp.dtype(cp.float32), *caps)


def load_cupy() -> ModuleType | None:
    """The CuPy native module, built and set up if needed; None where it cannot run (logged once)."""
    if "cupy" in _STATE:
        return _STATE["cupy"]
    module = None
    if not config.native:
        log.info("convforge: native fast path off (CONVFORGE_NATIVE)")
    else:
        try:
            import cupy as cp

            module = import_extension("convforge_cupy_native",
                                      build("convforge_cupy_native", [CUPY_SOURCE, CORE], cupy_command,
                                            f"cupy {cp.__version__}"))
            module.setup(*cupy_api())
        except (OSError, RuntimeError, ImportError, ValueError, subprocess.SubprocessError) as err:
            log.warning("convforge: native fast path for CuPy unavailable (%s); CuPy calls take the Python "
                        "fast path", err)
            module = None
    _STATE["cupy"] = module
    return module
