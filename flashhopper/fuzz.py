"""`flashhopper fuzz`: random cases, stratified over the dispatched kernels, checked by the one
correctness rule (flashhopper/accuracy.py); every failure printed as a one-line reproducer
(`flashhopper fuzz --case '<json>'` runs it again).

Case i draws its stratum round-robin from `strata()`, so N cases cover each of its S strata N / S
times (S = 520: 360 attention strata, then 160 decode strata), then the rest from its own seed.

Attention strata (dtype, head dim, mask kind, softcap, deterministic; dense, FP8 or varlen): lengths
(bracket edges of the dispatch, odd and tiny ones, or log-uniform up to 4096), batch, heads and GQA
ratio, window bounds, layout (contiguous, heads strided, packed qkv), a softmax scale (default or
drawn) and the inputs' magnitude, through flash_attn_func / flash_attn_varlen_func. The forward is
checked, then (unless --no-bwd) the backward.

Decode strata (16-bit dtype, head dim, mask kind, softcap; a contiguous or a paged cache), through
flash_attn_with_kvcache: GQA 32:8, 8:2, 4:4, 8:1 or 6:3, batch 1-8, a query length of 1 (decode), 2-16
(speculative decoding) or a chunked prefill's, each item's cache_seqlens (0, 1, a page or key block
boundary +-1, or log-uniform up to 4096), new keys and values appended (k=, v=) or not, cache_batch_idx
(distinct rows of a larger contiguous cache) and cache_leftpad sometimes, pages of 1, 16, 64, 128 or
256 rows in a shuffled table (its entries past an item's pages garbage), hdim 192 with dv = 128 two
times in five, num_splits (0 or forced) and pack_gqa hints, return_lse or not, a preallocated out, q
packed (b * s_q, hq, d) with cu_seqlens_q three times in ten (as SGLang and vLLM pass it), and the
1-warpgroup decode tile opted in for the call (decode_paths); with `--experimental` also the split
inside the attention kernel opted in by its variable (the default since its GPU run; the rest of each
case drawn as without it).
Every cache slot outside an item's keys is NaN, which must stay out; accuracy.check_kvcache checks each
item by the rule against its keys, the append element by element and every other cache entry unchanged.
Inference only: no backward. The kernels a decode case counts (kernels_of) are kvcache's choices planned
on the host for the GPU's SM count.

`--strata attention` draws exactly what the fuzz drew before it had decode strata (the same cases for
the same seed); with the decode strata in the table (the default, "all") case i's stratum comes from the
520-strata table, so the same seed draws other cases than before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import random

from flashhopper.config import DTYPES, FP8_DTYPES, SPLIT_HDIMS, SUPPORTED_HDIMS

MASKS = ("none", "causal", "window", "causal_window")
_EDGES = (1, 2, 17, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 511, 512, 513, 1023, 1024, 1025,
          2047, 2048, 2049)
# the float64 reference holds b * hq * sq * sk scores (and the backward several such tensors)
_MAX_SCORES = 1 << 25
# which strata a run draws from (`strata`): all of them, those of flash_attn_func and
# flash_attn_varlen_func (the fuzz's draws before it had decode strata), flash_attn_with_kvcache's, or the
# FP8 forward's alone (its own check before its switch is flipped, without compiling the 16-bit kernels)
STRATA = ("all", "attention", "decode", "fp8")
# decode strata: (query heads, kv heads), page sizes of a paged cache (1: gathered first; the others the
# kernels read in place), chunked prefill lengths, the longest cache_seqlens drawn
DECODE_GQA = ((32, 8), (8, 2), (4, 4), (8, 1), (6, 3))
PAGE_SIZES = (1, 16, 64, 128, 256)
_PREFILL = (33, 64, 127, 128, 129, 300, 512)
_MAX_CACHED = 4096
# the SMs the decode layout (splitkv.plan) is planned for when no GPU tells: an H100 SXM's and an H200's
DEFAULT_SMS = 132


@dataclasses.dataclass(frozen=True)
class Decode:
    """A flash_attn_with_kvcache case's cache and call (Case.decode); the tensors' values, the page
    table's order and its garbage entries come from the case's seed."""

    cache_seqlens: tuple  # each item's length before the append
    new: int  # keys and values appended (k=, v=), 0: none
    page_size: int  # 0: a contiguous cache
    capacity: int  # positions an item may hold: the contiguous cache's s_cache, or a table row's pages
    cache_rows: int  # the contiguous cache's b_cache, or the paged cache's pages
    batch_idx: tuple = ()  # cache_batch_idx (distinct rows of a contiguous cache), () for none
    leftpad: tuple = ()  # cache_leftpad, () for none
    num_splits: int = 0
    pack_gqa: bool | None = None
    return_lse: bool = True
    out: bool = False  # a preallocated out, NaN before the call
    decode_tile: bool = False  # FLASHHOPPER_EXPERIMENTAL_DECODE_TILE=1 for the call (else 0)
    split_in_kernel: bool = False  # FLASHHOPPER_EXPERIMENTAL_DECODE_SPLIT=1 for the call (else 0)
    # q passed packed, (b * s_q, hq, d) with cu_seqlens_q and max_seqlen_q = s_q, as SGLang and vLLM pass it
    packed_q: bool = False

    @classmethod
    def from_dict(cls, fields: dict) -> Decode:
        fields = dict(fields)
        for name in ("cache_seqlens", "batch_idx", "leftpad"):
            fields[name] = tuple(fields.get(name, ()))
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    hdim: int
    mask: str
    softcap: float
    deterministic: bool
    b: int
    sq: int
    sk: int
    hq: int
    hk: int
    window: tuple[int, int]
    layout: str  # "bshd", "strided" (every other head of a wider tensor) or "packed" (one qkv tensor)
    scale: float | None
    magnitude: float
    seed: int
    # FP8: "none", "scalar" (one value, expanded), "tensor" (per batch, kv head) or "token" (q's and k's
    # per token: the per-token kernel; v's per batch, kv head)
    descale: str = "none"
    # varlen (flash_attn_varlen_func): (query, key) length of each packed sequence, and
    # (used query, used key) lengths when seqused is passed (else empty)
    seqlens: tuple = ()
    seqused: tuple = ()
    dv: int = 0  # the value head dim when it differs from hdim (config.SPLIT_HDIMS)
    # a flash_attn_with_kvcache case (sq: each item's query length, sk: the most keys an item holds,
    # layout "bshd"), else None
    decode: Decode | None = None

    @property
    def varlen(self) -> bool:
        return bool(self.seqlens)

    @property
    def kind(self) -> str:
        """The stratum's entry point: "dense", "varlen", "kvcache" (a contiguous cache) or "paged"."""
        if self.decode is not None:
            return "paged" if self.decode.page_size else "kvcache"
        return "varlen" if self.varlen else "dense"

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if self.decode is None:  # an attention case prints as it did before the decode strata
            del fields["decode"]
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Case:
        fields = json.loads(text)
        fields["window"] = tuple(fields["window"])
        for name in ("seqlens", "seqused"):
            fields[name] = tuple(tuple(pair) for pair in fields.get(name, ()))
        if fields.get("decode") is not None:
            fields["decode"] = Decode.from_dict(fields["decode"])
        return cls(**fields)

    @property
    def causal(self) -> bool:
        return self.mask in ("causal", "causal_window")


