"""What the benchmark times: flashhopper and its peers, each as a `Provider`.

A provider is built from one differentiable `attn(q, k, v, causal) -> out` (or `(out, lse)`), so
the forward and the backward benchmark time the same call. FP8 (e4m3) is forward only: ours
against cuDNN's FP8 SDPA through the cudnn Python frontend (`fp8_providers`).
"""

from __future__ import annotations

import contextlib
import os
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
    # what the provider learned while running (cuDNN FP8: the engine that served each graph), for the report
    info: dict = field(default_factory=dict)

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


# --- FP8 (e4m3) forward ---


class Unavailable(RuntimeError):
    """A peer this machine cannot run (its library is not installed): its cells stay empty."""


def fp8_providers(upper_bound: bool = False) -> list[Provider]:
    """Ours and cuDNN's; with `upper_bound` (bench --ablation) also ours fed V already transposed."""
    return [flashhopper_fp8(), *([flashhopper_fp8_vt_given()] if upper_bound else []), cudnn_fp8()]


@contextlib.contextmanager
def _fp8_opt_in():
    """Our FP8 forward refuses to run until it has passed the GPU suite unless this is set; the bench
    sets it for our calls only and puts it back."""
    from flashhopper.validation import FP8_OPT_IN

    before = os.environ.get(FP8_OPT_IN)
    os.environ[FP8_OPT_IN] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[FP8_OPT_IN]
        else:
            os.environ[FP8_OPT_IN] = before


def flashhopper_fp8() -> Provider:
    def make(q, k, v, causal):
        from flashhopper.interface import flash_attn_func

        # unit descales (cuDNN's values too) as (batch, heads_k) tensors, as an FP8 user passes them
        d = torch.ones(q.shape[0], k.shape[2], device=q.device, dtype=torch.float32)
        return lambda: flash_attn_func(q, k, v, causal=causal, q_descale=d, k_descale=d, v_descale=d)

    return Provider("flashhopper", make, _fp8_opt_in)


def flashhopper_fp8_vt_given() -> Provider:
    """The same kernel fed V^T in P's key order (FwdConfig.vt_in_gmem; made outside the timing): no
    in-kernel transpose, the upper bound it is measured against. It asks for the LSE, so it keeps the FADD
    row sums (the ones rows of FwdConfig.pv_row_sum are the transposer's): against a dispatch without the
    LSE (plan.fp8_row_sum) it measures both differences."""
    def make(q, k, v, causal):
        from flashhopper.hopper import runtime

        vt = runtime.fp8_transposed_v(v)
        return lambda: runtime.forward(q, k, vt, q.shape[-1] ** -0.5, causal, (-1, -1), 0.0)

    def context():
        from flashhopper.hopper import runtime

        return runtime.config_overrides(vt_in_gmem=True)

    return Provider("fh-vt-given", make, context)


# cuDNN's per-tensor scale inputs. Q, K, V hold N(0, 1) values as stored (descale 1, what ours gets).
# P in [0, 1] is stored as e4m3 times scale_s: 448, e4m3's largest value, is the frontend docs'
# choice without dropout ("Amax S"). O, a weighted mean of V's rows, stays in V's range: no scale.
CUDNN_FP8_SCALES = {"descale_q": 1.0, "descale_k": 1.0, "descale_v": 1.0, "descale_s": 1 / 448,
                    "scale_s": 448.0, "scale_o": 1.0}


def _import_cudnn():
    try:
        import cudnn
    except Exception as exc:  # absent, or present without its libraries: not measurable here
        raise Unavailable(f"the cudnn Python frontend is not importable here ({exc})") from exc
    return cudnn


def build_cudnn_fp8_graph(cudnn, handle, q, k, causal: bool):
    """An sdpa_fp8 forward graph for (b, s, h, d) e4m3 q and k, v like k, built as far as execution:
    (graph, {port name: tensor descriptor}, workspace size in bytes).

    Q, K, V and O are described as (b, h, s, d) views of (b, s, h, d) storage, as ours reads them.
    On Hopper cuDNN writes O in e4m3 only (bf16 O is Blackwell's), so it writes half the bytes ours
    does. No softmax stats (inference), as ours is called; Amax_O is an output, as every FP8 user
    needs it for the next scale_o, and Amax_S stays virtual as the frontend's docstring asks.
    """
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    qh, kh = heads_first(q), heads_first(k)
    ports = {name: graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=e4m3)
             for name, t in (("q", qh), ("k", kh), ("v", kh))}
    scalar = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": f32}
    ports.update({name: graph.tensor(name=name, **scalar) for name in CUDNN_FP8_SCALES})
    # causal as the docstring prefers over use_causal_mask: the top-left diagonal, nothing to its right
    mask = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "right_bound": 0} if causal else {}
    o, _, _, amax_o = graph.sdpa_fp8(**ports, attn_scale=q.shape[-1] ** -0.5, generate_stats=False, **mask)
    o.set_output(True).set_dim(list(qh.shape)).set_stride(list(qh.stride())).set_data_type(e4m3)
    amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, {**ports, "o": o, "amax_o": amax_o}, graph.get_workspace_size()


def cudnn_fp8() -> Provider:
    """cuDNN's FP8 SDPA forward as a careful user runs it: one graph per (shape, causal), built on first
    use and kept, a workspace allocated once; the timed call is graph.execute alone."""
    graphs, handle, info = {}, None, {}

    def make(q, k, v, causal):
        nonlocal handle
        cudnn = _import_cudnn()
        if handle is None:
            handle = cudnn.create_handle()
        # cuDNN launches on its handle's stream; the CUDA events that time it are on torch's
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
        key = (tuple(q.shape), tuple(k.shape), causal)
        if key not in graphs:
            graph, ports, size = build_cudnn_fp8_graph(cudnn, handle, q, k, causal)
            graphs[key] = graph, ports, torch.empty(size, device=q.device, dtype=torch.uint8)
            # the frontend may route a graph to a Python (CuTe DSL) engine of its own instead of cuDNN's
            engine = graph.selected_engine
            where = f"{tuple(q.shape)} {'causal' if causal else 'full'}"
            info[where] = engine.name if engine else "cuDNN backend"
        graph, ports, workspace = graphs[key]
        out = torch.empty_like(q)
        buffers = {"q": q, "k": k, "v": v, "o": out}
        pack = {ports[name]: heads_first(t) for name, t in buffers.items()}
        pack.update({ports[name]: torch.full((1, 1, 1, 1), value, device=q.device, dtype=torch.float32)
                     for name, value in CUDNN_FP8_SCALES.items()})
        pack[ports["amax_o"]] = torch.empty(1, 1, 1, 1, device=q.device, dtype=torch.float32)
        return lambda: graph.execute(pack, workspace, handle=handle)

    return Provider("cudnn", make, info=info)
