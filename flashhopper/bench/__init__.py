"""Speed measurements on the field's standard grid (see docs: targets.md).

Only `grid` is importable without a GPU; `runner` needs CUDA at call time.
"""

from flashhopper.bench.grid import Point, attention_flops, quick_grid, standard_grid

__all__ = ["Point", "attention_flops", "quick_grid", "standard_grid"]
