"""Reading an ncu source page exported as CSV (`ncu -i REPORT --page source --print-source sass
--csv`), for scripts/top_conflicts.py and scripts/top_stalls.py."""
import csv
import sys


def load(path):
    """(header, rows) of the source page; exits with the first lines shown if it has no header."""
    rows = list(csv.reader(open(path, newline="")))
    header_at = next((i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r)), None)
    if header_at is None:
        print("no header found; first lines:", rows[:3])
        sys.exit(0)
    return rows[header_at], rows[header_at + 1:]


def num(text):
    """A cell as a number (ncu writes thousands separators); 0 for anything else."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0
