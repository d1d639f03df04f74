"""Where one decode call's time goes: the whole flash_attn_with_kvcache call, its split kernel alone and
its merge alone, each captured in a CUDA graph over `bench --decode`'s rotation of caches (so nothing is
served from the L2) and timed as the bench times it; the split counts given by --splits (0: the plan's);
an empty launch's cost inside a graph beside them; the call with q packed as serving engines pass it
(cu_seqlens_q); the same caches as flash_attn_func's k and v, and through the dense kernel; then the
kernels of one graph replay of the whole call with their durations and the gaps between them
(torch.profiler).

    python3 scripts/decode_timeline.py --batch 1 --context 8192 --splits 0 8 16 32 64

One query token, 32:8 heads at hdim 128, bf16 (the bench's first point), unless told otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from flashhopper import kvcache, splitkv  # noqa: E402
from flashhopper.bench import decode as D  # noqa: E402


def _walk_us(calls, point) -> float:
    D.warm_up(calls, "cuda")
    replay, _ = D.capture(calls)
    return D.replay_ms(replay) * 1e3 / len(calls)


def _pieces(x, layout, scale):
    """(split kernel call, merge call) of kvcache._split_call for one cache, no append."""
    import flashhopper.hopper as hopper

    b, _, hq, d = x.q.shape
    rows = hq // layout.heads_k if layout.pack_gqa else 1
    heads = hq // rows
    q_items = x.q[:, 0].unflatten(1, (heads, rows)).transpose(1, 2)
    k_rows = x.k_cache.view(-1, *x.k_cache.shape[2:])
    v_rows = x.v_cache.view(-1, *x.v_cache.shape[2:])
    split = lambda: hopper.forward_split(  # noqa: E731
        q_items, k_rows, v_rows, x.cache_seqlens, scale, 0.0, splits=layout.splits, chunk=layout.chunk,
        key_rows=x.k_cache.shape[1])
    o, lse = split()
    target = torch.empty(b, 1, hq, d, dtype=x.q.dtype, device=x.q.device)
    out_rows = target[:, 0].unflatten(1, (heads, rows)).transpose(1, 2)
    merge = lambda: splitkv.merge_parts(o, lse.transpose(2, 3), out_rows, None)  # noqa: E731
    return split, merge


def _pdl_off() -> None:
    """The split decode kernel's config and the merge kernel's with pdl=False, from here on."""
    import dataclasses

    import flashhopper.hopper as H
    from flashhopper import plan
    from flashhopper.hopper import runtime

    split, combine = plan.fwd_config_split, runtime.combine_config
    plan.fwd_config_split = lambda cfg: dataclasses.replace(split(cfg), pdl=False)

    def combine_off(*args):
        cfg = combine(*args)
        return None if cfg is None else dataclasses.replace(cfg, pdl=False)

    runtime.combine_config = H.combine_config = combine_off


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("HQ", "HK"))
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--splits", type=int, nargs="+", default=[0])
    ap.add_argument("--no-pdl", action="store_true",
                    help="the split and merge kernels launched without PDL (FwdConfig.pdl, CombineConfig.pdl "
                         "off): the A / B's other arm")
    args = ap.parse_args()
    if args.no_pdl:
        _pdl_off()
    point = D.DecodePoint(args.batch, args.context, 1, args.heads[0], args.heads[1], args.hdim)
    rate = D.copy_rate()["bytes_per_s"]
    inputs = D.decode_inputs(point, torch.bfloat16, "cuda")
    ideal = point.kv_bytes / rate * 1e6
    print(f"{point.label}: {len(inputs)} caches; the KV read at the copy rate {rate / 1e12:.2f} TB/s: "
          f"{ideal:.1f} us")
    empty = torch.zeros(1, device="cuda")
    print(f"empty launch in a graph: {_walk_us([lambda: empty.add_(1)] * 16, point):.2f} us")
    scale = point.hdim ** -0.5
    for n in args.splits:
        layout = splitkv.plan_for(inputs[0].q, point.heads_k, point.context, (-1, -1), n, None, False)
        calls = [lambda x=x, n=n: kvcache.flash_attn_with_kvcache(x.q, x.k_cache, x.v_cache,
                                                                  cache_seqlens=x.cache_seqlens, causal=True,
                                                                  num_splits=n) for x in inputs]
        whole = _walk_us(calls, point)
        line = (f"num_splits {n}: {layout.splits} splits of {layout.chunk} keys; whole call {whole:.1f} us "
                f"({ideal / whole:.2f} of the copy rate)")
        if layout.splits > 1:
            pieces = [_pieces(x, layout, scale) for x in inputs]
            split_us = _walk_us([p[0] for p in pieces], point)
            merge_us = _walk_us([p[1] for p in pieces], point)
            line += f"; split kernel alone {split_us:.1f} us, merge alone {merge_us:.1f} us"
        print(line, flush=True)
    cu_q = torch.arange(point.batch + 1, dtype=torch.int32, device="cuda")
    for max_q, how in ((1, "its decode paths"), (2, "max_seqlen_q 2: the varlen kernel, every query head")):
        packed = [lambda x=x, m=max_q: kvcache.flash_attn_with_kvcache(
            x.q[:, 0], x.k_cache, x.v_cache, cu_seqlens_q=cu_q, max_seqlen_q=m, cache_seqlens=x.cache_seqlens,
            causal=True) for x in inputs]
        us = _walk_us(packed, point)
        print(f"q packed (total_q, hq, d) with cu_seqlens_q, as SGLang and vLLM pass it ({how}): {us:.1f} us "
              f"({ideal / us:.2f} of the copy rate)", flush=True)
    from flashhopper import flash_attn_func
    from flashhopper.hopper import forward

    for name, fn in (("flash_attn_func (kvcache.dense_decode)", lambda x: flash_attn_func(
                          x.q, x.k_cache, x.v_cache, causal=True)),
                     ("the dense kernel (runtime.forward)", lambda x: forward(
                          x.q, x.k_cache, x.v_cache, scale, True, (-1, -1), 0.0))):
        us = _walk_us([lambda x=x, fn=fn: fn(x) for x in inputs], point)
        print(f"the caches as k, v of {name}: {us:.1f} us ({ideal / us:.2f} of the copy rate)", flush=True)
    calls = [lambda x=x: kvcache.flash_attn_with_kvcache(x.q, x.k_cache, x.v_cache,
                                                         cache_seqlens=x.cache_seqlens, causal=True)
             for x in inputs]
    D.warm_up(calls, "cuda")
    replay, _ = D.capture(calls)
    replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    print("one replay of the whole call (the default plan), kernels in order: start, duration, gap (us)")
    last_end = None
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        gap = "" if last_end is None else f"{start - last_end:7.2f}"
        print(f"  {start - kernels[0].time_range.start:8.2f} {end - start:7.2f} {gap:>7}  {e.name[:90]}")
        last_end = end
    return 0


if __name__ == "__main__":
    sys.exit(main())
