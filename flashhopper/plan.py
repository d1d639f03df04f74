"""Which kernel a call runs, from its dtype, head dim, lengths and flags alone (no DSL, no torch),
and the set of every kernel a user can reach: what `flashhopper precompile` compiles and what the
tests enumerate."""

from __future__ import annotations

import itertools

from flashhopper.config import (
    BWD_HDIMS,
    DTYPES,
    SUPPORTED_HDIMS,
    BwdConfig,
    BwdPreConfig,
    FwdConfig,
    bwd_config,
    bwd_per_call,
    bwd_with_overrides,
    fwd_config,
    fwd_narrow_tile,
    fwd_short_causal,
    fwd_short_nomask,
    fwd_short_qring,
)

# an unbounded window side is passed as a huge window so the kernels' arithmetic stays uniform
UNBOUNDED = 1 << 30


def mask_kind(causal: bool, window_size) -> tuple[bool, bool, int, int]:
    """(causal kernel, local kernel, window_left, window_right) as the kernels take them.

    Causal is a right window of 0; with any other bound the kernel is the local one."""
    window_left, window_right = int(window_size[0]), int(window_size[1])
    if causal:
        window_right = 0
    local = window_left >= 0 or (window_right >= 0 and not causal)
    wl = window_left if window_left >= 0 else UNBOUNDED
    wr = window_right if window_right >= 0 else UNBOUNDED
    return causal and not local, local, wl, wr


def fwd_plan(dtype: str, hdim: int, sq: int, sk: int, causal: bool, window_size,
             softcap: bool) -> tuple[FwdConfig, int, int]:
    """The forward's (config, window_left, window_right) for a call."""
    causal, local, wl, wr = mask_kind(causal, window_size)
    cfg = fwd_config(dtype, hdim, causal=causal, local=local, softcap=softcap,
                     narrow=fwd_narrow_tile(hdim, sq, causal and not local),
                     short=(fwd_short_causal(hdim, sq, sk, not local) if causal
                            else fwd_short_nomask(hdim, sq, sk, local)),
                     qring=fwd_short_qring(hdim, sq, sk, local))
    return cfg, wl, wr


def bwd_plan(dtype: str, hdim: int, sq: int, sk: int, causal: bool, window_size, softcap: bool,
             deterministic: bool, **overrides) -> tuple[BwdConfig, bool, bool, int, int]:
    """The backward's (config, causal kernel, local kernel, window_left, window_right) for a call;
    `overrides` (tests, tuning) replace the dispatched fields."""
    causal, local, wl, wr = mask_kind(causal, window_size)
    cfg = bwd_config(dtype, hdim, causal=causal, local=local, softcap=softcap, deterministic=deterministic,
                     **bwd_per_call(hdim, sq, sk, causal, deterministic, softcap))
    # an override wins over a per-call choice it rules out (tile_m=80 over the short causal 64 rows
    # with their interleaved dQ), as over a per-hdim one
    return (bwd_with_overrides(cfg, **overrides) if overrides else cfg), causal, local, wl, wr


# Lengths that reach every per-call class of the dispatch: the edges of each bracket in config.py
# (512, 1024, 2048, 8192 and one past), paddings of 128- and 192-row tiles, short and long.
_LENGTHS = (1, 100, 128, 129, 200, 256, 300, 512, 513, 700, 1024, 1025, 2048, 2049, 4096, 8192, 8193, 16384)
# no mask, causal, a window (the local kernel; its bounds are runtime arguments)
MASKS = ((False, (-1, -1)), (True, (-1, -1)), (False, (128, 0)))


def dispatched_kernels(dtypes=DTYPES, hdims=SUPPORTED_HDIMS, forward: bool = True,
                       backward: bool = True) -> list:
    """Every kernel config a call can dispatch for these dtypes and head dims (forward, backward
    main kernel, backward preprocess), each once, in a stable order."""
    seen: dict = {}
    for dtype, hdim in itertools.product(dtypes, hdims):
        for (causal, window), softcap, sq, sk in itertools.product(MASKS, (False, True), _LENGTHS, _LENGTHS):
            if forward:
                seen.setdefault(fwd_plan(dtype, hdim, sq, sk, causal, window, softcap)[0])
            if backward and hdim in BWD_HDIMS:
                for deterministic in (False, True):
                    cfg = bwd_plan(dtype, hdim, sq, sk, causal, window, softcap, deterministic)[0]
                    seen.setdefault(cfg)
                    seen.setdefault(BwdPreConfig.of(cfg))
    return list(seen)
