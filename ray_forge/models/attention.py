"""TorchTitan's SDPA attention, also given an explicit mask: packed SFT rows, each its own document.

TorchTitan's document masking needs FlexAttention, which has no backward on CPU; its SDPA takes no
mask. This one is SDPA when no mask is passed (every GRPO forward, unchanged), and with a boolean
``attention_masks`` tensor (B, 1, T, T; True: may attend) it attends only where that allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import ScaledDotProductAttention


class MaskedSDPA(ScaledDotProductAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False,
                is_causal=True, **kwargs) -> torch.Tensor:
        if not isinstance(attention_masks, torch.Tensor):
            return super().forward(q_BLNH, k_BLNH, v_BLNH, attention_masks=attention_masks, scale=scale,
                                   enable_gqa=enable_gqa, is_causal=is_causal, **kwargs)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)
