"""Compare the choices of two tuning databases of the same layers (scripts/gpu-multi: one GPU against
``--devices all``): per layer, the two winners, and whether each run's winner was measured by the
other run within ``--slack`` of that run's own winner plus ``--floor-ms`` (the same choice given the
same measurements, up to timing noise between runs; the floor is the launch jitter of a layer of
~10 us). Exit status 1 when a layer is missing or differs beyond the slack.

    python scripts/multi_compare.py ONE.sqlite ALL.sqlite [--slack 1.10] [--floor-ms 0.005]
"""

from __future__ import annotations

import argparse
import sys

from convforge.tune.db import TuningDB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("one")
    p.add_argument("other")
    p.add_argument("--slack", type=float, default=1.10)
    p.add_argument("--floor-ms", type=float, default=0.005)
    args = p.parse_args(argv)
    dbs = TuningDB(args.one, readonly=True), TuningDB(args.other, readonly=True)
    a, b = ({e.key: e for e in db.entries()} for db in dbs)
    bad = 0
    for key in sorted(a.keys() | b.keys()):
        if key not in a or key not in b:
            print(f"{key[2]} {key[4]}: only in {'one' if key in a else 'other'}")
            bad += 1
            continue
        same = (a[key].variant, a[key].params) == (b[key].variant, b[key].params)
        notes = []
        for x, y, db, name in ((a[key], b[key], dbs[0], "one"), (b[key], a[key], dbs[1], "other")):
            times = {(m.variant, m.params): m.time_ms for m in db.measurements(key) if m.time_ms}
            t = times.get((y.variant, y.params))
            if t is None:
                notes.append(f"{name} never measured the other's choice")
            elif t > args.slack * x.time_ms + args.floor_ms:
                notes.append(f"{name} measured the other's choice at {t / x.time_ms:.2f}x its own")
        bad += bool(notes)
        print(f"{key[2]} {key[4] or '-'}: {'same' if same else 'differs'}: {a[key].variant} {a[key].time_ms:.4f} ms / "
              f"{b[key].variant} {b[key].time_ms:.4f} ms" + (f"  [{'; '.join(notes)}]" if notes else ""))
    print(f"{len(a)} / {len(b)} layers; {bad} beyond the slack ({args.slack:g}x + {args.floor_ms:g} ms)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
