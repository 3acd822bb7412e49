"""Back-ends: ``get_backend("cuda"|"opencl")``. Vendor APIs are imported only in cuda.py and opencl.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from convforge.backends.base import Backend

_INSTANCES: dict[str, Backend] = {}


def get_backend(name: str, device: str | int | None = None) -> Backend:
    """The shared back-end instance for ``name`` and device (compiled programs are cached in it).
    A CUDA device is an index; None means the current device at this call (so ``get_backend("cuda")``
    is ``get_backend("cuda", 0)`` while device 0 is current, and follows ``torch.cuda.set_device``
    in a process that owns another GPU), never a device fixed by whichever call came first."""
    if name == "cuda":
        device = _cuda_index(device)
    key = f"{name}:{device}"
    if key not in _INSTANCES:
        if name == "cuda":
            try:
                from convforge.backends.cuda import CudaBackend
            except ImportError as err:
                raise ValueError(f"backend 'cuda' needs CuPy ({err}); pip install 'convforge[cuda]' on a machine "
                                 "with an NVIDIA GPU, or use backend 'opencl'") from None

            _INSTANCES[key] = CudaBackend(None if device is None else int(device))
        elif name == "opencl":
            try:
                from convforge.backends.opencl import OpenCLBackend
            except ImportError as err:
                raise ValueError(f"backend 'opencl' needs pyopencl ({err}); pip install 'convforge[opencl]' "
                                 "(PyOpenCL with PoCL, a CPU device)") from None

            _INSTANCES[key] = OpenCLBackend(None if device is None else str(device))
        else:
            raise ValueError(f"backend ({name!r}) must be 'cuda' or 'opencl'")
    return _INSTANCES[key]


def _cuda_index(device: str | int | None) -> int | None:
    """A CUDA device as an int index (None: the current device; None when CuPy is missing, so that
    get_backend says what is missing)."""
    if device is not None:
        try:
            return int(device)
        except (TypeError, ValueError):
            raise ValueError(f"CUDA device ({device!r}) must be an index such as 0") from None
    try:
        from convforge.backends.cuda import current_device
    except ImportError:
        return None
    return current_device()


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        from convforge.backends.cuda import device_count
    except Exception:  # noqa: BLE001 - no cupy, or a broken install: no CUDA
        return False
    return device_count() > 0


def opencl_available() -> bool:
    try:
        from convforge.backends.opencl import list_devices
    except Exception:  # noqa: BLE001
        return False
    return bool(list_devices())