def strata(group: str = "all") -> list[tuple]:
    """(dtype, hdim, mask, softcap, deterministic, kind) of a group of STRATA: "attention", 16-bit with
    both backward modes, dense and varlen, and FP8 (forward only), in the order the fuzz drew them before
    the decode strata; "decode", 16-bit over a contiguous ("kvcache") or a paged cache (no backward);
    "all", both in that order; "fp8", the attention group's FP8 strata alone."""
    if group not in STRATA:
        raise ValueError(f"strata group {group!r}; accepted: {STRATA}")
    masks = (SUPPORTED_HDIMS, MASKS, (0.0, 15.0))
    attention = (list(itertools.product(DTYPES, *masks, (False, True), ("dense",)))
                 + list(itertools.product(FP8_DTYPES, *masks, (False,), ("dense",)))
                 + list(itertools.product(DTYPES, *masks, (False, True), ("varlen",))))
    decode = list(itertools.product(DTYPES, *masks, (False,), ("kvcache", "paged")))
    fp8 = [s for s in attention if s[0] in FP8_DTYPES]
    return {"all": attention + decode, "attention": attention, "decode": decode, "fp8": fp8}[group]


def _length(rng: random.Random) -> int:
    if rng.random() < 0.5:
        return rng.choice(_EDGES)
    return max(1, int(math.exp(rng.uniform(0.0, math.log(4096)))))


