"""`flashhopper fuzz`: random cases, stratified over the dispatched kernels, checked by the one
correctness rule (flashhopper/accuracy.py); every failure printed as a one-line reproducer.

Case i draws its stratum (dtype, head dim, mask kind, softcap, deterministic) round-robin, so N cases
cover every stratum N / 40 times, then from its own seed: lengths (bracket edges of the dispatch,
odd and tiny ones, or log-uniform up to 4096), batch, heads and GQA ratio, window bounds, layout
(contiguous, heads strided, packed qkv), a softmax scale (default or drawn) and the inputs'
magnitude. The forward is checked, then (unless --no-bwd) the backward.
"""

from __future__ import annotations

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

    @property
    def varlen(self) -> bool:
        return bool(self.seqlens)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Case:
        fields = json.loads(text)
        fields["window"] = tuple(fields["window"])
        for name in ("seqlens", "seqused"):
            fields[name] = tuple(tuple(pair) for pair in fields.get(name, ()))
        return cls(**fields)

    @property
    def causal(self) -> bool:
        return self.mask in ("causal", "causal_window")


def strata() -> list[tuple]:
    """(dtype, hdim, mask, softcap, deterministic, varlen): 16-bit with both backward modes, dense and
    varlen; FP8 (forward only)."""
    return (list(itertools.product(DTYPES, SUPPORTED_HDIMS, MASKS, (0.0, 15.0), (False, True), (False,)))
            + list(itertools.product(FP8_DTYPES, SUPPORTED_HDIMS, MASKS, (0.0, 15.0), (False,), (False,)))
            + list(itertools.product(DTYPES, SUPPORTED_HDIMS, MASKS, (0.0, 15.0), (False, True), (True,))))


def _length(rng: random.Random) -> int:
    if rng.random() < 0.5:
        return rng.choice(_EDGES)
    return max(1, int(math.exp(rng.uniform(0.0, math.log(4096)))))


def draw(index: int, seed: int) -> Case:
    """Case `index` of a fuzz run seeded `seed` (the same on every machine)."""
    table = strata()
    dtype, hdim, mask, softcap, deterministic, varlen = table[index % len(table)]
    case_seed = seed * 1_000_003 + index
    rng = random.Random(case_seed)
    sq, sk = _length(rng), _length(rng)
    ratio = rng.choice((1, 1, 2, 4, 8))
    hk = rng.choice((1, 1, 2, 3))
    hq = hk * ratio
    b = rng.choice((1, 1, 2, 3))
    while b * hq * sq * sk > _MAX_SCORES and b > 1:
        b -= 1
    while hq * sq * sk > _MAX_SCORES:
        sq, sk = max(1, sq // 2), max(1, sk // 2)
    left = rng.choice((0, 1, 17, 64, 200, 1000))
    right = rng.choice((0, 3, 64, 500)) if mask == "window" else -1
    window = {"none": (-1, -1), "causal": (-1, -1), "window": (left, right),
              "causal_window": (left, -1)}[mask]
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


def run(case: Case, backward: bool = True) -> str | None:
    """The case through flash_attn_func, checked by the rule: None, or what failed."""
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
        else:
            out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
        torch.cuda.synchronize()
        check_forward(out.detach(), lse, q, k, v, scale, case.causal, case.window, case.softcap, descales)
        if backward:
            check_grads(grads, q, k, v, dout, scale, case.causal, case.window, case.softcap, out=out.detach())
    except AssertionError as exc:
        return str(exc).splitlines()[0][:300]
    except Exception as exc:  # a crash or a refusal is a failure too
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    return None


def kernels_of(case: Case, backward: bool) -> set:
    """The kernel configs the case dispatches (for the count of configs hit)."""
    from flashhopper import plan
    from flashhopper.config import BwdPreConfig

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
                         case.softcap > 0, case.dv, qk_descale=kind)[0]}
    if backward and case.dtype in DTYPES:
        cfg = plan.bwd_plan(case.dtype, case.hdim, case.sq, case.sk, case.causal, case.window,
                            case.softcap > 0, case.deterministic)[0]
        hit |= {cfg, BwdPreConfig.of(cfg, case.dv)}
    return hit


def fuzz(cases: int, seed: int, backward: bool = True, log=print, shard: tuple[int, int] = (0, 1)) -> dict:
    """Run cases i < `cases` with i % n == k for shard (k, n); print each failure's reproducer;
    return the counts, the failures' JSON and the configs hit (as reprs, for merging shards)."""
    from flashhopper.plan import dispatched_kernels

    k, n = shard
    failures, hit = [], set()
    mine = range(k, cases, n)
    for done, i in enumerate(mine, 1):
        case = draw(i, seed)
        hit |= kernels_of(case, backward)
        problem = run(case, backward)
        if problem:
            failures.append(case.to_json())
            flag = "" if backward else " --no-bwd"
            log(f"FAIL {problem}\n  reproduce: flashhopper fuzz --case '{case.to_json()}'{flag}")
        if done % 100 == 0:
            log(f"{done} cases, {len(failures)} failed, {len(hit)} kernel configs hit")
    reachable = set(dispatched_kernels(forward=True, backward=backward))
    log(f"{len(mine)} cases (seed {seed}, shard {k}/{n}), {len(failures)} failed; kernel configs hit: "
        f"{len(hit & reachable)} of {len(reachable)} dispatched")
    return {"cases": len(mine), "failed": len(failures), "configs_hit": len(hit & reachable),
            "configs": len(reachable), "failures": failures, "hit": sorted(repr(c) for c in hit & reachable)}


def fuzz_parallel(cases: int, seed: int, jobs: int, backward: bool = True, log=print) -> dict:
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
                   "--seed", str(seed), "--shard", f"{k}/{jobs}", "--json", os.path.join(tmp, f"{k}.json")]
            procs.append(subprocess.Popen(cmd + ([] if backward else ["--no-bwd"]), stdout=subprocess.PIPE,
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
