"""Everything TorchTitan 0.3.0 needs to train on CPU, in one place.

TorchTitan targets CUDA. On a CPU (gloo) these are the differences, each measured:
1. Attention: the default FlexAttention has no backward on CPU; causal
   scaled-dot-product attention (TorchTitan's own ``ScaledDotProductAttention``) does.
2. Device type: ``torchtitan.distributed.parallel_dims`` falls back to "cuda" for its device
   meshes when no accelerator is found; it must be told "cpu".
3. SPMD backend: ``partial_dtensor`` (what TorchTitan's Trainer selects) rather than the
   ``spmd_types`` default, which the FSDP path on CPU does not take.
4. Reductions: gloo has no AVG or PREMUL_SUM, so FSDP must reduce gradients with SUM; we
   divide the loss by the global normaliser instead, so the gradient is the same at any world size.
These calls are harmless on GPU, except (2) and (4), which only run for device type "cpu".
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule


def inner_attention_config(device_type: str):
    """SDPA everywhere: exact against HF on CPU, with a backward; on GPU it uses flash kernels.
    It also takes an explicit mask, for packed SFT rows (``ray_forge/models/attention.py``)."""
    from ray_forge.models.attention import MaskedSDPA

    return MaskedSDPA.Config()


def prepare_distributed(device_type: str) -> None:
    """Set TorchTitan's module-level device type and SPMD backend before meshes are built."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed import utils as dist_utils

    if device_type == "cpu":
        parallel_dims.device_type = "cpu"
    dist_utils.set_spmd_backend("partial_dtensor")


def use_sum_reductions(model: torch.nn.Module, device_type: str) -> None:
    """gloo lacks AVG/PREMUL_SUM: reduce-scatter gradients with SUM and do not divide them."""
    if device_type != "cpu":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def require_dtype(dtype: str, device_type: str, who: str) -> None:
    """bfloat16 on CPU needs the instructions for it (AVX512-BF16, or ARM's BF16); elsewhere vLLM's
    CPU kernels refuse it or torch emulates it far slower. Refuse, saying what to set instead.

    On a CPU with AMX tiles, vLLM's bf16 attention uses them, and Linux kills a process that
    touches them without first asking the kernel for their state (SIGILL, the engine gone
    without a word): ask here, in the process that will run the kernels, and refuse if denied."""
    if dtype != "bfloat16" or device_type != "cpu":
        return
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if not (caps.get("avx512_bf16") or caps.get("amx_bf16") or caps.get("bf16")):
        raise ValueError(f"{who}=bfloat16 needs a GPU or a CPU with bfloat16 instructions (AVX512-BF16, AMX or "
                         f"ARM BF16); this CPU ({caps.get('cpu_name', 'unknown')}) has none: set {who}=float32")
    if caps.get("amx_tile") and not torch.cpu._init_amx():
        raise ValueError(f"{who}=bfloat16: this CPU has AMX tiles, which vLLM's bf16 kernels use, but the kernel "
                         f"refused this process their state (arch_prctl ARCH_REQ_XCOMP_PERM); set {who}=float32")
