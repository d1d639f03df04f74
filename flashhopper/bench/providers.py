"""What the benchmark times: flashhopper and its peers, each as a `Provider`."""

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


def _sdpa(name: str, backend_name: str) -> Provider:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def make(q, k, v, causal):
        # SDPA wants (b, h, s, d); transposed views keep the same storage.
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        return lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return Provider(name, make, lambda: sdpa_kernel(backend))


def default_providers() -> list[Provider]:
    from flashhopper.interface import flash_attn_func

    providers = [
        Provider("flashhopper", lambda q, k, v, c: lambda: flash_attn_func(q, k, v, causal=c)),
        _sdpa("fa2", "FLASH_ATTENTION"),
        _sdpa("cudnn", "CUDNN_ATTENTION"),
    ]
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:  # absent, or present but broken: either way not a peer in this run
        print(f"(FA4 not measured: flash_attn.cute unavailable: {exc})", flush=True)
    else:
        providers.append(Provider("fa4", lambda q, k, v, c: lambda: fa4(q, k, v, causal=c), _quiet))
    return providers


@contextlib.contextmanager
def _quiet():
    """FA4 warns on every compile about an argument it cannot convert; it is noise in our table."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
