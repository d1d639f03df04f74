"""No-GPU inspection: SASS/resource parsing on nvcc-built cubins, the CLI, and the real kernel."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types

import pytest

from flashhopper import cli
from flashhopper.compile import (
    CompiledArtifact,
    count_opcodes,
    diverged_count,
    ensure_arch_env,
    find_sass_tools,
    inspect_cubin,
    parse_ptxas_spills,
    parse_sass,
    sass_digest,
    setmaxnreg_values,
)

NVCC = shutil.which("nvcc") or next(
    (p for p in ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc") if os.access(p, os.X_OK)), None
)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")

# A warp-specialized shape in miniature: warpgroup 0 gives registers back, the others take more.
# setmaxnreg needs the block size known at compile time, hence __launch_bounds__.
WS_KERNEL = r"""
extern "C" __global__ void __launch_bounds__(384, 1)
ws_probe(const float* __restrict__ x, float* __restrict__ y) {
  __shared__ float buf[384];
  int t = threadIdx.x;
  if (t / 128 == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    buf[t] = x[t];
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    float v = x[t + blockIdx.x * 384], r;
    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    buf[t] = __expf(r) + exp2f(v);
  }
  __syncthreads();
  y[t + blockIdx.x * 384] = buf[(t + 1) % 384];
}
"""

# A dynamically indexed local array cannot live in registers: it forces local memory (LDL/STL).
LOCAL_KERNEL = r"""
extern "C" __global__ void local_probe(const float* x, const int* idx, float* y) {
  float a[64];
  for (int i = 0; i < 64; ++i) a[i] = x[threadIdx.x * 64 + i];
  a[idx[threadIdx.x] & 63] += 1.0f;
  y[threadIdx.x] = a[idx[threadIdx.x + 1] & 63];
}
"""


def nvcc_cubin(tmp_path_factory, name, source) -> bytes:
    d = tmp_path_factory.mktemp(name)
    (d / "k.cu").write_text(source)
    subprocess.run([NVCC, "-arch=sm_90a", "-cubin", "-o", str(d / "k.cubin"), str(d / "k.cu")], check=True)
    return (d / "k.cubin").read_bytes()


@pytest.fixture(scope="module")
def ws_cubin(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    return nvcc_cubin(tmp_path_factory, "ws", WS_KERNEL)


@pytest.fixture(scope="module")
def local_cubin(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    return nvcc_cubin(tmp_path_factory, "local", LOCAL_KERNEL)


@needs_nvcc
def test_inspect_warp_specialized_cubin(ws_cubin):
    r = inspect_cubin(ws_cubin)
    assert r["function"] == "ws_probe"
    assert r["registers"] == 168  # 65536 / 384 threads: the launch allocation, before setmaxnreg
    assert r["spill_bytes"] == 0
    assert r["smem_bytes"] >= 384 * 4  # its static shared memory
    s = r["sass"]
    assert s["USETMAXREG"] == [24, 240]
    assert {e["kind"].split(".")[0] for e in r["usetmaxreg"]} == {"DEALLOC", "TRY_ALLOC"}
    assert s["BAR"] >= 1 and s["MUFU.EX2"] >= 2
    assert s["HGMMA"] == s["QGMMA"] == s["UTMALDG"] == s["UTMASTG"] == 0
    assert s["LDL"] == s["STL"] == 0
    # with the dynamic bytes a launch requests: both
    assert inspect_cubin(ws_cubin, smem_bytes=12345)["smem_bytes"] == 12345 + r["smem_bytes"]


@needs_nvcc
def test_inspect_counts_local_memory(local_cubin):
    r = inspect_cubin(local_cubin)
    assert r["spill_bytes"] >= 64 * 4
    assert r["sass"]["LDL"] > 0 and r["sass"]["STL"] > 0
    log = "ptxas info : Used 24 registers, 4096 bytes spill stores, 4000 bytes spill loads"
    assert inspect_cubin(local_cubin, ptxas_log=log)["spill_bytes"] == 4096


def test_parse_sass_lines():
    text = """
        /*0070*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;    /* 0x000000f0000079c8 */
        /*0080*/              @!P0 BRA 0x60 ;                                  /* 0xfffffffc00f08947 */
        /*0090*/               @P1 BAR.SYNC.DEFER_BLOCKING 0x0 ;               /* 0x0000000000007b1d */
        /*00a0*/                   BAR 0x1, 0x100 ;
        /*00b0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*00c0*/                   USETMAXREG.DEALLOC.CTAPOOL 24 ;
        /*00d0*/                   MUFU.EX2 R0, R4 ;
        /*00e0*/                   MUFU.RCP R0, R4 ;
        /*00f0*/              @!UP0 UTMALDG.2D [UR8], [UR4] ;
        /*0100*/                   SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4+0x8], RZ ;
        /*0110*/                   LDL.64 R2, [R1] ;
        /*0120*/                   ACQBULK ;
        /*0130*/                   PREEXIT ;
        /*0140*/                   BRA 0x120;
    """
    ins = parse_sass(text)
    assert [op for op, _ in ins][:3] == ["USETMAXREG.TRY_ALLOC.CTAPOOL", "BRA", "BAR.SYNC.DEFER_BLOCKING"]
    counts = count_opcodes(ins)
    assert counts == {"HGMMA": 1, "QGMMA": 0, "UTMALDG": 1, "UTMASTG": 0, "UTMAREDG": 0, "SYNCS": 1, "BAR": 2,
                      "MUFU.EX2": 1, "MUFU.TANH": 0, "LDL": 1, "STL": 0, "ACQBULK": 1, "PREEXIT": 1, "LDS": 0,
                      "STS": 0, "LDSM": 0, "STSM": 0, "PRMT": 0, "F2FP": 0}
    assert setmaxnreg_values(ins) == [{"kind": "TRY_ALLOC.CTAPOOL", "regs": 240},
                                      {"kind": "DEALLOC.CTAPOOL", "regs": 24}]
    assert parse_ptxas_spills("no spills here") == 0


def test_diverged_count_counts_from_the_lowest_bra_div_target():
    text = """
        /*0070*/              @UP0 UTMALDG.4D [UR8], [UR6], desc[URZ] ;
        /*0080*/                   BRA.DIV UR6, 0xc0 ;
        /*0090*/              @UP1 UTMALDG.4D [UR8], [UR6], desc[URZ] ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA.DIV UR6, 0xd0 ;
        /*00c0*/                   WARPSYNC.COLLECTIVE R10, 0xe0 ;
        /*00d0*/              @UP0 UTMALDG.4D [UR8], [UR6], desc[URZ] ;
        /*00e0*/                   BRA 0x90 ;
    """
    assert diverged_count(text, "UTMALDG") == 1 and diverged_count(text, "WARPSYNC") == 1
    assert diverged_count(text.replace("BRA.DIV", "BRA"), "UTMALDG") == 0


def test_sass_digest_ignores_addresses_and_encodings():
    a = """
        /*0070*/       HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;   /* 0x000000f0000079c8 */
        /*0080*/  @!P0 BRA 0x60 ;                                  /* 0xfffffffc00f08947 */
    """
    moved = a.replace("0070", "0170").replace("0080", "0180")
    moved = moved.replace("0x000000f0000079c8", "0x0000000000000000")
    assert sass_digest(a) == sass_digest(moved)
    assert sass_digest(a) != sass_digest(a.replace("@!P0 BRA", "@P0 BRA"))
    assert len(sass_digest(a)) == 64


def test_missing_tools_name_the_pip_packages(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with pytest.raises(FileNotFoundError, match="pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"):
        find_sass_tools()


def test_ensure_arch_env_defaults_to_sm90a(monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    ensure_arch_env()
    assert os.environ["CUTE_DSL_ARCH"] == "sm_90a"
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90")
    ensure_arch_env()
    assert os.environ["CUTE_DSL_ARCH"] == "sm_90"


@pytest.fixture
def fake_hopper(monkeypatch, ws_cubin):
    built = []

    def build(**cfg):
        built.append(cfg)
        return CompiledArtifact(name="probe", cubin=ws_cubin, smem_bytes=4096)

    monkeypatch.setitem(sys.modules, "flashhopper.hopper", types.SimpleNamespace(KERNELS={"probe": build}))
    return built


@needs_nvcc
def test_cli_inspect_json(fake_hopper, capsys):
    assert cli.main(["inspect", "probe", "--dtype", "fp16", "--hdim", "64", "--causal", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"registers", "spill_bytes", "smem_bytes", "sass", "kernel", "config"} <= set(report)
    assert report["config"] == {"dtype": "fp16", "hdim": 64, "causal": True} == fake_hopper[0]
    assert report["smem_bytes"] >= 4096 + 384 * 4 and report["sass"]["USETMAXREG"] == [24, 240]


@needs_nvcc
def test_cli_inspect_table(fake_hopper, capsys):
    assert cli.main(["inspect", "probe", "--set", "softcap=true", "--set", "tile_n=112"]) == 0
    assert fake_hopper[0] == {"dtype": "bf16", "hdim": 128, "causal": False, "softcap": True, "tile_n": 112}
    out = capsys.readouterr().out
    assert "registers" in out and "USETMAXREG" not in out.split("SASS")[1] and "MUFU.EX2" in out


def test_cli_inspect_unknown_or_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashhopper.hopper", types.SimpleNamespace(KERNELS={"fwd": None}))
    assert cli.main(["inspect", "nope", "--json"]) == 2
    assert "unknown kernel 'nope'; available: fwd" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "flashhopper.hopper", None)
    assert cli.main(["inspect", "fwd", "--json"]) == 2
    assert "not importable" in capsys.readouterr().err


def test_cli_bench_without_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert cli.main(["bench", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


HAVE_HOPPER = importlib.util.find_spec("flashhopper.hopper") is not None


@pytest.mark.skipif(not HAVE_HOPPER, reason="no flashhopper.hopper yet")
def test_real_forward_kernel_sass(capsys):
    assert cli.main(["inspect", "fwd", "--dtype", "bf16", "--hdim", "128", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    s = r["sass"]
    assert s["HGMMA"] > 0 and s["UTMALDG"] > 0
    assert any(n < 128 for n in s["USETMAXREG"]), "producer warpgroup should give registers back"
    assert any(n > 168 for n in s["USETMAXREG"]), "consumer warpgroups should grow past the launch 168"
    assert s["LDL"] == 0 and s["STL"] == 0, "register spills in the forward kernel"
    assert r["spill_bytes"] == 0
