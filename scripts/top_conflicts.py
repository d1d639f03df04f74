"""Print the SASS instructions with the most excess shared-memory wavefronts from an ncu source
page exported as CSV (scripts/profile_conflicts.sh): totals of the shared-wavefront columns, then
the instructions sorted by "L1 Wavefronts Shared Excessive"."""
import sys

from ncu_source import load, num

header, body = load(sys.argv[1])
src = header.index("Source")
cols = [i for i, c in enumerate(header) if "Wavefronts Shared" in c or "Conflicts Shared" in c]
excess = next((i for i in cols if "Excessive" in header[i]), None)
sums = [i for i in cols if "N-Way" not in header[i]]
print("totals:", {header[i]: sum(num(r[i]) for r in body if len(r) > i) for i in sums})
if excess is not None:
    body.sort(key=lambda r: -num(r[excess]) if len(r) > excess else 0)
    for r in body[:25]:
        if len(r) > excess and num(r[excess]) > 0:
            print(f"{num(r[excess]):>14,.0f}  " + "  ".join(r[i] for i in cols) + f"  {r[src][:90]}")
