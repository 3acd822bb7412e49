"""The one hot path shared by ``conv2d``, ``convforge.torch`` and the network runtime.

``choice`` owns *which* variant and parameters run a spec on a device within a precision class and
workspace limit (tuning database first, then autotuning when enabled, then the heuristic);
``executables`` owns the compiled, launch-ready executable for that choice (the caches). A warm
call is a dictionary hit and a launch.
"""

from __future__ import annotations

from convforge.dispatch.choice import Choice, choose, clear_choices, is_fast, measure_dispatch, slow_reason
from convforge.dispatch.executables import RUNNERS, clear_executables, executable, layout_runner, runner

__all__ = ["Choice", "choose", "clear_choices", "executable", "clear_executables", "runner", "layout_runner",
           "RUNNERS", "is_fast", "slow_reason", "measure_dispatch"]
