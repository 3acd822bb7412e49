"""The command line's short address: ``python -m convforge.cli`` (and ``torchrun -m convforge.cli``)
runs :func:`convforge.apps.cli.main`; importing ``convforge.cli`` gives that module itself. The
commands live in :mod:`convforge.apps`; nothing in the library imports this module."""

from __future__ import annotations

import sys

from convforge.apps import cli as _cli

if __name__ == "__main__":
    sys.exit(_cli.main())
sys.modules[__name__] = _cli
