"""Medians of a tune_fwd.py log: one line per (point, override), TFLOP/s median [min-max] over the
rounds, and the change against the point's dispatch ({}). Usage: python scripts/tune_medians.py LOG"""
import re
import statistics
import sys
from collections import defaultdict

LINE = re.compile(r"^(hdim .*?) (\{.*\}): +([0-9.]+) TFLOP/s")


def main(path):
    runs = defaultdict(list)
    for line in open(path):
        m = LINE.match(line.strip())
        if m:
            runs[(m.group(1), m.group(2))].append(float(m.group(3)))
    base = {point: statistics.median(v) for (point, over), v in runs.items() if over == "{}"}
    for (point, over), v in runs.items():
        med = statistics.median(v)
        rel = f" ({100 * (med / base[point] - 1):+.1f}%)" if point in base and over != "{}" else ""
        print(f"{point} {over}: {med:.1f} [{min(v):.0f}-{max(v):.0f}] n={len(v)}{rel}")


if __name__ == "__main__":
    main(sys.argv[1])
