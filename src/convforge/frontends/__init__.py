"""Array kinds: what convforge does differently for NumPy arrays, CuPy arrays and torch CUDA tensors.

``kinds`` (which kind an array is, its device, its memory layout, a padded copy), ``checks`` (the
validation of a first call: rank, dtype, layout, options), ``keys`` (the fast path's call keys),
``numpy_run``, ``torch_run`` and ``cupy_run`` (a compiled executable run on arrays of each kind) and
``fast_path`` (the native fast paths: loading them, filing validated calls with them, making their
C entry ``convforge.conv2d``). ``api.py`` and ``grad.py`` call them; no module here imports either.
"""
