"""Which kernel a call runs: the dispatch tables (each with a one-line reason; the measurements are
in docs/decisions.md), the config each (dtype, head dim, mask, lengths) gets, and the set of every
kernel a user can reach (what `flashhopper precompile` compiles and the tests enumerate). Plain
Python: no DSL, no torch. The configs' fields and budgets are in config.py."""

from __future__ import annotations

import dataclasses
import functools
import itertools

from flashhopper.config import (
    BWD_HDIMS,
    DTYPES,
    FP8_DTYPES,
    SPLIT_HDIMS,
    SUPPORTED_HDIMS,
    BwdConfig,
    BwdPreConfig,
    CombineConfig,
    FwdConfig,
    bwd_with_overrides,
)

# (tile_m, tile_n) per hdim; tile_m / 64 consumer warpgroups: the fastest measured (docs/decisions.md)
_TILES = {64: (192, 128), 96: (128, 128), 128: (128, 128), 192: (128, 112), 256: (128, 80)}
# causal / local masks: the same tiles, as in FA3 (hdim 64 at 192 rows: +10% at 8k)
_TILES_CAUSAL = dict(_TILES)
# a local window keeps hdim 64 at 128 rows (192 rows ran 15-20% slower on masked edge blocks)
_TILES_LOCAL = {**_TILES_CAUSAL, 64: (128, 128)}
# causal only: narrower query tiles where the wide one pads the query length (decisions.md)
_TILES_NARROW = {64: (128, 128)}
# how much more padding (ratio of padded query rows) the wide tile may cost before the narrow one
# is taken: 2048 queries pad 3% at 192 rows and that tile was still the faster
_NARROW_PAD_RATIO = 1.06


