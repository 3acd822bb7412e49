"""The applications: the ``convforge`` command and its sub-commands (``cli``; ``bench``, ``tune`` and
``db``, ``run``). They import the library; nothing in the library imports them."""
