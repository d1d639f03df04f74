"""`flashhopper fuzz`'s draws, on the CPU: stratified over every (dtype, hdim, mask, softcap,
deterministic, varlen), reproducible, within the reference's memory, every case's reproducer parses back."""

from __future__ import annotations

from flashhopper.fuzz import _MAX_SCORES, Case, draw, kernels_of, strata
from flashhopper.plan import dispatched_kernels


def test_draws_are_stratified_reproducible_and_bounded():
    table = strata()
    cases = [draw(i, seed=7) for i in range(2 * len(table))]
    assert {(c.dtype, c.hdim, c.mask, c.softcap, c.deterministic, c.varlen) for c in cases} == set(table)
    assert cases == [draw(i, seed=7) for i in range(2 * len(table))]
    assert cases != [draw(i, seed=8) for i in range(2 * len(table))]
    for c in cases:
        assert Case.from_json(c.to_json()) == c
        assert c.varlen or c.b * c.hq * c.sq * c.sk <= _MAX_SCORES  # (varlen: per sequence, below)
        assert c.hq % c.hk == 0
        assert c.layout != "packed" or (c.sq == c.sk and c.hq == c.hk)
        if c.varlen:  # every sequence within the reference's memory, seqused within each
            assert all(c.hq * lq * lk <= _MAX_SCORES for lq, lk in c.seqlens)
            assert all(0 <= uq <= lq and 0 <= uk <= lk
                       for (lq, lk), (uq, uk) in zip(c.seqlens, c.seqused or c.seqlens, strict=True))


def test_a_thousand_cases_reach_most_dispatched_kernels():
    hit = set().union(*(kernels_of(draw(i, seed=0), backward=True) for i in range(1000)))
    reachable = set(dispatched_kernels())
    assert hit <= reachable
    assert len(hit) >= 0.8 * len(reachable), (len(hit), len(reachable))
