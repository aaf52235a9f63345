"""The seed tutorial's multi-head attention layer and a pre-LN GPT block, as ``nn.Module``s
on ``module.attention``.

``MultiHeadAttention`` has one fused ``qkv`` Linear, ``out_proj`` and ``dropout`` (an
``nn.Dropout``, off in ``eval()``); ``SelfAttentionBlock`` is x + attn(norm1(x)), then
+ mlp(norm2(x)). Their ``state_dict`` names are the parameter names of the NumPy
reference's ``multi_head_attention`` and ``gpt_block`` (``impls/numpy/layers.py``), so the
suite loads the same weights into both.

Shape legend: B batch, T sequence length, C model width, H heads, D = C // H head dim,
F the MLP's hidden width.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import contract
from .module import attention


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention: one fused q/k/v projection, H heads, an output mix.

    Args:
      d_model: C, the model width.
      n_heads: H, which must divide C; each head has D = C // H channels.
      dropout: probability of zeroing each attention weight in training mode.

    Shapes: x (B, T, C) -> (B, T, C).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        C = d_model
        D = contract.check_heads(n_heads, C)
        self.d_model = C
        self.n_heads = C // D
        self.head_dim = D
        self.qkv = nn.Linear(C, 3 * C)
        self.out_proj = nn.Linear(C, C)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Attend every position of x to the others (mask, is_causal as ``attention``)."""
        B, T, C, H, D = contract.check_module_input(x, self.n_heads, self.d_model)

        # 1. Project to queries, keys and values with one fused matrix, then split them.
        qkv = self.qkv(x)  # (B, T, 3C)
        q, k, v = qkv.split(C, dim=-1)  # 3 × (B, T, C)

        # 2. Split the width into H heads of D channels: head h owns channels [h·D, (h+1)·D).
        q = q.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)

        # 3. Attention in every head at once; the dropout module is off in eval mode.
        context = attention(
            q, k, v, mask=mask, is_causal=is_causal, dropout=self.dropout
        )  # (B, H, T, D)

        # 4. Merge the heads back into the width, head-major, then mix them.
        context = context.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.out_proj(context)  # (B, T, C)


class SelfAttentionBlock(nn.Module):
    """One pre-LN decoder block: x + attn(norm1(x)), then + mlp(norm2(x)).

    Args:
      d_model: C, the model width.
      n_heads: H, which must divide C.
      d_ff: F, the MLP's hidden width.

    Shapes: x (B, T, C) -> (B, T, C). The attention is causal (top-left, T = S).
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, d_ff),
            nn.GELU(),
            nn.Linear(d_ff, d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LN: each sublayer sees a normalised input, and the residual path stays an
        # identity, which keeps deep stacks trainable without warm-up tricks.
        x = x + self.attn(self.norm1(x), is_causal=True)  # (B, T, C)
        return x + self.mlp(self.norm2(x))  # (B, T, C)
