"""``convforge tune`` and ``convforge db``: the commands, their multi-GPU workers and their reports
(the tuner and the database they drive are the library's :mod:`convforge.tune`)."""
