"""Where a kernel's warps wait, per SASS instruction, from an ncu source page exported as CSV
(scripts/profile_conflicts.sh, SourceCounters section): the stall-sample totals by kind of
instruction (each named barrier id on its own, mbarrier waits, WGMMA waits, ...), then the
instructions with the most samples. Session 15: which of the hdim 256 backward's barriers hold the
"barrier" stall samples that ncu's kernel-wide counters cannot place."""
import re
import sys
from collections import defaultdict

from ncu_source import load, num

header, body = load(sys.argv[1])
src = header.index("Source")
cols = [i for i, c in enumerate(header) if "Stall Sampling" in c]
print("stall columns:", [header[i] for i in cols])
if not cols:
    print("header:", header)
    sys.exit(0)
main = next((i for i in cols if "All" in header[i]), cols[0])


def kind(sass: str) -> str:
    """The instruction's class; named barriers by id, so that each barrier's waits count apart."""
    op = sass.split()[0] if sass.split() else ""
    if op.startswith("@"):  # predicate guard
        parts = sass.split()
        op = parts[1] if len(parts) > 1 else op
    if op.startswith("BAR."):
        m = re.search(r"BAR\.\S+\s+(0x[0-9a-f]+|\d+|R\d+)", sass)
        return f"{op.split('.')[0]}.{op.split('.')[1]} id {m.group(1) if m else '?'}"
    if op.startswith(("SYNCS.PHASECHK", "SYNCS.ARRIVE", "WARPGROUP.")):
        return op.split(".")[0] + "." + op.split(".")[1]
    return op.split(".")[0]


total = sum(num(r[main]) for r in body if len(r) > main)
by_kind = defaultdict(float)
for r in body:
    if len(r) > main:
        by_kind[kind(r[src].strip())] += num(r[main])
print(f"total samples ({header[main]}): {total:,.0f}")
for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])[:20]:
    print(f"{v:>14,.0f}  {100 * v / max(total, 1):5.1f}%  {k}")
print("top instructions:")
body = [r for r in body if len(r) > main]
body.sort(key=lambda r: -num(r[main]))
for r in body[:30]:
    addr = r[0]
    print(f"{num(r[main]):>12,.0f}  " + "  ".join(r[i] for i in cols) + f"  {addr}  {r[src].strip()[:80]}")
