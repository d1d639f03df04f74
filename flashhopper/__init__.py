"""flashhopper: FlashAttention-3 for NVIDIA Hopper (sm_90a), written in the CUTLASS CuTe Python DSL.

Importing the package stays light (torch only); the CuTe DSL is loaded only to compile a kernel that
the kernel cache (flashhopper/hopper/kernel_cache.py) does not hold.
"""

from flashhopper.interface import flash_attn_func, flash_attn_varlen_func
from flashhopper.kvcache import flash_attn_with_kvcache
from flashhopper.reference import attention_bwd_ref, attention_ref
from flashhopper.sms import sm_margin
from flashhopper.validation import SUPPORTED_HDIMS
from flashhopper.version import __version__

__all__ = ["SUPPORTED_HDIMS", "attention_bwd_ref", "attention_ref", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache", "sm_margin", "__version__"]
