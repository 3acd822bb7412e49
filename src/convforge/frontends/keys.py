"""The fast path's call keys: a flat tuple of cheap attributes of a device call (types, shapes,
dtypes, devices, contiguity, the arguments, the configuration's precision settings) under which
``dispatch.RUNNERS`` holds the runner the slow path prepared for it. A key is made only of what
the slow path validated, so a hit needs no further checking.

``relu`` enters with its class unless it is a bool: 1 equals True as a key, and would find a
relu=True runner that the slow path (which wants a bool) never checked it for; ``groups`` likewise
unless it is an int. A key function raises TypeError or AttributeError for arrays of another
kind than the one it was registered for (the caller then takes the slow path, which says why)."""

from __future__ import annotations

from typing import Any

from convforge.config import config


def torch_key(x: Any, w: Any, b: Any, stride: Any, padding: Any, dilation: Any, algo: Any, backend: Any,
              workspace_limit: Any, relu: Any, params: Any, precision: Any, max_error: Any,
              groups: Any = 1) -> tuple[Any, ...]:
    """The key of ``conv2d``'s call on torch tensors (its 14 arguments but padding_mode)."""
    return (type(x), type(w), x.shape, w.shape, x.dtype, w.dtype, x.device, w.device,
            x.is_contiguous() or x.stride(), w.is_contiguous(),  # strides tell channels_last from other views
            b is None or (type(b), b.shape, b.dtype, b.device, b.is_contiguous()),
            stride, padding, dilation, algo, backend, workspace_limit,
            relu if relu.__class__ is bool else (relu.__class__, relu), params, precision, max_error,
            groups if groups.__class__ is int else (groups.__class__, groups),
            config.precision, config.max_error, config.autotune, config.db_path, config.finite_exact)


def cupy_key(x: Any, w: Any, b: Any, stride: Any, padding: Any, dilation: Any, algo: Any, backend: Any,
             workspace_limit: Any, relu: Any, params: Any, precision: Any, max_error: Any,
             groups: Any = 1) -> tuple[Any, ...]:
    """The key of ``conv2d``'s call on CuPy arrays."""
    return (type(x), type(w), x.shape, w.shape, x.dtype, w.dtype, x.data.device_id, w.data.device_id,
            x.flags.c_contiguous, w.flags.c_contiguous,
            b is None or (type(b), b.shape, b.dtype, b.data.device_id, b.flags.c_contiguous),
            stride, padding, dilation, algo, backend, workspace_limit,
            relu if relu.__class__ is bool else (relu.__class__, relu), params, precision, max_error,
            groups if groups.__class__ is int else (groups.__class__, groups),
            config.precision, config.max_error, config.autotune, config.db_path, config.finite_exact)


def torch_pass_key(tag: str, a: Any, g: Any, size: Any, stride: Any, padding: Any, dilation: Any, groups: Any,
                   algo: Any, backend: Any, workspace_limit: Any, params: Any, precision: Any,
                   max_error: Any) -> tuple[Any, ...]:
    """The key of a backward pass's call on torch tensors (``grad.py``; ``tag``: dgrad, wgrad or bias;
    ``a`` the weight or the input, ``g`` grad_output)."""
    return (tag, type(a), type(g), a.shape, g.shape, a.dtype, g.dtype, a.device, g.device,
            a.is_contiguous() or a.stride(), g.is_contiguous() or g.stride(),  # strides tell channels_last apart
            size, stride, padding, dilation, groups, algo, backend, workspace_limit, params, precision, max_error,
            config.precision, config.max_error, config.autotune, config.db_path, config.finite_exact)


def cupy_pass_key(tag: str, a: Any, g: Any, size: Any, stride: Any, padding: Any, dilation: Any, groups: Any,
                  algo: Any, backend: Any, workspace_limit: Any, params: Any, precision: Any,
                  max_error: Any) -> tuple[Any, ...]:
    """The key of a backward pass's call on CuPy arrays."""
    return (tag, type(a), type(g), a.shape, g.shape, a.dtype, g.dtype, a.data.device_id, g.data.device_id,
            a.flags.c_contiguous, g.flags.c_contiguous, size, stride, padding, dilation, groups, algo, backend,
            workspace_limit, params, precision, max_error, config.precision, config.max_error, config.autotune,
            config.db_path)
