"""`flashhopper bench --varlen` with one more provider taking turns with the others: flashhopper with the
varlen backward's sequences in the caller's order (runtime.longest_first the identity for its calls), the
A / B of the backward's launch order (docs/design.md, "Varlen backward launch order").

    python3 scripts/varlen_bwd_order.py --quick --bwd --allocations 20 --json out.json

The arguments after the script's name are `flashhopper bench --varlen`'s.
"""

from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flashhopper.bench.varlen as V  # noqa: E402
import flashhopper.hopper.runtime as R  # noqa: E402
from flashhopper.cli import main  # noqa: E402

_longest_first = R.longest_first


@contextlib.contextmanager
def callers_order():
    R.longest_first = lambda *per_sequence: per_sequence
    try:
        yield
    finally:
        R.longest_first = _longest_first


_providers = V.varlen_providers


def providers(out=sys.stdout):
    chosen = _providers(out)
    fh = V.flashhopper_varlen()
    chosen.insert(1, V.VarlenProvider("fh-unsorted", fh.make, fh.make_bwd, callers_order))
    return chosen


if __name__ == "__main__":
    V.varlen_providers = providers
    sys.exit(main(["bench", "--varlen", *sys.argv[1:]]))
