"""What the benchmark times: flashhopper and its peers, each as a `Provider`.

A provider is built from one differentiable `attn(q, k, v, causal) -> out` (or `(out, lse)`), so
the forward and the backward benchmark time the same call.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Provider:
    name: str
    make: Callable  # (q, k, v, causal) -> zero-argument callable that runs one forward
    context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    # (q, k, v, dout, causal) -> zero-argument callable that runs one backward (the forward is run
    # by the maker, outside the timing); None: this provider has no backward to time
    make_bwd: Callable | None = None

    def timed_call(self, q, k, v, causal, dout=None) -> Callable:
        """The call to time: a forward, or with `dout` a backward."""
        if dout is None:
            return self.make(q, k, v, causal)
        if self.make_bwd is None:
            raise NotImplementedError(f"{self.name} has no backward to time")
        return self.make_bwd(q, k, v, dout, causal)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def heads_first(t: torch.Tensor) -> torch.Tensor:
    """(b, s, h, d) -> the (b, h, s, d) view SDPA wants (same storage, no copy)."""
    return t.transpose(1, 2)


def differentiable(name: str, attn: Callable, context=contextlib.nullcontext, view=_same) -> Provider:
    """A provider timed in both directions from `attn(q, k, v, causal) -> out or (out, lse)`.

    Inputs come as (b, s, h, d); `view` turns them (and dout) into the layout attn takes, outside
    the timed calls. The backward maker runs the forward once on fresh leaves that require grad
    (the caller's tensors are left as they are) and returns a call that times autograd alone.
    """

    def make(q, k, v, causal):
        q, k, v = (view(t) for t in (q, k, v))
        return lambda: attn(q, k, v, causal)

    def make_bwd(q, k, v, dout, causal):
        q, k, v = (view(t).detach().requires_grad_() for t in (q, k, v))
        out = attn(q, k, v, causal)
        out = out[0] if isinstance(out, tuple) else out
        dout = view(dout)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    return Provider(name, make, context, make_bwd)


def sdpa_attn(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa(name: str, backend_name: str) -> Provider:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    return differentiable(name, sdpa_attn, lambda: sdpa_kernel(backend), view=heads_first)


def default_providers() -> list[Provider]:
    from flashhopper.interface import flash_attn_func

    providers = [
        differentiable("flashhopper", lambda q, k, v, c: flash_attn_func(q, k, v, causal=c)),
        _sdpa("fa2", "FLASH_ATTENTION"),
        _sdpa("cudnn", "CUDNN_ATTENTION"),
    ]
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:  # absent, or present but broken: either way not a peer in this run
        print(f"(FA4 not measured: flash_attn.cute unavailable: {exc})", flush=True)
    else:
        # FA4 may return (out, lse); the backward maker takes out
        providers.append(differentiable("fa4", lambda q, k, v, c: fa4(q, k, v, causal=c), _quiet))
    return providers


@contextlib.contextmanager
def _quiet():
    """FA4 warns on every compile about an argument it cannot convert; it is noise in our table."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
