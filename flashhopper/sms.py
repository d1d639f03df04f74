"""How many SMs flashhopper plans its grids for: the device's SM count less an SM margin (FA3's
`sm_margin`), left free for kernels that run beside ours, such as NCCL's during ring attention.

The persistent forward grids (dense, varlen, the split decode walk) launch at most that many CTAs, and
the split-KV heuristics (flashhopper/splitkv.py) fill that many. The margin is set for a block of calls
(`with sm_margin(8): ...`: a context variable, so threads and tasks each keep their own) and read when a
call launches: a CUDA graph keeps the grid it was captured with. The backward's grids are not persistent
and take no margin.
"""

from __future__ import annotations

import contextvars
import numbers

_MARGIN = contextvars.ContextVar("flashhopper_sm_margin", default=0)


def check_margin(margin) -> int:
    """`margin` as an int >= 0, or ValueError naming sm_margin."""
    if isinstance(margin, bool) or not isinstance(margin, numbers.Integral) or margin < 0:
        raise ValueError(f"sm_margin must be an int >= 0 (SMs left free for other kernels), got {margin!r}")
    return int(margin)


class sm_margin:  # noqa: N801  (used as a function: `with sm_margin(8): ...`)
    """Leave `margin` SMs free for the calls made inside the block (0: none). A class rather than a
    generator: FA3's entry points enter one on every call, where this costs a few hundred ns less."""

    __slots__ = ("_margin", "_token")

    def __init__(self, margin: int):
        self._margin = check_margin(margin)

    def __enter__(self):
        self._token = _MARGIN.set(self._margin)

    def __exit__(self, *exc) -> None:
        _MARGIN.reset(self._token)


def current_margin() -> int:
    return _MARGIN.get()


def available(sm_count: int) -> int:
    """The SMs a grid may fill out of `sm_count`: less the margin, at least one."""
    return max(1, int(sm_count) - _MARGIN.get())
