"""flashhopper as a Hugging Face transformers attention implementation (transformers >= 5).

    from flashhopper.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=register(), dtype=torch.bfloat16)

`register()` adds `attention_forward` to transformers' AttentionInterface and, for its masks, the
FlashAttention one (None without padding, else the 2D padding mask: a name with no mask function
would have its masks silently dropped). The name has no "flash" in it: transformers 5 takes such
names for kernels to import from the hub. Batches without padding run flash_attn_func (forward and
backward); a 2D padding mask, or packed sequences (cu_seq_lens_q / _k from a flattening collator, or
its position_ids alone, restarting at 0 for each sequence), run flash_attn_varlen_func (forward and
backward); decoding with a KV cache is the dense call with one query row per sequence (causal aligned
bottom-right), which flash_attn_func runs by its decode paths (PackGQA, the keys split:
kvcache.dense_decode); a left-padded batch's decode steps go the same way, the padding as cache_leftpad,
the cache read in place. The mask and the position_ids are looked at once a forward step (the host
syncs on the first layer's call: _mask_info, the packing's in _padded, _position_packing), not once a
layer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

NAME = "hopper_attn"


def register(name: str = NAME, backend: str = "auto") -> str:
    """Register the implementation (and its mask function) under `name`; returns the name.
    `backend`: flash_attn_func's ("reference" runs the exact float64 reference: tests, CPUs)."""
    if "flash" in name:
        raise ValueError(f"name {name!r}: transformers takes names containing 'flash' for hub kernels; "
                         "pick another")
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    def forward(module, query, key, value, attention_mask, **kwargs):
        return attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def _target_dtype(query: torch.Tensor, module) -> torch.dtype:
    """16-bit inputs as they are; fp32 ones (layer norms kept in fp32, PEFT) in the model's 16-bit
    dtype, else bf16."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    dtype = getattr(getattr(module, "config", None), "dtype", None)
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, backend="auto", **kwargs):
    """transformers' attention contract: query (B, H, S_q, D), key / value (B, H_kv, S_kv, D) (GQA
    not repeated), attention_mask None or (B, S_kv) padding; returns ((B, S_q, H, Dv), None)."""
    from flashhopper import flash_attn_func, flash_attn_varlen_func

    if dropout:
        raise NotImplementedError("flashhopper has no attention dropout; set attention_dropout=0")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by flashhopper")
    in_dtype = query.dtype
    dtype = _target_dtype(query, module)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    opts = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=softcap or 0.0,
                backend=backend)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    packed = None  # (cu_seqlens_q, cu_seqlens_k, max_q, max_k) of sequences packed in one row, batch 1
    if cu_q is not None and cu_k is not None:  # a flattening collator's
        packed = cu_q, cu_k, int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    elif attention_mask is None and (found := _position_packing(kwargs.get("position_ids"), q, k)):
        packed = found[0], found[0], found[1], found[1]  # by position_ids alone (the collator's default)
    if packed is not None:
        cu_q, cu_k, max_q, max_k = packed
        b, s, h, _ = q.shape
        out = flash_attn_varlen_func(q.reshape(-1, h, q.shape[-1]), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_q.to(torch.int32), cu_k.to(torch.int32),
                                     max_q, max_k, **opts)
        out = out.reshape(b, s, h, -1)
    elif attention_mask is not None and not (info := _mask_info(attention_mask, q.shape[1])).no_padding:
        out = _padded(q, k, v, attention_mask, opts, info)
    else:
        out = flash_attn_func(q, k, v, **opts)
    return out.to(in_dtype).contiguous(), None


def _once_a_step(slot: list, tensor: torch.Tensor, key, make):
    """make()'s result for `tensor` (and `key`), kept in `slot`: transformers passes one mask / position_ids
    object to every layer of a step, so an analysis that syncs with the host runs on the first layer's call
    only, and again after an in-place change to the tensor (its version)."""
    last = slot[0]
    if last is not None and last[0]() is tensor and last[1] == tensor._version and last[2] == key:
        return last[3]
    value = make()
    slot[0] = (weakref.ref(tensor), tensor._version, key, value)
    return value


_last_positions: list = [None]  # _once_a_step's slot for _position_packing


def _position_packing(position_ids, q, k):
    """(cu_seqlens int32, the longest length) of the sequences a flattening collator packed into one row
    and marked by position_ids alone (no cu_seq_lens, no mask), found as transformers' FlashAttention
    path finds them: packed where the positions are not one run from their least value, each sequence
    starting where a position equals it (0, from the collator). None where nothing is packed: batch > 1,
    a single query, keys other than the queries (a KV cache), one run of positions, or several rows of
    positions (multimodal rotary's (3, 1, s): one sequence, as SDPA reads them). One host sync a step
    (the first layer's call)."""
    if position_ids is None or q.shape[0] != 1 or q.shape[1] < 2 or k.shape[1] != q.shape[1]:
        return None
    n = q.shape[1]
    if position_ids.shape[-1] != n:
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)} for {n} query positions; "
                         "accepted: one position per token of the packed row (the last dim)")
    if position_ids.numel() != n:
        return None

    def analyse():
        pos = position_ids.reshape(-1)
        low = pos.min()
        if bool((pos == torch.arange(n, device=pos.device, dtype=pos.dtype) + low).all()):  # the sync
            return None
        starts = torch.nonzero(pos[1:] == low).flatten() + 1  # (a row may start inside a sequence)
        cu = torch.cat((starts.new_zeros(1), starts, starts.new_full((1,), n))).to(q.device, torch.int32)
        return cu, int(cu.diff().max())

    return _once_a_step(_last_positions, position_ids, None, analyse)


