"""The kernel configs a call launches, recorded at runtime.get_kernel (the one place every launch passes)."""

from __future__ import annotations

from flashhopper.config import FwdConfig
from flashhopper.hopper import runtime


def record_launches(monkeypatch, kind: type | None = FwdConfig) -> list:
    """A list that fills with the config of every kernel fetched from here on: of `kind` only (default the
    attention forward's FwdConfig, not the merge's CombineConfig or the backward's), all where None."""
    launched = []
    get_kernel = runtime.get_kernel

    def recording(cfg):
        if kind is None or isinstance(cfg, kind):
            launched.append(cfg)
        return get_kernel(cfg)

    monkeypatch.setattr(runtime, "get_kernel", recording)
    return launched


def record_split_launches(monkeypatch) -> tuple[list, list]:
    """(every kernel config fetched, the `splits` each runtime.forward_split call was asked for): the
    decode tests' record of what a KV-cache call launched."""
    kernels, splits = record_launches(monkeypatch, kind=None), []
    forward_split = runtime.forward_split

    def split_recording(*args, **kwargs):
        splits.append(kwargs["splits"])
        return forward_split(*args, **kwargs)

    monkeypatch.setattr(runtime, "forward_split", split_recording)
    import flashhopper.hopper

    monkeypatch.setattr(flashhopper.hopper, "forward_split", split_recording)
    return kernels, splits
