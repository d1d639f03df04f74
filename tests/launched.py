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
