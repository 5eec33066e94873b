"""The TTT attention layer as the official code computes it, vendored for an equivalence test.

Source: LeapLabTHU/Transformer-to-TTT, T5/models.py (commit b87f3c6), class ``Attention`` (the repository's
license; the file derives from DeiT/timm code). Kept: the parameters and the forward's arithmetic line for
line (its closed-form gradient ``gradient_silu_glu`` included); dropped: dropout (identity at p=0) and the
trunc-normal init (the test sets every weight).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class OfficialTTTAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.w1 = nn.Parameter(torch.randn(1, num_heads, head_dim, head_dim) * 0.02)
        self.w2 = nn.Parameter(torch.randn(1, num_heads, head_dim, head_dim) * 0.02)
        self.w3 = nn.Parameter(torch.randn(1, num_heads, head_dim, head_dim) * 0.02)
        self.proj = nn.Linear(dim, dim)
        self.q_conv2d = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)
        self.k_conv2d = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)

    def gradient_silu_glu(self, k, v, w1, w2, w3):
        z1 = k @ w1
        z2 = k @ w2
        sig = F.sigmoid(z1)
        a1 = z1 * sig
        a2 = a1 * z2
        e = - v / float(v.shape[2]) * self.scale
        da2 = e @ w3.transpose(-2, -1)
        g1 = k.transpose(-2, -1) @ (da2 * z2 * (sig * (1.0 + z1 * (1.0 - sig))))
        g2 = k.transpose(-2, -1) @ (da2 * a1)
        g3 = a2.transpose(-2, -1) @ e
        return g1, g2, g3

    def forward(self, x):
        B, N, C = x.shape
        H = W = int(N ** 0.5)
        q, k, v = torch.chunk(self.qkv(x), chunks=3, dim=-1)
        q = q.reshape(B, N, self.num_heads, C // self.num_heads).transpose(1, 2)
        k = F.instance_norm(k.transpose(1, 2).unsqueeze(-1), eps=1.0)
        k = k.reshape(B, self.num_heads, C // self.num_heads, N).transpose(2, 3)
        v = v.reshape(B, N, self.num_heads, C // self.num_heads).transpose(1, 2)
        q_flat = q.transpose(1, 2).reshape(B, N, C)
        q2 = q_flat.transpose(1, 2).reshape(B, C, H, W)
        q2 = q2 + self.q_conv2d(q2)
        q2 = q2.reshape(B, C, N).transpose(1, 2)
        q2 = q2.reshape(B, N, self.num_heads, C // self.num_heads).transpose(1, 2)
        k_flat = k.transpose(1, 2).reshape(B, N, C)
        k2 = k_flat.transpose(1, 2).reshape(B, C, H, W)
        k2 = k2 + self.k_conv2d(k2)
        k2 = k2.reshape(B, C, N).transpose(1, 2)
        k2 = k2.reshape(B, N, self.num_heads, C // self.num_heads).transpose(1, 2)
        w1, w2, w3 = self.w1, self.w2, self.w3
        g1, g2, g3 = self.gradient_silu_glu(k2, v, w1, w2, w3)
        w1, w2, w3 = w1 - g1, w2 - g2, w3 - g3
        x = (F.silu(q2 @ w1) * (q2 @ w2)) @ w3
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)
