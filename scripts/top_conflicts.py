"""Print the SASS instructions with the most excess shared-memory wavefronts from an ncu source
page exported as CSV (scripts/profile_conflicts.sh). Column names vary across ncu versions: any
column whose name mentions excessive / bank conflicts is used."""
import csv
import sys

rows = list(csv.reader(open(sys.argv[1], newline="")))
header_at = next((i for i, r in enumerate(rows) if any("Source" in c or "Address" in c for c in r)), None)
if header_at is None:
    print("no header found; first lines:", rows[:3])
    sys.exit(0)
header, body = rows[header_at], rows[header_at + 1:]
keys = [i for i, c in enumerate(header) if "xcessive" in c or "Bank" in c or "onflict" in c]
src = next((i for i, c in enumerate(header) if c.strip() == "Source"), 1)
print("columns:", [header[i] for i in keys])


def num(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


total = {i: sum(num(r[i]) for r in body if len(r) > i) for i in keys}
print("totals:", {header[i]: total[i] for i in keys})
if keys:
    k = keys[0]
    body.sort(key=lambda r: -num(r[k]) if len(r) > k else 0)
    for r in body[:25]:
        if len(r) > k and num(r[k]) > 0:
            print(f"{num(r[k]):>14,.0f}  {r[src][:110]}")