@dataclass(frozen=True)
class MaskInfo:
    """What the attention calls of one forward step need to know of its (B, S_kv) padding mask: no
    padding at all; left padding only (zeros then ones in every row) with the last s_q queries all
    valid; each row's padding (int32 (B,) on the mask's device, a cache_leftpad); and, made by the
    first call that packs the valid tokens (_padded), the packing: (cu_seqlens_q, cu_seqlens_k, the
    valid query rows, the valid key rows, max_seqlen_q, max_seqlen_k)."""

    no_padding: bool
    left_padded: bool
    leftpad: torch.Tensor
    packing: list = field(default_factory=list)


_last_mask: list = [None]  # _once_a_step's slot for _mask_info


def _mask_info(mask: torch.Tensor, s_q: int) -> MaskInfo:
    """The mask's MaskInfo, by one host sync on the first call with this mask object (and after an
    in-place change to it), from the cache on the next layers' calls."""
    def analyse():
        valid = mask.bool()
        flags = torch.stack((valid.all(), (valid[:, 1:] >= valid[:, :-1]).all() & valid[:, -s_q:].all()))
        no_padding, left_padded = flags.tolist()
        leftpad = (mask.shape[1] - valid.sum(-1, dtype=torch.int32)).to(torch.int32)
        return MaskInfo(no_padding, left_padded, leftpad)

    return _once_a_step(_last_mask, mask, s_q, analyse)


def _left_padded_decode(q, k, v, opts, info: MaskInfo):
    """Generation's decode steps over a left-padded batch (1-16 queries, every one valid, each row's keys
    the last of its cache: zeros then ones in the mask) without grad, by the decode paths
    (kvcache.dense_decode with the padding as cache_leftpad): the cache read in place, where the packing
    below copies every valid key and value each step. None where that does not apply (then _padded packs)."""
    from flashhopper import splitkv, validation
    from flashhopper.kvcache import dense_decode

    s_q, d = q.shape[1], q.shape[-1]
    # (dense_decode takes no other shapes: checked here before the validation it needs)
    if (not info.left_padded or opts["backend"] == "reference" or s_q not in splitkv.DECODE_TOKENS
            or opts["window_size"] != (-1, -1) or validation.needs_grad(q, k, v)):
        return None
    validation.require_hopper(q, opts["backend"])
    validation.check_tensors(q, k, v)
    decoded = dense_decode(q, k, v, validation.normalize_scale(opts["softmax_scale"], d), opts["causal"],
                           (-1, -1), validation.normalize_softcap(opts["softcap"]), leftpad=info.leftpad)
    return None if decoded is None else decoded[0]


def _padded(q, k, v, mask, opts, info: MaskInfo):
    """A (B, S_kv) padding mask: the valid tokens packed, attention per sequence, scattered back (rows
    of padding queries come out 0). Queries are the last S_q positions of the mask (transformers
    pads on the left for generation, so decode steps keep their keys)."""
    from flashhopper import flash_attn_varlen_func

    b, s_q, h, d = q.shape
    s_k = k.shape[1]
    decoded = _left_padded_decode(q, k, v, opts, info)
    if decoded is not None:
        return decoded
    if not info.packing:  # the step's first layer: its host syncs (the rows' counts, the longest lengths)
        mask = mask.bool()
        mask_q = mask[:, -s_q:]
        lens_q, lens_k = mask_q.sum(-1, dtype=torch.int32), mask.sum(-1, dtype=torch.int32)
        cu_q, cu_k = (torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
                      for lens in (lens_q, lens_k))
        rows_q, rows_k = mask_q.flatten().nonzero().flatten(), mask.flatten().nonzero().flatten()
        info.packing.extend((cu_q, cu_k, rows_q, rows_k, int(lens_q.max()), int(lens_k.max())))
    cu_q, cu_k, rows_q, rows_k, max_q, max_k = info.packing
    out = flash_attn_varlen_func(q.reshape(b * s_q, h, d)[rows_q], k.reshape(b * s_k, *k.shape[2:])[rows_k],
                                 v.reshape(b * s_k, *v.shape[2:])[rows_k], cu_q, cu_k, max_q, max_k, **opts)
    full = out.new_zeros(b * s_q, h, out.shape[-1])
    full[rows_q] = out
    return full.reshape(b, s_q, h, -1)
