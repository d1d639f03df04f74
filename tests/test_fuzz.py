"""`flashhopper fuzz`'s draws, on the CPU: stratified over every (dtype, hdim, mask, softcap,
deterministic), reproducible, within the reference's memory, every case's reproducer parses back."""

from __future__ import annotations

from flashhopper.fuzz import _MAX_SCORES, Case, draw, kernels_of, strata
from flashhopper.plan import dispatched_kernels


def test_draws_are_stratified_reproducible_and_bounded():
    table = strata()
    cases = [draw(i, seed=7) for i in range(2 * len(table))]
    assert {(c.dtype, c.hdim, c.mask, c.softcap, c.deterministic) for c in cases} == set(table)
    assert cases == [draw(i, seed=7) for i in range(2 * len(table))]
    assert cases != [draw(i, seed=8) for i in range(2 * len(table))]
    for c in cases:
        assert Case.from_json(c.to_json()) == c
        assert c.b * c.hq * c.sq * c.sk <= _MAX_SCORES and c.hq % c.hk == 0
        assert c.layout != "packed" or (c.sq == c.sk and c.hq == c.hk)


def test_a_thousand_cases_reach_most_dispatched_kernels():
    hit = set().union(*(kernels_of(draw(i, seed=0), backward=True) for i in range(1000)))
    reachable = {c for c in dispatched_kernels() if not getattr(c, "varlen", False)}  # varlen: not drawn yet
    assert hit <= reachable
    assert len(hit) >= 0.8 * len(reachable), (len(hit), len(reachable))