def fwd_narrow_tile(hdim: int, seqlen_q: int, causal: bool) -> bool:
    """Whether a causal forward takes _TILES_NARROW for this query length (the wide tile pads)."""
    if not causal or hdim not in _TILES_NARROW or seqlen_q <= 0:
        return False
    wide, narrow = _TILES_CAUSAL[hdim][0], _TILES_NARROW[hdim][0]
    padded = lambda rows: -(-seqlen_q // rows) * rows  # noqa: E731
    return padded(wide) > _NARROW_PAD_RATIO * padded(narrow)


# hdim 256 stages each warpgroup's O in a V stage of its own on persistent grids (+0.6..+9.5%)
_O_V_STAGES = {"o_in_v": True, "o_v_stages": True}
_FWD_O_V_STAGES = {256}
# FwdConfig.lazy_max at hdim 96 (no mask) / 128: +9..+13% (hdim 64's tile has no registers for it)
_FWD_LAZY_MAX = {128: True, 96: False}

# causal hdim 192 / 256 on short sequences: (longest length, overrides) brackets (+1..+24%)
_SHORT_CAUSAL = {256: ((512, {"tile_n": 64, "persistent": True, "dynamic_sched": True, **_O_V_STAGES}),
                       (1024, {"persistent": True, "dynamic_sched": True, **_O_V_STAGES})),
                 192: ((1024, {"persistent": True, "dynamic_sched": True, **_O_V_STAGES}),)}


# hdim 192 without a mask up to 512: O in V's stages (+7.5 / +8.7% at 512)
_SHORT_NOMASK = {192: ((512, _O_V_STAGES),)}


def _short_bracket(brackets: dict, hdim: int, seqlen_q: int, seqlen_k: int) -> int:
    """1 + the index of the first of hdim's (longest length, overrides) brackets that holds both
    lengths, or 0 (none)."""
    longest = max(seqlen_q, seqlen_k)
    if longest <= 0:
        return 0
    for i, (limit, _) in enumerate(brackets.get(hdim, ())):
        if longest <= limit:
            return i + 1
    return 0


def fwd_short_nomask(hdim: int, seqlen_q: int, seqlen_k: int, masked: bool) -> int:
    """Which _SHORT_NOMASK bracket a forward without a mask (`masked`: causal or a window) takes, or 0."""
    return 0 if masked else _short_bracket(_SHORT_NOMASK, hdim, seqlen_q, seqlen_k)


def fwd_short_causal(hdim: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """Which _SHORT_CAUSAL bracket a causal forward takes, or 0."""
    return _short_bracket(_SHORT_CAUSAL, hdim, seqlen_q, seqlen_k) if causal else 0


# hdim 64 up to 1024, no window: a Q ring of two and a third K / V stage (+2..+9%)
_SHORT_QRING = {64: {"q_stages": 2, "num_stages": 3}}
_SHORT_QRING_MAX = 1024


def fwd_short_qring(hdim: int, seqlen_q: int, seqlen_k: int, local: bool) -> bool:
    """Whether a forward takes _SHORT_QRING (both lengths at most _SHORT_QRING_MAX, no window)."""
    return not local and hdim in _SHORT_QRING and 0 < max(seqlen_q, seqlen_k) <= _SHORT_QRING_MAX


def _fwd_persistent(hdim: int, masked: bool) -> bool:
    """Persistent grid with the dynamic (atomic) tile scheduler, or one CTA per tile.

    Measured with a config sweep (docs/decisions.md): persistent + dynamic wins
    where launch and prologue costs weigh (short sequences: +14..+31% at 512-1k, hdim 64/128) and
    is even or a little ahead on long ones; at hdim 256 causal the one-CTA-per-tile grid is 2%
    faster (fewer, longer tiles already fill the last wave), so large masked head dims keep it.
    """
    return not (masked and hdim >= 192)


# per-warpgroup epilogue with the ping-pong token carried across tiles: +0.6..+8.6%
_FWD_WG_EPILOGUE = True
# warpgroups whose rows all lie past seqlen_q skip their work: up to +11.8% on short queries
_FWD_SKIP_IDLE_WG = True


@functools.cache
def fwd_config(dtype: str, hdim: int, causal: bool = False, local: bool = False,
               softcap: bool = False, narrow: bool = False, short: int = 0,
               qring: bool = False, dv: int = 0, qk_descale: str = "head") -> FwdConfig:
    """The dispatched forward configuration (cached: it is on every call's path). `narrow`:
    causal, and the query length would pad the usual tile (`fwd_narrow_tile`); `short`: short
    sequences, the bracket `fwd_short_causal` (causal) or `fwd_short_nomask` (no mask) returns (True:
    the first); `qring`: short sequences without a window (`fwd_short_qring`); `qk_descale`: FP8's
    descale form (config.QK_DESCALES: "token" for per-token / per-block q and k descales)."""
    if hdim not in _TILES:
        raise ValueError(f"hdim {hdim} not supported; supported: {SUPPORTED_HDIMS}")
    if dtype in FP8_DTYPES:
        tiles = _FP8_TILES[hdim]
        if qk_descale == "token" and (causal or local):
            tiles = _FP8_TOKEN_MASKED_TILES.get(hdim, tiles)
        elif qk_descale == "head" and not (local or softcap):
            tiles = _FP8_WIDE_TILES.get(hdim, tiles)
        return _fwd_config_untimed(dtype, hdim, tiles, causal, local, softcap,
                                   vt_stages=_FP8_VT_STAGES.get(hdim, 2), pv_two_level=hdim in _FP8_TWO_LEVEL,
                                   qk_descale=qk_descale)
    if qk_descale != "head":
        raise ValueError(f"qk_descale {qk_descale!r}: descales go with e4m3 inputs, not {dtype}")
    if dv and dv != hdim:
        return _fwd_config_untimed(dtype, hdim, _SPLIT_TILES[hdim, dv], causal, local, softcap, dv=dv)
    tile_m, tile_n = (_TILES_LOCAL if local else _TILES_CAUSAL if causal else _TILES)[hdim]
    if narrow and causal and not local and hdim in _TILES_NARROW:
        tile_m, tile_n = _TILES_NARROW[hdim]
    sched = _fwd_persistent(hdim, causal or local)
    cfg = FwdConfig(dtype=dtype, hdim=hdim, causal=causal, local=local, softcap=softcap,
                    tile_m=tile_m, tile_n=tile_n, num_consumer_wg=tile_m // 64,
                    persistent=sched, dynamic_sched=sched, rescale_o_before_pv=hdim > 128,
                    wg_epilogue=_FWD_WG_EPILOGUE and not (softcap and causal and tile_m == 192),
                    skip_idle_wg=_FWD_SKIP_IDLE_WG)
    if hdim in _FWD_O_V_STAGES and cfg.persistent:
        cfg = dataclasses.replace(cfg, **_O_V_STAGES)
    brackets = (_SHORT_CAUSAL if causal else _SHORT_NOMASK).get(hdim)
    if short and not local and brackets:
        cfg = dataclasses.replace(cfg, **brackets[int(short) - 1][1])
    if qring and not local and hdim in _SHORT_QRING:
        cfg = dataclasses.replace(cfg, **_SHORT_QRING[hdim])
    if hdim in _FWD_LAZY_MAX and not softcap and (_FWD_LAZY_MAX[hdim] or not (causal or local)):
        cfg = dataclasses.replace(cfg, lazy_max=True)
    cfg.check()
    return cfg


# FP8 forward (timed on an H100 at 55b212c: docs/results-fp8.md): 128 x 128 tiles; hdim 256 at 96 keys a
# block (128 spill 64 bytes at the consumers' 232 registers, now 224) and one stage of V as loaded (room
# for O's own tile)
_FP8_TILES = {**{d: (128, 128) for d in SUPPORTED_HDIMS}, 128: (128, 96), 256: (128, 96)}
_FP8_VT_STAGES = {256: 1}
# wider key blocks with per-(batch, kv head) descales, no window and no softcap (where they compile
# without spills: FP8_TILE_CANDIDATES), two-level accumulation kept: `scripts/config_sweep.py --dtype fp8
# --candidates` on an H100 (2026-12-06, 097409a): hdim 128 at 128 keys 1.05-1.13x the 96-key tile, hdim
# 64 at 192 keys 1.00-1.07x the 128-key one. 192-224 keys at hdim 128 read 1.15-1.24x but only with one
# accumulator (docs/results-fp8.md: its error grows with the keys)
_FP8_WIDE_TILES = {64: (128, 192), 128: (128, 128)}
# two-level accumulation where the second O accumulator fits the registers (hdim 128 at 96 keys a block):
# on the H200 (V = 1 + N(0,1), peaked scores) the relative RMSE at 1k / 8k / 32k / 128k keys went from
# 1.0e-2 / 0.10 / 0.30 / 0.57 to 2.7e-3 / 2.1e-3 / 2.1e-3 / 2.0e-3 (hdim 64; hdim 128 alike). Not at
# hdim 192 / 256: two O accumulators do not fit 224 registers, and their error grows with the keys
_FP8_TWO_LEVEL = frozenset({64, 96, 128})
# per-token q / k descales (FwdConfig.qk_descale "token") with a causal / local mask: 64 keys a block at
# hdim 128 and 256, where 96 left no registers for the k descales next to the mask (ptxas spilled 8-24
# bytes of loop state); without a mask the FP8 tiles fit
_FP8_TOKEN_MASKED_TILES = {128: (128, 64), 256: (128, 64)}
# FP8 candidates, not dispatched (docs/design.md, FP8): wider key blocks and the 232 / 40 register split
# (FwdConfig.producer_nreg), as FwdConfig overrides on the dispatched config (scripts/config_sweep.py
# --dtype fp8 --candidates times them against it and cuDNN). Each compiles without spills and with one
# QGMMA wait per commit group, with no mask and causal (tests/test_fwd_compile.py, make test-full); most
# spill with softcap or a local window, so one that wins goes into a per-mask table (_FP8_WIDE_TILES).
# hdim 256: 128 keys take all of shared memory with O in Q's buffer and spill 32 bytes at 232 registers.
# hdim 128 at the 40-register producer left: with the deferred row scale 0.96-0.98x the dispatch and 8 bytes
# spilled causal (docs/results-fp8.md)
FP8_TILE_CANDIDATES = {
    64: ("tile_n=160", "tile_n=224,producer_nreg=40"),
    96: ("tile_n=160", "tile_n=192,producer_nreg=40"),
    128: ("tile_n=224,pv_two_level=false,producer_nreg=40",),
    192: ("tile_n=160,vt_stages=1", "tile_n=160,vt_stages=1,producer_nreg=40", "producer_nreg=40"),
    256: ("producer_nreg=40",),
}


# FP8 row sums by the tensor cores (FwdConfig.pv_row_sum) for calls that return no LSE, on the wide-tile
# configs (no window, no softcap, per-(batch, kv head) descales): `scripts/config_sweep.py --dtype fp8` on an
# H100 (2026-12-06): hdim 64 +12% / +16% without a mask (2k / 8k), +11% / +14% causal; hdim 128 without a
# mask +4% (with the 40-register producer: the ones' accumulator columns take 8 more registers; alone it read
# 0.99-1.01x). hdim 128 causal spilled 16 bytes (+1%, left out); hdim 96 not timed
_FP8_ROW_SUM = {(64, False): {}, (64, True): {}, (128, False): {"producer_nreg": 40}}


def fp8_row_sum(cfg: FwdConfig) -> FwdConfig:
    """The config a call that returns no LSE runs: with the row sums by the tensor cores where
    _FP8_ROW_SUM has it, else `cfg` itself."""
    fields = _FP8_ROW_SUM.get((cfg.hdim, cfg.causal))
    if fields is None or not cfg.is_fp8 or cfg.local or cfg.softcap or cfg.qk_descale != "head":
        return cfg
    return dataclasses.replace(cfg, pv_row_sum=True, **fields)


def _fwd_config_untimed(dtype: str, hdim: int, tiles: tuple[int, int], causal: bool, local: bool,
                        softcap: bool, **fields) -> FwdConfig:
    """A forward config with the dense defaults but none of the timed per-hdim switches (FP8, the
    split head dims): the schedule of the mask, the per-warpgroup epilogue where O has its own tile
    (FP8 requires it there, FwdConfig._check_fp8)."""
    tile_m, tile_n = tiles
    sched = _fwd_persistent(hdim, causal or local)
    cfg = FwdConfig(dtype=dtype, hdim=hdim, causal=causal, local=local, softcap=softcap, tile_m=tile_m,
                    tile_n=tile_n, num_consumer_wg=tile_m // 64, persistent=sched, dynamic_sched=sched,
                    rescale_o_before_pv=hdim > 128, skip_idle_wg=_FWD_SKIP_IDLE_WG, **fields)
    if cfg.o_buffer:
        cfg = dataclasses.replace(cfg, wg_epilogue=_FWD_WG_EPILOGUE)
    cfg.check()
    return cfg


# Varlen forward: the dense tiles of the mask on the persistent grid, whose dynamic scheduler walks each
# sequence's real tiles, longest first (hopper/tile_scheduler.py); the shared epilogue (O stored row by row)
_VARLEN = {"persistent": True, "dynamic_sched": True, "o_in_v": False, "o_v_stages": False,
           "wg_epilogue": False, "q_stages": 1}


@functools.cache
def fwd_config_varlen(dtype: str, hdim: int, causal: bool = False, local: bool = False,
                      softcap: bool = False, dv: int = 0) -> FwdConfig:
    """The varlen forward's configuration: the dense one of the mask on varlen's scheduler, with what
    varlen does not take turned off (FwdConfig._check_varlen)."""
    cfg = dataclasses.replace(fwd_config(dtype, hdim, causal=causal, local=local, softcap=softcap, dv=dv),
                              varlen=True, **_VARLEN)
    if local:  # the window's bounds next to the sequence's leave lazy_max no registers (4 spilled at 128)
        cfg = dataclasses.replace(cfg, lazy_max=False)
    if causal and cfg.lazy_max:  # nor the late K release (72 bytes spilled at hdim 128 in bf16); the early
        # one (FwdConfig.late_k_release off) timed the same in the dense kernel (docs/design.md)
        cfg = dataclasses.replace(cfg, late_k_release=False)
    cfg.check()
    return cfg


def fwd_plan_varlen(dtype: str, hdim: int, causal: bool, window_size, softcap: bool, dv: int = 0,
                    page_size: int = 0) -> tuple[FwdConfig, int, int]:
    """The varlen forward's (config, window_left, window_right); `page_size`: over a paged KV cache of
    such pages, the paged config where the kernel serves them (fwd_config_paged), else the plain one."""
    causal, local, wl, wr = mask_kind(causal, window_size)
    cfg = fwd_config_varlen(dtype, hdim, causal=causal, local=local, softcap=softcap, dv=dv)
    return fwd_config_paged(cfg, page_size), wl, wr


# Paged KV by TMA (validation.paged_tma_enabled: on by default since its GPU tests passed): the varlen
# (or decode) kernel reads K and V from the cache's pages, a key block being whole pages or a part of
# one (FwdConfig._check_paged).
# Where the tile's key block is neither (hdim 192's 112 keys, 256's 80, with pages of 32 or more), 64
# keys a block; pages of another size (not a multiple of 8, or neither dividing nor divided by 64) are not
# served: the cache is gathered first (kvcache._gather_pages)
_PAGED_TILE_N = 64


def page_size_served(tile_n: int, page_size: int) -> bool:
    """Whether the paged forward takes pages of `page_size` rows with `tile_n` keys a block."""
    return page_size > 0 and page_size % 8 == 0 and (tile_n % page_size == 0 or page_size % tile_n == 0)


@functools.cache
def fwd_config_paged(cfg: FwdConfig, page_size: int) -> FwdConfig:
    """A varlen config (fwd_config_varlen, fwd_config_decode) over a paged cache of `page_size`-row
    pages: with page_size set where the kernel serves them (at _PAGED_TILE_N keys a block where the
    config's own do not fit the pages), else `cfg` itself, unpaged (0: unpaged)."""
    if not page_size or cfg.is_fp8 or not cfg.varlen:
        return cfg
    if not page_size_served(cfg.tile_n, page_size):
        if not (cfg.tile_n > _PAGED_TILE_N and page_size_served(_PAGED_TILE_N, page_size)):
            return cfg
        cfg = dataclasses.replace(cfg, tile_n=_PAGED_TILE_N)
        if cfg.local and cfg.num_consumer_wg == 2 and not cfg.producer_nreg:
            # the producer's page walk over a window's blocks spilled 8 bytes at 24 registers ((192, 128)
            # over pages of 64-256); 64 keys a block leave the consumers room at 232
            cfg = dataclasses.replace(cfg, producer_nreg=32)
    cfg = dataclasses.replace(cfg, page_size=page_size)
    cfg.check()
    return cfg


# Decode (passes its GPU tests, timed no faster than the varlen tile: used only with
# FLASHHOPPER_EXPERIMENTAL_DECODE_TILE=1, validation.decode_tile_enabled): kvcache's rearranged call
# (flashhopper/splitkv.py: one query token, a sequence's rows the g query heads of a KV head, or one)
# has at most a few real rows a tile, and the 128-row tile ran it compute-bound at about twice the
# memory time. One consumer warpgroup of 64 rows (no ping-pong: it needs two; intra-warpgroup
# overlap), and a K / V ring as deep as shared memory allows (bytes in flight for a walk over the
# keys that is bound by memory). (hdim, dv or 0) -> (tile_n, num_stages): 128 keys a block where three
# or more stages fit, else 64; every entry compiles without spills at the 1-warpgroup register split
# (tests/test_fwd_compile.py)
_DECODE_TILES = {(64, 0): (128, 6), (96, 0): (128, 4), (128, 0): (128, 3), (192, 0): (64, 4),
                 (256, 0): (64, 3), (192, 128): (64, 5)}
_DECODE = {"tile_m": 64, "num_consumer_wg": 1, "pingpong": False, "intra_wg_overlap": True,
           "lazy_max": False, "skip_idle_wg": False}


@functools.cache
def fwd_config_decode(dtype: str, hdim: int, causal: bool = False, softcap: bool = False,
                      dv: int = 0) -> FwdConfig:
    """The varlen forward's 1-warpgroup decode configuration (the decode call takes no mask; `causal`
    for the compile checks): the varlen one of the mask with _DECODE's tile and _DECODE_TILES' key
    blocks and stages."""
    dv = 0 if dv == hdim else dv
    tile_n, stages = _DECODE_TILES[hdim, dv]
    cfg = dataclasses.replace(fwd_config_varlen(dtype, hdim, causal=causal, softcap=softcap, dv=dv),
                              tile_n=tile_n, num_stages=stages, **_DECODE)
    cfg.check()
    return cfg


def fwd_plan_decode(dtype: str, hdim: int, softcap: bool, dv: int = 0, page_size: int = 0) -> FwdConfig:
    """The config of the rearranged decode call (no mask) on the 1-warpgroup tile; `page_size` as
    fwd_plan_varlen's."""
    return fwd_config_paged(fwd_config_decode(dtype, hdim, softcap=softcap, dv=dv), page_size)


@functools.cache
def fwd_config_split(cfg: FwdConfig) -> FwdConfig:
    """The split decode walk (FwdConfig.split_kv) of an unmasked varlen config (fwd_config_varlen,
    fwd_config_decode, either paged): the same tile on the persistent static stride, launched as a
    programmatic dependent (FwdConfig.pdl)."""
    cfg = dataclasses.replace(cfg, split_kv=True, dynamic_sched=False, pdl=True)
    cfg.check()
    return cfg


def fwd_plan_split(dtype: str, hdim: int, softcap: bool, dv: int = 0, page_size: int = 0,
                   decode_tile: bool = False, causal: bool = False) -> FwdConfig:
    """The config of kvcache's decode with the split in the kernel: the varlen tile, or the 1-warpgroup
    decode tile with `decode_tile` (validation.decode_tile_enabled); `page_size` as fwd_plan_varlen's (the
    caller checks that the config's page_size is the cache's); no mask, or with `causal` the same tile
    causal over packed query tokens (FwdConfig.token_rows: several-token decode)."""
    base = (fwd_config_decode(dtype, hdim, softcap=softcap, dv=0 if dv == hdim else dv) if decode_tile
            else fwd_config_varlen(dtype, hdim, softcap=softcap, dv=0 if dv == hdim else dv))
    cfg = fwd_config_split(fwd_config_paged(base, page_size))
    if causal:  # no lazy_max: with the mask and the pages it spilled (8-16 bytes at hdim 96 / 128); decode
        # reads the cache at copy rate with or without it
        cfg = dataclasses.replace(cfg, causal=True, token_rows=True, lazy_max=False)
        cfg.check()
    return cfg


def split_kernels(dtypes=DTYPES, hdims=SUPPORTED_HDIMS, page_sizes=(0,), decode_tile: bool = False) -> list:
    """The split decode configs (16-bit, each (hdim, dv) pair, softcap or not, unmasked or causal over packed
    tokens; the varlen tile, or the 1-warpgroup decode tile with `decode_tile`; `page_sizes`: over paged
    caches of those page sizes where the kernels serve them, 0 unpaged): not in dispatched_kernels while
    FLASHHOPPER_EXPERIMENTAL_DECODE_SPLIT
    gates them (`flashhopper precompile --decode` builds the unpaged ones, and where it builds the paged
    kernels the paged ones too)."""
    configs = []
    for dtype, hdim, page_size in itertools.product((d for d in dtypes if d in DTYPES), hdims, page_sizes):
        for dv, softcap, causal in itertools.product(value_hdims(hdim), (False, True), (False, True)):
            cfg = fwd_plan_split(dtype, hdim, softcap, dv, page_size, decode_tile=decode_tile, causal=causal)
            if cfg.page_size == page_size and cfg not in configs:
                configs.append(cfg)
    return configs


def decode_kernels(dtypes=DTYPES, hdims=SUPPORTED_HDIMS) -> list:
    """Every 1-warpgroup decode config (16-bit, each (hdim, dv) pair, softcap or not): not in
    dispatched_kernels while FLASHHOPPER_EXPERIMENTAL_DECODE_TILE gates it (`flashhopper precompile
    --decode` builds them)."""
    return [fwd_config_decode(dtype, hdim, softcap=softcap, dv=dv)
            for dtype, hdim in itertools.product((d for d in dtypes if d in DTYPES), hdims)
            for dv in value_hdims(hdim) for softcap in (False, True)]


def combine_kernels(dtypes=DTYPES, hdims=SUPPORTED_HDIMS) -> list:
    """Split-KV decode's merge kernels kvcache launches (hopper/combine.py: partials and output in the
    input dtype, each value head dim): not in dispatched_kernels (they depend on no attention config);
    `flashhopper precompile` adds them."""
    dvs = sorted({dv or hdim for hdim in hdims for dv in value_hdims(hdim)})
    return [CombineConfig(dtype, dv, dtype) for dtype in dtypes if dtype in DTYPES for dv in dvs]


# page sizes the paged kernels are built for by `flashhopper precompile` (vLLM's default 16, and larger
# pages), every mask (plan.paged_kernels)
PAGED_PAGE_SIZES = (16, 64, 128, 256)


def paged_kernels(dtypes=DTYPES, hdims=SUPPORTED_HDIMS, page_sizes=PAGED_PAGE_SIZES) -> list:
    """The paged varlen configs (16-bit; every mask, softcap or not, each value head dim) and the paged
    1-warpgroup decode configs (no mask) of each page size the kernels serve: not yet in
    dispatched_kernels (`flashhopper precompile --paged` builds them)."""
    configs = []
    for dtype, hdim, page_size in itertools.product((d for d in dtypes if d in DTYPES), hdims, page_sizes):
        masks = itertools.product(MASKS, (False, True), value_hdims(hdim))
        bases = [fwd_plan_varlen(dtype, hdim, causal, window, softcap, dv)[0]
                 for (causal, window), softcap, dv in masks]
        for cfg in (fwd_config_paged(base, page_size) for base in (*bases, fwd_config_decode(dtype, hdim))):
            if cfg.page_size and cfg not in configs:
                configs.append(cfg)
    return configs


# Varlen backward (first version, not yet timed): the dense kernel of the mask for long sequences,
# with what varlen does not take turned off (BwdConfig._check_varlen)
_BWD_VARLEN_OFF = {"lpt": False, "pdl": False, "pre_zero_dq": False,
                   "dq_rows_interleaved": False, "dq_accum_head_major": False}


@functools.cache
def bwd_config_varlen(dtype: str, hdim: int, causal: bool = False, local: bool = False, softcap: bool = False,
                      deterministic: bool = False) -> BwdConfig:
    """The varlen backward's configuration: the dense one of the mask (its per-hdim choices) with
    what varlen does not take turned off."""
    cfg = bwd_config(dtype, hdim, causal=causal, local=local, softcap=softcap, deterministic=deterministic)
    cfg = dataclasses.replace(cfg, varlen=True, **_BWD_VARLEN_OFF)
    if hdim == 64 and local and not deterministic:
        # the sequence's lengths are registers here, not kernel parameters: two dS^T buffers spilled 8 bytes
        cfg = dataclasses.replace(cfg, ds_stages=1)
    if hdim == 256 and softcap:  # 80 keys spilled 8-16 bytes (fp16, causal)
        cfg = dataclasses.replace(cfg, tile_n=64)
    cfg.check()
    return cfg


def bwd_plan_varlen(dtype: str, hdim: int, causal: bool, window_size, softcap: bool, deterministic: bool
                    ) -> tuple[BwdConfig, bool, bool, int, int]:
    """The varlen backward's (config, causal kernel, local kernel, window_left, window_right)."""
    causal, local, wl, wr = mask_kind(causal, window_size)
    return bwd_config_varlen(dtype, hdim, causal, local, softcap, deterministic), causal, local, wl, wr


# (hdim, dv) pairs (SPLIT_HDIMS; first version, not yet timed): the tile of hdim; O (dv wide) has room
# for its own smem tile and the per-warpgroup epilogue. Their backward is hdim's (BwdPreConfig.of's dv)
_SPLIT_TILES = {(192, 128): (128, 112)}


def value_hdims(hdim: int) -> tuple[int, ...]:
    """The value head dims a query head dim is dispatched with: its own (0) and SPLIT_HDIMS'."""
    return (0, *(dv for d, dv in SPLIT_HDIMS if d == hdim))


# hdim 192 and 256 (kv_split "hdim", hopper/bwd_wide.py): 64 x hdim fp32 dK and dV per warpgroup
# would not fit in registers, so the warpgroups split dK^T / dV^T by head-dim rows (64 or 128
# each; 192 therefore takes 3 warpgroups) and P, dS go through smem. hdim -> (tile_n, warpgroups):
# 32 keys of S and dP per warpgroup at 192; FA3's 80 keys (40 per warpgroup) at 256. Other tile_n
# (64; 48 as in FA4) and dO ring depths compile clean as overrides (docs/design.md).
BWD_WIDE = {192: (96, 3), 256: (80, 2)}
# dO ring depth per wide hdim (absent: the Q ring's): hdim 256 with one, +13..+20%
_BWD_WIDE_DO_STAGES = {256: 1}
# query rows per backward step (kv_split "keys"): 128 at hdim 64 as in FA3, 80 at hdim 128
_BWD_TILE_M: dict[int, int] = {64: 128, 128: 80}
# dS^T smem buffers per hdim: two where the smem is there (+0.4..+3%)
_BWD_DS_STAGES: dict[int, int] = {64: 2, 96: 2, 192: 2, 256: 2}
# the wide kernel's dQ by TMA reduce-adds through one smem part, rows interleaved, at 256 in a
# ring of half boxes: +10..+20%, then +4..+10%, +1..+2%, +1..+4% (docs/decisions.md)
_BWD_WIDE_SWITCHES: dict[int, dict] = {
    192: {"num_consumer_wg": 2, "dkv_by_keys": True, "ds_stages": 1, "dq_tma": True, "dq_slots": 1,
          "dq_rows_interleaved": True},
    256: {"ds_stages": 1, "dq_tma": True, "dq_slots": 1, "dq_rows_interleaved": True, "dq_slot_halves": True,
          "dq_slot_ring": 3},
}
# The wide kernel as dispatched before that (dQ by atomics, two P / dS pairs; 192 as 3 warpgroups of
# 64 head-dim rows): the base its earlier candidates were measured on, kept for the tests and scripts
BWD_WIDE_ATOMICS: dict[int, dict] = {
    192: {"num_consumer_wg": 3, "dkv_by_keys": False, "ds_stages": 2, "dq_tma": False, "dq_slots": 0,
          "dq_rows_interleaved": False},
    256: {"ds_stages": 2, "dq_tma": False, "dq_slots": 0, "dq_rows_interleaved": False,
          "dq_slot_halves": False, "sdp_by_gemm": False},
}
# hdim 256 (not softcap): S and dP split by GEMM between the warpgroups, geomean +0.8%
_BWD_SDP_BY_GEMM = frozenset({256})
# operand and step choices per hdim of the keys kernel, each measured up (docs/decisions.md)
_BWD_KEYS_SWITCHES: dict[int, dict] = {64: {"dq_by_rows": True, "dk_rs": True, "dq_per_wg": True,
                                            "dq_rows_interleaved": True},
                                       96: {"dq_per_wg": True, "dk_rs": True, "scale_in_ds": True},
                                       128: {"dq_per_wg": True, "dk_rs": True, "mask_runs": True,
                                             "scale_in_ds": True}}
# the preprocess clears the dQ accumulator: one launch fewer, +0.0..+1.6%
_BWD_PRE_ZERO_DQ = True
# added to _BWD_KEYS_SWITCHES with no causal / local mask, and with one
_BWD_KEYS_UNMASKED: dict[int, dict] = {64: {"ds_then_dv": True}}
_BWD_KEYS_MASKED: dict[int, dict] = {64: {"mask_runs": True}, 96: {"mask_runs": True}}


# longest-first launch per call: hdim 128 causal 2k-8k, hdim 256 causal 1k-2k (+2..+5%)
_BWD_LPT_CAUSAL = {128: (2048, 8192), 256: (1024, 2048)}


def bwd_lpt(hdim: int, seqlen_q: int, seqlen_k: int, causal: bool, deterministic: bool) -> bool:
    """Whether a backward call launches longest first (_BWD_LPT_CAUSAL; never deterministic,
    whose dQ order fixes the launch order)."""
    lo, hi = _BWD_LPT_CAUSAL.get(hdim, (1, 0))
    return causal and not deterministic and lo <= max(seqlen_q, seqlen_k) <= hi


# hdim 128 causal up to 1k: 64-row steps with interleaved dQ rows (+2.6..+5%; not softcap)
_BWD_SHORT_CAUSAL = {128: (1024, {"tile_m": 64, "dq_rows_interleaved": True})}


def bwd_per_call(hdim: int, seqlen_q: int, seqlen_k: int, causal: bool, deterministic: bool,
                 softcap: bool = False) -> dict:
    """BwdConfig fields chosen per call from the sequence lengths (bwd_lpt, _BWD_SHORT_CAUSAL);
    only where timed: deterministic mode keeps the per-hdim config."""
    fields = {"lpt": True} if bwd_lpt(hdim, seqlen_q, seqlen_k, causal, deterministic) else {}
    longest, short = _BWD_SHORT_CAUSAL.get(hdim, (0, {}))
    if causal and not deterministic and not softcap and max(seqlen_q, seqlen_k) <= longest:
        fields.update(short)
    return fields


@functools.cache  # on every backward call; BwdConfig is frozen
def bwd_config(dtype: str, hdim: int, causal: bool = False, local: bool = False,
               softcap: bool = False, deterministic: bool = False, **overrides) -> BwdConfig:
    wide = {}
    if hdim in BWD_WIDE:
        wide = dict(zip(("tile_n", "num_consumer_wg"), BWD_WIDE[hdim], strict=True), kv_split="hdim",
                    do_stages=_BWD_WIDE_DO_STAGES.get(hdim, 0), **_BWD_WIDE_SWITCHES.get(hdim, {}))
        # the slot's halves spilled 16 bytes under a local window before sdp_by_gemm (not with it:
        # earlier, cases passed) and were never timed there
        if local:
            wide.update(dq_slot_halves=False, dq_slot_ring=0)
        if hdim in _BWD_SDP_BY_GEMM and not softcap:
            wide["sdp_by_gemm"] = True
    if hdim == 256 and softcap and causal and dtype == "fp16":
        wide["tile_n"] = 64  # 80 keys spilled 8 bytes (3 LDL) at 240 registers; bf16's do not
    cfg = BwdConfig(dtype=dtype, hdim=hdim, causal=causal, local=local, softcap=softcap,
                    deterministic=deterministic, pre_zero_dq=_BWD_PRE_ZERO_DQ,
                    tile_m=_BWD_TILE_M.get(hdim, 64),
                    **{"ds_stages": _BWD_DS_STAGES.get(hdim, 1), **wide}, **_BWD_KEYS_SWITCHES.get(hdim, {}),
                    **(_BWD_KEYS_MASKED if causal or local else _BWD_KEYS_UNMASKED).get(hdim, {}))
    return bwd_with_overrides(cfg, **overrides)


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
             softcap: bool, dv: int = 0, qk_descale: str = "head", need_lse: bool = True
             ) -> tuple[FwdConfig, int, int]:
    """The forward's (config, window_left, window_right) for a call; `dv`: the value head dim when
    it differs from hdim (SPLIT_HDIMS); `qk_descale`: FP8's descale form (fwd_config); `need_lse` off: the
    call returns no LSE (FP8: fp8_row_sum)."""
    causal, local, wl, wr = mask_kind(causal, window_size)
    if dv and dv != hdim:  # no per-call brackets (not timed)
        return fwd_config(dtype, hdim, causal=causal, local=local, softcap=softcap, dv=dv), wl, wr
    cfg = fwd_config(dtype, hdim, causal=causal, local=local, softcap=softcap,
                     narrow=fwd_narrow_tile(hdim, sq, causal and not local),
                     short=(fwd_short_causal(hdim, sq, sk, not local) if causal
                            else fwd_short_nomask(hdim, sq, sk, local)),
                     qring=fwd_short_qring(hdim, sq, sk, local), qk_descale=qk_descale)
    return (cfg if need_lse else fp8_row_sum(cfg)), wl, wr


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


# Lengths that reach every per-call class of the dispatch: the edges of each bracket above
# (512, 1024, 2048, 8192 and one past), paddings of 128- and 192-row tiles, short and long.
_LENGTHS = (1, 100, 128, 129, 200, 256, 300, 512, 513, 700, 1024, 1025, 2048, 2049, 4096, 8192, 8193, 16384)
# no mask, causal, a window (the local kernel; its bounds are runtime arguments)
MASKS = ((False, (-1, -1)), (True, (-1, -1)), (False, (128, 0)))


@dataclasses.dataclass(frozen=True)
class Call:
    """A call's static shape: what the dispatch looks at (batch and heads do not matter to it)."""

    dtype: str
    hdim: int
    sq: int
    sk: int
    causal: bool
    window: tuple[int, int]
    softcap: bool
    deterministic: bool
    varlen: bool = False
    dv: int = 0  # the value head dim when it differs (SPLIT_HDIMS)
    qk_descale: str = "head"  # FP8: descales per (batch, kv head), or q's and k's per token (QK_DESCALES)
    lse: bool = True  # the call returns the LSE (FP8 without it: plan.fp8_row_sum)


def dispatched_calls(dtypes=DTYPES + FP8_DTYPES, hdims=SUPPORTED_HDIMS, forward: bool = True,
                     backward: bool = True) -> dict:
    """Every kernel config a call can dispatch for these dtypes and head dims (forward, backward
    main kernel, backward preprocess), each once in a stable order, with the first Call that
    dispatches it: lengths that are not a multiple of 64 and walk a few blocks first, so that a case
    made from it is odd-shaped and small."""
    odd_first = sorted(_LENGTHS, key=lambda n: (n % 64 == 0 or not 128 < n < 2100, _LENGTHS.index(n)))
    seen: dict = {}
    for dtype, hdim in itertools.product(dtypes, hdims):
        shapes = itertools.product(MASKS, (False, True), odd_first, odd_first)
        for (causal, window), softcap, sq, sk in shapes:
            if forward:
                seen.setdefault(fwd_plan(dtype, hdim, sq, sk, causal, window, softcap)[0],
                                Call(dtype, hdim, sq, sk, causal, window, softcap, False))
                if dtype in FP8_DTYPES:
                    # no LSE returned: the row sums by the tensor cores (fp8_row_sum)
                    seen.setdefault(fwd_plan(dtype, hdim, sq, sk, causal, window, softcap, need_lse=False)[0],
                                    Call(dtype, hdim, sq, sk, causal, window, softcap, False, lse=False))
                    # per-token (per-block) q / k descales: their own kernels
                    token = fwd_plan(dtype, hdim, sq, sk, causal, window, softcap, qk_descale="token")[0]
                    seen.setdefault(token, Call(dtype, hdim, sq, sk, causal, window, softcap, False,
                                                qk_descale="token"))
                if dtype in DTYPES:  # varlen and the split head dims: 16-bit for now
                    seen.setdefault(fwd_plan_varlen(dtype, hdim, causal, window, softcap)[0],
                                    Call(dtype, hdim, sq, sk, causal, window, softcap, False, varlen=True))
                    for dv in value_hdims(hdim)[1:]:
                        seen.setdefault(fwd_plan(dtype, hdim, sq, sk, causal, window, softcap, dv)[0],
                                        Call(dtype, hdim, sq, sk, causal, window, softcap, False, dv=dv))
                        seen.setdefault(fwd_plan_varlen(dtype, hdim, causal, window, softcap, dv)[0],
                                        Call(dtype, hdim, sq, sk, causal, window, softcap, False, True, dv))
            if backward and hdim in BWD_HDIMS and dtype in DTYPES:  # no FP8 backward
                # a split pair (value_hdims) runs hdim's main kernel and a preprocess of its own
                for deterministic, dv in itertools.product((False, True), value_hdims(hdim)):
                    cfg = bwd_plan(dtype, hdim, sq, sk, causal, window, softcap, deterministic)[0]
                    call = Call(dtype, hdim, sq, sk, causal, window, softcap, deterministic, dv=dv)
                    seen.setdefault(cfg, call)
                    seen.setdefault(BwdPreConfig.of(cfg, dv), call)
                    cfg = bwd_plan_varlen(dtype, hdim, causal, window, softcap, deterministic)[0]
                    call = dataclasses.replace(call, varlen=True)
                    seen.setdefault(cfg, call)
                    seen.setdefault(BwdPreConfig.of(cfg, dv), call)
    return seen


def dispatched_kernels(dtypes=DTYPES + FP8_DTYPES, hdims=SUPPORTED_HDIMS, forward: bool = True,
                       backward: bool = True) -> list:
    """Every kernel config a call can dispatch (dispatched_calls' keys)."""
    return list(dispatched_calls(dtypes, hdims, forward, backward))


# the fields whose every dispatched value a covering subset holds (CI's compile checks, the sanitizer)
COVER = ("hdim", "dtype", "causal", "local", "softcap", "deterministic", "tile_m", "tile_n", "num_stages",
         "num_consumer_wg", "persistent", "dynamic_sched", "q_stages", "o_in_v", "o_v_stages", "lazy_max",
         "lpt", "kv_split", "dq_rows_interleaved", "mask_runs", "ds_then_dv", "scale_d", "zero_dq",
         "vt_stages", "varlen", "dv", "qk_descale", "pv_row_sum")


def features(cfg) -> set:
    return {(type(cfg).__name__, f, getattr(cfg, f)) for f in COVER if hasattr(cfg, f)}


def covering_subset(configs) -> list:
    """Configs in order, each kept only if it covers a (class, field, value) none before did."""
    covered, chosen = set(), []
    for cfg in configs:
        new = features(cfg) - covered
        if new:
            chosen.append(cfg)
            covered |= new
    return chosen
