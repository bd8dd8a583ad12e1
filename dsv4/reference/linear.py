"""A linear layer whose weight stays in the checkpoint's storage format.

The official references run every FP8- or FP4-weight projection as a block-scaled GEMM on an FP8
activation: the input is quantized in 1 x `act_block` blocks with power-of-two scales, multiplied by the
dequantized weight, and accumulated in fp32. `quant_sim=True` reproduces that activation rounding;
`quant_sim=False` computes in full precision, as transformers does. The weight itself is always
dequantized exactly as stored, so a quantized checkpoint and its dequantized twin agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.quant import dequantize_fp8, dequantize_mxfp4, fake_quant_fp8

FORMATS = ("dense", "fp8", "fp4")
FP4_BLOCK = 32  # MXFP4: one e8m0 scale per 32 weights along K


class Linear(nn.Module):
    """y = x @ W^T with W dense, FP8 e4m3 + ue8m0 block scales, or MXFP4 packed two per byte.

    Args:
        fmt: storage of `weight` ("dense", "fp8" or "fp4"); "fp8" and "fp4" add a `scale` parameter.
        block: (rows, cols) of an FP8 weight-scale block.
        act_block: when set, the input is FP8-quantized in 1 x act_block blocks under quant_sim
            (the official reference does this for every FP8/FP4 linear except `wo_a`).
        fp32: compute in fp32 from an fp32 copy of the input and return fp32 (router, compressor pooling).
        dtype: storage dtype of a dense weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str = "dense",
        block: tuple[int, int] = (128, 128),
        act_block: int | None = None,
        fp32: bool = False,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"Linear format must be one of {FORMATS}, got {fmt!r}")
        self.in_features, self.out_features = in_features, out_features
        self.fmt, self.block, self.act_block, self.fp32 = fmt, tuple(block), act_block, fp32
        self.quant_sim = True
        if fmt == "fp8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), False)
            scale_shape = (-(-out_features // self.block[0]), -(-in_features // self.block[1]))
            self.scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float8_e8m0fnu), False)
        elif fmt == "fp4":
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.int8), False)
            self.scale = nn.Parameter(torch.empty(out_features, in_features // FP4_BLOCK, dtype=torch.float8_e8m0fnu), False)
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)
            self.register_parameter("scale", None)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as real numbers: fp32 for quantized storage, the stored dtype otherwise."""
        if self.fmt == "fp8":
            return dequantize_fp8(self.weight, self.scale, self.block)
        if self.fmt == "fp4":
            return dequantize_mxfp4(self.weight, self.scale, FP4_BLOCK)
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = torch.float32 if self.fp32 else x.dtype
        if self.quant_sim and self.act_block:
            x = fake_quant_fp8(x, self.act_block)
        w = self.dequantized_weight()
        if self.fp32 or self.fmt != "dense":
            # block-scaled GEMMs accumulate in fp32 and round once on output
            return F.linear(x.float(), w.float()).to(out_dtype)
        return F.linear(x, w.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, fmt={self.fmt}, act_block={self.act_block}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] normalized by its root mean square and scaled by weight [dim], in fp32, cast back to x's
    dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned weight (`rms_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