def draw(index: int, seed: int, group: str = "all", experimental: bool = False) -> Case:
    """Case `index` of a fuzz run seeded `seed` over the strata `group` (the same on every machine);
    `experimental`: decode cases may opt in to the split inside the kernel by its variable (the default
    since its GPU run), the rest of every case drawn as without it."""
    table = strata(group)
    dtype, hdim, mask, softcap, deterministic, kind = table[index % len(table)]
    case_seed = seed * 1_000_003 + index
    rng = random.Random(case_seed)
    if kind in ("kvcache", "paged"):
        return _draw_decode(rng, case_seed, dtype=dtype, hdim=hdim, mask=mask, softcap=softcap,
                            paged=kind == "paged", experimental=experimental)
    varlen = kind == "varlen"
    sq, sk = _length(rng), _length(rng)
    ratio = rng.choice((1, 1, 2, 4, 8))
    hk = rng.choice((1, 1, 2, 3))
    hq = hk * ratio
    b = rng.choice((1, 1, 2, 3))
    while b * hq * sq * sk > _MAX_SCORES and b > 1:
        b -= 1
    while hq * sq * sk > _MAX_SCORES:
        sq, sk = max(1, sq // 2), max(1, sk // 2)
    window = _window(rng, mask)
    layout = rng.choice(("bshd", "bshd", "strided", "packed"))
    if layout == "packed" and (sq != sk or hq != hk):
        layout = "strided"
    scale = None if rng.random() < 0.6 else rng.uniform(0.02, 1.0) / math.sqrt(hdim) * 4
    magnitude = rng.choice((1.0, 1.0, 0.1, 4.0))
    descale = "none"
    if dtype in FP8_DTYPES:
        descale = rng.choice(("none", "scalar", "tensor", "tensor", "token", "token"))
    seqlens, seqused = (), ()
    splits = [dv for d, dv in SPLIT_HDIMS if d == hdim]
    dv = rng.choice(splits) if dtype in DTYPES and splits and rng.random() < 0.4 else 0
    if varlen:  # 1-6 sequences, empty ones too, within the reference's memory; packed (or heads strided)
        b, layout = 1, rng.choice(("bshd", "strided"))
        lens = [(rng.choice((0, _length(rng), _length(rng))), _length(rng)) for _ in range(rng.randint(1, 6))]
        while hq * max(lq * lk for lq, lk in lens) > _MAX_SCORES:
            lens = [(lq // 2, max(1, lk // 2)) for lq, lk in lens]
        seqlens = tuple(lens)
        if rng.random() < 0.3:
            seqused = tuple((rng.randint(0, lq), rng.randint(0, lk)) for lq, lk in lens)
        sq, sk = max(lq for lq, _ in lens), max(lk for _, lk in lens)
    if dv and layout == "packed":  # one qkv tensor needs one head dim
        layout = "bshd"
    return Case(dtype, hdim, mask, softcap, deterministic, b, sq, sk, hq, hk, window, layout, scale,
                magnitude, case_seed, descale, seqlens, seqused, dv)


def fp8_lse(case: Case) -> bool:
    """Whether an FP8 dense case asks for the LSE: every other case by its seed (without it the plan may
    take the row sums from the tensor cores, plan.fp8_row_sum)."""
    return case.seed % 2 == 0


def _window(rng: random.Random, mask: str) -> tuple[int, int]:
    left = rng.choice((0, 1, 17, 64, 200, 1000))
    right = rng.choice((0, 3, 64, 500)) if mask == "window" else -1
    return {"none": (-1, -1), "causal": (-1, -1), "window": (left, right), "causal_window": (left, -1)}[mask]


def _cache_length(rng: random.Random, block: int) -> int:
    """An item's cache_seqlens: 0, 1, a multiple of `block` (a page, or a key block) +-1, or
    log-uniform up to _MAX_CACHED."""
    pick = rng.random()
    if pick < 0.1:
        return 0
    if pick < 0.2:
        return 1
    if pick < 0.55:
        return max(0, rng.randint(1, _MAX_CACHED // block) * block + rng.choice((-1, 0, 1)))
    return int(math.exp(rng.uniform(0.0, math.log(_MAX_CACHED))))


def _query_length(rng: random.Random) -> int:
    """1 (decode) 3 times in 5, else 2-16 (speculative decoding) or a chunked prefill's."""
    pick = rng.random()
    if pick < 0.6:
        return 1
    return rng.randint(2, 16) if pick < 0.9 else rng.choice(_PREFILL)


def _draw_decode(rng: random.Random, case_seed: int, *, dtype: str, hdim: int, mask: str, softcap: float,
                 paged: bool, experimental: bool) -> Case:
    """A flash_attn_with_kvcache case of a decode stratum (the module docstring says what it draws)."""
    hq, hk = rng.choice(DECODE_GQA)
    b, sq = rng.randint(1, 8), _query_length(rng)
    new = 0
    if rng.random() < 0.5:  # the query tokens' own keys and values, or another count
        new = sq if rng.random() < 0.75 else rng.randint(1, 16)
    page_size = rng.choice(PAGE_SIZES) if paged else 0
    lens = [_cache_length(rng, page_size if page_size > 1 else 128) for _ in range(b)]
    while hq * sq * (max(lens) + new) > _MAX_SCORES:  # the reference's scores of one item
        lens = [n // 2 for n in lens]
    leftpad = tuple(rng.randint(0, n) for n in lens) if rng.random() < 0.2 else ()
    need = max(1, max(lens) + new)
    batch_idx = ()
    if page_size:  # a table row's pages, some unused; spare pages no row holds
        pages = -(-need // page_size) + rng.choice((0, 0, 1, 2))
        capacity, cache_rows = pages * page_size, b * pages + rng.choice((0, 1, 5))
    else:
        capacity, cache_rows = need + rng.choice((0, 0, 1, 100)), b
        if rng.random() < 0.3:
            cache_rows = b + rng.choice((0, 1, 3))
            batch_idx = tuple(rng.sample(range(cache_rows), b))
    decode = Decode(cache_seqlens=tuple(lens), new=new, page_size=page_size, capacity=capacity,
                    cache_rows=cache_rows, batch_idx=batch_idx, leftpad=leftpad,
                    num_splits=0 if rng.random() < 0.6 else rng.choice((1, 2, 3, 7, 16, 64)),
                    pack_gqa=None if rng.random() < 0.7 else rng.choice((True, False)),
                    return_lse=rng.random() < 0.75, out=rng.random() < 0.3,
                    decode_tile=rng.random() < 0.3, split_in_kernel=rng.random() < 0.25 and experimental,
                    # (its own draw: the cases drawn before it existed stay the same)
                    packed_q=random.Random(f"packed q {case_seed}").random() < 0.3)
    window = _window(rng, mask)
    scale = None if rng.random() < 0.6 else rng.uniform(0.02, 1.0) / math.sqrt(hdim) * 4
    magnitude = rng.choice((1.0, 1.0, 0.1, 4.0))
    splits = [dv for d, dv in SPLIT_HDIMS if d == hdim]
    dv = rng.choice(splits) if splits and rng.random() < 0.4 else 0
    return Case(dtype, hdim, mask, softcap, False, b, sq, max(lens) + new, hq, hk, window, "bshd", scale,
                magnitude, case_seed, dv=dv, decode=decode)


def make_inputs(case: Case, device="cuda"):
    import torch

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn}[case.dtype]
    g = torch.Generator(device=device).manual_seed(case.seed)

    def randn(*shape):
        return (torch.randn(*shape, device=device, generator=g) * case.magnitude).to(dt)

    d, dv = case.hdim, case.dv or case.hdim
    if case.layout == "packed":
        q, k, v = randn(case.b, case.sq, 3, case.hq, d).unbind(2)
    elif case.layout == "strided":
        q = randn(case.b, case.sq, 2 * case.hq, d)[:, :, ::2]
        k = randn(case.b, case.sk, 2 * case.hk, d)[:, :, ::2]
        v = randn(case.b, case.sk, 2 * case.hk, dv)[:, :, 1::2]
    else:
        q = randn(case.b, case.sq, case.hq, d)
        k, v = randn(case.b, case.sk, case.hk, d), randn(case.b, case.sk, case.hk, dv)
    dout = randn(case.b, case.sq, case.hq, dv) if case.dtype in DTYPES else None
    return q, k, v, dout


def run_varlen(case: Case, backward: bool = True) -> str | None:
    """A varlen case through flash_attn_varlen_func, each sequence checked by the rule; rows past a
    sequence's seqused_q must still hold the poison (NaN). Then its gradients; with seqused the rows of
    q, k, v and dout past the used ones hold NaN, and their gradients must be exactly zero."""
    import torch

    from flashhopper import flash_attn_varlen_func
    from flashhopper.accuracy import check_varlen_forward, check_varlen_grads

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    g = torch.Generator(device="cuda").manual_seed(case.seed)
    lens_q, lens_k = zip(*case.seqlens, strict=True)
    used_q, used_k = zip(*case.seqused, strict=True) if case.seqused else (lens_q, lens_k)

    def packed(total, heads, pick, dim=case.hdim):
        width = 2 * heads if case.layout == "strided" else heads
        x = (torch.randn(total, width, dim, device="cuda", generator=g) * case.magnitude).to(dt)
        return x[:, pick::2] if case.layout == "strided" else x

    q = packed(sum(lens_q), case.hq, 0)
    k, v = packed(sum(lens_k), case.hk, 0), packed(sum(lens_k), case.hk, 1, case.dv or case.hdim)
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
                  for lens in (lens_q, lens_k))
    unused_q, unused_k = (_past_used(cu.tolist(), used) for cu, used in ((cu_q, used_q), (cu_k, used_k)))
    for x, unused in ((q, unused_q), (k, unused_k), (v, unused_k)):
        x[unused] = float("nan")  # never read into a result
    seqused = ({"seqused_q": torch.tensor(used_q, dtype=torch.int32, device="cuda"),
                "seqused_k": torch.tensor(used_k, dtype=torch.int32, device="cuda")} if case.seqused else {})
    scale = case.scale if case.scale is not None else case.hdim ** -0.5
    args = (q, k, v)
    if backward:
        args = tuple(t.detach().requires_grad_() for t in args)
    out, lse = flash_attn_varlen_func(*args, cu_q, cu_k, max(used_q), max(used_k), **seqused,
                                      softmax_scale=case.scale, causal=case.causal, window_size=case.window,
                                      softcap=case.softcap, deterministic=case.deterministic, return_lse=True)
    if backward:
        dout = (torch.randn(out.shape, device="cuda", generator=g) * case.magnitude).to(dt)
        dout[unused_q] = float("nan")
        grads = torch.autograd.grad(out, args, dout)
    torch.cuda.synchronize()
    check_varlen_forward(out.detach(), lse, q, k, v, cu_q.tolist(), cu_k.tolist(), used_q, used_k, scale,
                         case.causal, case.window, case.softcap)
    if backward:
        check_varlen_grads(grads, q, k, v, dout, cu_q.tolist(), cu_k.tolist(), scale, case.causal,
                           case.window, case.softcap, out=out.detach(), used_q=used_q, used_k=used_k)
    return None


def _past_used(starts: list, used) -> list:
    """The packed rows past each sequence's used ones (starts: cu_seqlens as a list)."""
    return [r for i, n in enumerate(used) for r in range(starts[i] + n, starts[i + 1])]


def make_descales(case: Case, device="cuda"):
    """FP8 cases' (q, k, v) descales, (batch, heads_k) float32 or None; "token": q's (batch, heads_q,
    seqlen_q) and k's (batch, heads_k, seqlen_k)."""
    import torch

    if case.descale == "none":
        return None, None, None
    g = torch.Generator(device=device).manual_seed(case.seed + 1)
    if case.descale == "scalar":
        values = 0.5 + torch.rand(3, device=device, generator=g)
        return tuple(x.expand(case.b, case.hk) for x in values)
    if case.descale == "token":
        shapes = ((case.b, case.hq, case.sq), (case.b, case.hk, case.sk), (case.b, case.hk))
        return tuple(0.5 + torch.rand(*shape, device=device, generator=g) for shape in shapes)
    return tuple(0.5 + torch.rand(case.b, case.hk, device=device, generator=g) for _ in range(3))


def _page_table(case: Case) -> list[list[int]]:
    """A paged case's table rows: each item's pages a draw without repeats from the cache's pages
    (shuffled: no order, no run of neighbours), from the case's seed; the entries past the pages an item
    uses (its cache_seqlens plus the append) garbage: -1, a page far past the cache, another item's
    first page."""
    d = case.decode
    rng = random.Random(f"page table {case.seed}")
    per_item = d.capacity // d.page_size
    pages = rng.sample(range(d.cache_rows), case.b * per_item)
    table = [pages[i * per_item:(i + 1) * per_item] for i in range(case.b)]
    for i, row in enumerate(table):
        garbage = (-1, 1 << 30, pages[(i + 1) % case.b * per_item])
        for j in range(-(-(d.cache_seqlens[i] + d.new) // d.page_size), per_item):
            row[j] = rng.choice(garbage)
    return table


def make_decode_inputs(case: Case, device="cuda"):
    """(q, k_cache, v_cache, the call's other arguments) of a decode case, from its seed: every cache
    slot outside an item's keys before the call (positions [cache_leftpad, cache_seqlens) of its row or
    pages) NaN, which must stay out of every result; a preallocated out (case.decode.out) NaN."""
    import torch

    from flashhopper.accuracy import cache_index

    d = case.decode
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    g = torch.Generator(device=device).manual_seed(case.seed)

    def randn(*shape):
        return (torch.randn(*shape, device=device, generator=g) * case.magnitude).to(dt)

    dv = case.dv or case.hdim
    rows = (d.cache_rows, d.page_size or d.capacity, case.hk)
    k_cache, v_cache = randn(*rows, case.hdim), randn(*rows, dv)
    q = randn(case.b, case.sq, case.hq, case.hdim)
    new = (None, None)
    if d.new:
        new = randn(case.b, d.new, case.hk, case.hdim), randn(case.b, d.new, case.hk, dv)

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=device) if values else None

    table = int32(_page_table(case)) if d.page_size else None
    live = torch.zeros(rows[:2], dtype=torch.bool, device=device)
    left = d.leftpad or (0,) * case.b
    for i, n in enumerate(d.cache_seqlens):
        positions = torch.arange(left[i], n, device=device)
        live[cache_index(k_cache, i, positions, row=d.batch_idx[i] if d.batch_idx else None,
                         page_table=table)] = True
    for cache in (k_cache, v_cache):
        cache[~live] = float("nan")
    call = dict(k=new[0], v=new[1], cache_seqlens=int32(d.cache_seqlens), cache_batch_idx=int32(d.batch_idx),
                cache_leftpad=int32(d.leftpad), page_table=table, softmax_scale=case.scale,
                causal=case.causal, window_size=case.window, softcap=case.softcap, num_splits=d.num_splits,
                pack_gqa=d.pack_gqa, return_lse=d.return_lse)
    if d.out:
        call["out"] = torch.full((*q.shape[:-1], dv), float("nan"), dtype=dt, device=device)
    if d.packed_q:
        cu_q = torch.arange(0, case.b * case.sq + 1, case.sq, dtype=torch.int32, device=device)
        call.update(cu_seqlens_q=cu_q, max_seqlen_q=case.sq)
        if d.out:
            call["out"] = call["out"].flatten(0, 1)
    return q, k_cache, v_cache, call


@contextlib.contextmanager
def decode_paths(decode: Decode):
    """The gated decode paths as the case drew them, for the call: the opt-ins of the 1-warpgroup decode
    tile and of the split inside the kernel set to 1 or 0, whatever the caller's environment says
    (restored after), so that a reproducer runs the path it failed on."""
    from flashhopper import validation

    wanted = {validation.DECODE_TILE_OPT_IN: decode.decode_tile,
              validation.DECODE_SPLIT_OPT_IN: decode.split_in_kernel}
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update({name: "1" if on else "0" for name, on in wanted.items()})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_decode(case: Case, *, device="cuda", backend="auto") -> None:
    """A decode case through flash_attn_with_kvcache on its drawn path (decode_paths), checked by
    accuracy.check_kvcache: each item by the rule against its keys, the append element by element, every
    other cache entry unchanged, the outputs NaN-poisoned before the call (runtime.poison, and the
    preallocated out). Raises AssertionError on a failure. backend="reference" (any device: the CPU
    tests) runs the float64 reference with the same append instead of the kernels."""
    import torch

    from flashhopper import flash_attn_with_kvcache
    from flashhopper.accuracy import check_kvcache

    if backend != "reference":
        from flashhopper.hopper import runtime

        runtime.poison = True  # every output and workspace starts as NaN
    d = case.decode
    q, k_cache, v_cache, call = make_decode_inputs(case, device)
    before = (k_cache.clone(), v_cache.clone())
    with decode_paths(d):
        result = flash_attn_with_kvcache(q.flatten(0, 1) if d.packed_q else q, k_cache, v_cache,
                                         backend=backend, **call)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    out, lse = result if d.return_lse else (result, None)
    assert not d.out or out is call["out"], "out: not the preallocated tensor"
    if d.packed_q:  # back to (b, s_q, hq, dv) and (b, hq, s_q)
        assert out.shape == (case.b * case.sq, *out.shape[1:]), f"packed out of shape {tuple(out.shape)}"
        out = out.unflatten(0, (case.b, case.sq))
        if lse is not None:
            assert lse.shape == (case.hq, case.b * case.sq), f"packed lse of shape {tuple(lse.shape)}"
            lse = lse.unflatten(1, (case.b, case.sq)).transpose(0, 1)
    scale = case.scale if case.scale is not None else case.hdim ** -0.5
    check_kvcache(out, lse, q, k_cache, v_cache, list(d.cache_seqlens), scale=scale, causal=case.causal,
                  window=case.window, softcap=case.softcap, k_new=call["k"], v_new=call["v"], before=before,
                  cache_batch_idx=list(d.batch_idx) or None, cache_leftpad=list(d.leftpad) or None,
                  page_table=call["page_table"])


def _described(exc: Exception) -> str:
    """A failure in one line: an assertion's message, or a crash's or a refusal's type and message."""
    if isinstance(exc, AssertionError):
        return str(exc).splitlines()[0][:300] if str(exc) else "AssertionError"
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def run(case: Case, backward: bool = True, *, device="cuda", backend="auto") -> str | None:
    """The case through flash_attn_func (varlen: run_varlen; decode: run_decode), checked by the rule:
    None, or what failed. `device` and `backend` are a decode case's (run_decode); the others run on the
    GPU."""
    if case.decode is not None:
        try:
            run_decode(case, device=device, backend=backend)
        except Exception as exc:  # a crash or a refusal is a failure too
            return _described(exc)
        return None
    import torch

    from flashhopper import flash_attn_func
    from flashhopper.accuracy import check_forward, check_grads
    from flashhopper.hopper import runtime
    from flashhopper.validation import FP8_OPT_IN, SEQUSED_BWD_OPT_IN

    runtime.poison = True  # every output and workspace starts as NaN
    q, k, v, dout = make_inputs(case)
    scale = case.scale if case.scale is not None else case.hdim ** -0.5
    kw = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, softmax_scale=case.scale)
    fp8 = case.dtype in FP8_DTYPES
    varlen_bwd = backward
    backward = backward and not fp8 and not case.varlen  # no FP8 backward; varlen: run_varlen
    # the fuzzer is how the gated paths get verified: it runs them before their opt-in goes
    os.environ.setdefault(FP8_OPT_IN, "1")
    os.environ.setdefault(SEQUSED_BWD_OPT_IN, "1")
    descales = make_descales(case) if fp8 else (None, None, None)
    if fp8:
        kw.update(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    try:
        if case.varlen:
            return run_varlen(case, varlen_bwd)
        if backward:
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            out, lse = flash_attn_func(qg, kg, vg, return_lse=True, deterministic=case.deterministic, **kw)
            grads = torch.autograd.grad(out, (qg, kg, vg), dout)
        elif fp8 and not fp8_lse(case):  # no LSE asked: the kernel may sum P by the tensor cores
            out, lse = flash_attn_func(q, k, v, **kw), None
        else:
            out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
        torch.cuda.synchronize()
        check_forward(out.detach(), lse, q, k, v, scale, case.causal, case.window, case.softcap, descales)
        if backward:
            check_grads(grads, q, k, v, dout, scale, case.causal, case.window, case.softcap, out=out.detach())
    except Exception as exc:  # a crash or a refusal is a failure too
        return _described(exc)
    return None


def decode_attention_config(dtype: str, hdim: int, dv: int, causal: bool, window, softcap: bool, *,
                            rearranged: bool, tile: bool, split: bool, page_size: int):
    """The attention kernel's config a flash_attn_with_kvcache call launches (kvcache.py): with one query
    token and no window rearranged (`rearranged`, splitkv.plan: no mask) on the split walk inside the
    kernel (`split`), else on the 1-warpgroup decode tile (`tile`) or the varlen tile; otherwise the
    varlen forward of the mask. Over pages of `page_size` rows (0: none) the paged config where the
    kernels serve them (its page_size then page_size; else the call gathers the pages first)."""
    from flashhopper import plan

    if rearranged and split:
        return plan.fwd_plan_split(dtype, hdim, softcap, dv, page_size, decode_tile=tile)
    if rearranged and tile:
        return plan.fwd_plan_decode(dtype, hdim, softcap, dv, page_size)
    if rearranged:  # one query token at the end of its keys: no mask
        causal, window = False, (-1, -1)
    return plan.fwd_plan_varlen(dtype, hdim, causal, window, softcap, dv, page_size)[0]


def _decode_switches(decode: Decode) -> tuple[bool, bool]:
    """(decode tile, split inside the kernel) as the call runs them: drawn on, or verified (on for all)."""
    from flashhopper import validation

    return (decode.decode_tile or validation.DECODE_TILE_GPU_VERIFIED,
            decode.split_in_kernel or validation.DECODE_SPLIT_GPU_VERIFIED)


def _decode_kernels(case: Case, sms: int) -> set:
    """The configs a decode case's call launches on `sms` SMs (kvcache.py's choices, planned here on
    the host): its attention kernel (decode_attention_config; a paged cache read in place where there
    is no cache_leftpad and the kernels serve the page size, else gathered into a contiguous copy first)
    and the merge kernel where the call merges or unpacks partials (the rearranged call on the varlen
    kernel; the split inside the kernel with more than one split)."""
    from flashhopper import splitkv, validation
    from flashhopper.config import COMBINE_MAX_SPLITS, CombineConfig

    d = case.decode
    tile, split = _decode_switches(d)

    def planned(page_size: int):
        align = math.lcm(splitkv.CHUNK_ALIGN, page_size) if page_size else splitkv.CHUNK_ALIGN
        layout = splitkv.plan(batch=case.b, seqlen_q=case.sq, heads_q=case.hq, heads_k=case.hk,
                              capacity=d.capacity, window=case.window, num_splits=d.num_splits,
                              pack_gqa=d.pack_gqa, sms=sms, align=align)
        cfg = decode_attention_config(case.dtype, case.hdim, case.dv, case.causal, case.window,
                                      case.softcap > 0, rearranged=layout.rearranged, tile=tile,
                                      split=split and layout.rearranged, page_size=page_size)
        return layout, cfg

    layout, cfg = planned(0)
    paged = None
    if d.page_size and not d.leftpad and validation.paged_tma_enabled():
        paged = planned(d.page_size)
    served = paged is not None and paged[1].page_size == d.page_size  # the kernels read the pages in place
    qlen = _qlen_kernels(case, tile, split, sms, paged_served=served)
    if qlen is not None:
        return qlen
    if served:
        layout, cfg = paged
    if split and layout.rearranged:
        merged = layout.splits > 1  # one split: the kernel stores into the output itself
    else:
        merged = layout.rearranged and validation.decode_merge_enabled()
    if merged and layout.splits <= COMBINE_MAX_SPLITS:
        return {cfg, CombineConfig(case.dtype, case.dv or case.hdim, case.dtype)}
    return {cfg}


def _qlen_kernels(case: Case, tile: bool, split: bool, sms: int, paged_served: bool) -> set | None:
    """The configs of a decode case that kvcache runs with its tokens packed (kvcache._qlen_taken: 2 to 16
    query tokens, no window, the split inside the kernel on, a cache with rows), else None: the split
    kernel (causal over the packed tokens with a mask; over the pages where it serves them,
    kvcache._qlen_pages_served) and its merge where the keys split. Pages it does not serve go to the
    call's paged plan, which reads them with the one-token path's kernels where `paged_served` (None then),
    else gathers them for this path."""
    from flashhopper import plan, splitkv, validation
    from flashhopper.config import CombineConfig

    d = case.decode
    if not (validation.decode_qlen_enabled() and split and case.sq in splitkv.QLEN_RANGE
            and tuple(case.window) == (-1, -1) and d.cache_rows * (d.page_size or d.capacity) > 0):
        return None
    softcap = case.softcap > 0

    def kernel(page_size: int):
        return plan.fwd_plan_split(case.dtype, case.hdim, softcap, case.dv, page_size, decode_tile=tile,
                                   causal=case.causal)

    page_size, packed = 0, kernel(0)
    if d.page_size and not d.leftpad and validation.paged_tma_enabled():
        paged = kernel(d.page_size)
        if paged.page_size == d.page_size:
            page_size, packed = d.page_size, paged  # the kernel reads the pages in place
        elif paged_served:
            return None
    align = math.lcm(splitkv.CHUNK_ALIGN, page_size) if page_size else splitkv.CHUNK_ALIGN
    layout = splitkv.plan_qlen(batch=case.b, heads_q=case.hq, heads_k=case.hk, capacity=d.capacity,
                               num_splits=d.num_splits, sms=sms, align=align)
    merge = CombineConfig(case.dtype, case.dv or case.hdim, case.dtype)
    return {packed} | ({merge} if layout.splits > 1 else set())


def decode_kernels_reachable(experimental: bool = False) -> set:
    """Every config a decode case can launch: decode_attention_config over every 16-bit dtype, head dim
    pair, mask kind, softcap, arrangement, decode path (the split inside the kernel only `experimental`,
    as draw) and page size (those the kernels do not serve gathered: page size 0), the split kernel causal
    over packed tokens (several query tokens), and the merge kernels."""
    from flashhopper import plan, validation

    tiles = (True,) if validation.DECODE_TILE_GPU_VERIFIED else (False, True)
    splits = (True,) if validation.DECODE_SPLIT_GPU_VERIFIED else (False, True) if experimental else (False,)
    paths = [(False, False, False), *itertools.product((True,), tiles, splits)]
    hit = set(plan.combine_kernels())
    for dtype, hdim in itertools.product(DTYPES, SUPPORTED_HDIMS):
        shapes = itertools.product(plan.value_hdims(hdim), plan.MASKS, (False, True), (0, *PAGE_SIZES), paths)
        for dv, (causal, window), softcap, page_size, (rearranged, tile, split) in shapes:
            if rearranged and tuple(window) != (-1, -1):
                continue
            cfg = decode_attention_config(dtype, hdim, dv, causal, window, softcap, rearranged=rearranged,
                                          tile=tile, split=split, page_size=page_size)
            if cfg.page_size == page_size:
                hit.add(cfg)
            if rearranged and split and causal:  # several query tokens packed, causal (kvcache._qlen_call)
                cfg = plan.fwd_plan_split(dtype, hdim, softcap, dv, page_size, decode_tile=tile, causal=True)
                if cfg.page_size == page_size:
                    hit.add(cfg)
    return hit


def reachable_kernels(group: str = "all", backward: bool = True, experimental: bool = False) -> set:
    """The kernel configs the strata `group` can reach (the denominator of the count of configs hit):
    the dispatched ones (plan.dispatched_kernels) for attention, decode_kernels_reachable for decode."""
    from flashhopper.plan import dispatched_kernels

    reachable = set()
    if group in ("all", "attention"):
        reachable |= set(dispatched_kernels(forward=True, backward=backward))
    if group == "fp8":
        reachable |= set(dispatched_kernels(FP8_DTYPES, forward=True, backward=False))
    if group in ("all", "decode"):
        reachable |= decode_kernels_reachable(experimental)
    return reachable


def kernels_of(case: Case, backward: bool, sms: int = DEFAULT_SMS) -> set:
    """The kernel configs the case dispatches (for the count of configs hit); a decode case's as planned
    for `sms` SMs."""
    from flashhopper import plan
    from flashhopper.config import BwdPreConfig

    if case.decode is not None:
        return _decode_kernels(case, sms)
    if case.varlen:
        hit = {plan.fwd_plan_varlen(case.dtype, case.hdim, case.causal, case.window, case.softcap > 0,
                                    case.dv)[0]}
        if backward:
            cfg = plan.bwd_plan_varlen(case.dtype, case.hdim, case.causal, case.window, case.softcap > 0,
                                       case.deterministic)[0]
            hit |= {cfg, BwdPreConfig.of(cfg, case.dv)}
        return hit
    kind = "token" if case.descale == "token" else "head"
    hit = {plan.fwd_plan(case.dtype, case.hdim, case.sq, case.sk, case.causal, case.window,
                         case.softcap > 0, case.dv, qk_descale=kind,
                         need_lse=case.dtype not in FP8_DTYPES or fp8_lse(case))[0]}
    if backward and case.dtype in DTYPES:
        cfg = plan.bwd_plan(case.dtype, case.hdim, case.sq, case.sk, case.causal, case.window,
                            case.softcap > 0, case.deterministic)[0]
        hit |= {cfg, BwdPreConfig.of(cfg, case.dv)}
    return hit


def _sm_count() -> int:
    """The GPU's SMs (what kvcache plans a decode call for), DEFAULT_SMS without one."""
    import torch

    if not torch.cuda.is_available():
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def fuzz(cases: int, seed: int, backward: bool = True, log=print, shard: tuple[int, int] = (0, 1),
         group: str = "all", experimental: bool = False) -> dict:
    """Run cases i < `cases` with i % n == k for shard (k, n), drawn from the strata `group` (STRATA;
    `experimental` as draw's); print each failure's reproducer; return the counts, the failures' JSON and
    the configs hit (as reprs, for merging shards)."""
    k, n = shard
    failures, hit = [], set()
    mine = range(k, cases, n)
    sms = _sm_count()
    for done, i in enumerate(mine, 1):
        case = draw(i, seed, group, experimental)
        hit |= kernels_of(case, backward, sms)
        problem = run(case, backward)
        if problem:
            failures.append(case.to_json())
            flag = "" if backward else " --no-bwd"
            log(f"FAIL {problem}\n  reproduce: flashhopper fuzz --case '{case.to_json()}'{flag}")
        if done % 100 == 0:
            log(f"{done} cases, {len(failures)} failed, {len(hit)} kernel configs hit")
    reachable = reachable_kernels(group, backward, experimental)
    log(f"{len(mine)} cases (seed {seed}, shard {k}/{n}), {len(failures)} failed; kernel configs hit: "
        f"{len(hit & reachable)} of {len(reachable)} dispatched")
    return {"cases": len(mine), "failed": len(failures), "configs_hit": len(hit & reachable),
            "configs": len(reachable), "failures": failures, "hit": sorted(repr(c) for c in hit & reachable)}


def fuzz_parallel(cases: int, seed: int, jobs: int, backward: bool = True, log=print,
                  group: str = "all", experimental: bool = False) -> dict:
    """`fuzz` in `jobs` processes sharing the GPU (shard k of n each), merged: the draws are those of
    one process, only spread."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="flashhopper-fuzz-") as tmp:
        procs = []
        for k in range(jobs):
            cmd = [sys.executable, "-m", "flashhopper.cli", "fuzz", "--cases", str(cases),
                   "--seed", str(seed), "--strata", group, "--shard", f"{k}/{jobs}",
                   "--json", os.path.join(tmp, f"{k}.json")]
            cmd += ([] if backward else ["--no-bwd"]) + (["--experimental"] if experimental else [])
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        reports = []
        for k, proc in enumerate(procs):
            out, _ = proc.communicate()
            for line in out.splitlines():
                if line.startswith(("FAIL", "  reproduce", "Traceback")) or "Error" in line:
                    log(line)
            path = os.path.join(tmp, f"{k}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"fuzz shard {k}/{jobs} ended without a report (exit {proc.returncode}):\n"
                                   + out[-2000:])
            with open(path) as f:
                reports.append(json.load(f))
    hit = set().union(*(r["hit"] for r in reports))
    merged = {"cases": sum(r["cases"] for r in reports), "failed": sum(r["failed"] for r in reports),
              "configs_hit": len(hit), "configs": reports[0]["configs"],
              "failures": [f for r in reports for f in r["failures"]], "hit": sorted(hit)}
    log(f"{merged['cases']} cases (seed {seed}, {jobs} processes), {merged['failed']} failed; kernel configs "
        f"hit: {merged['configs_hit']} of {merged['configs']} dispatched")
    return merged
