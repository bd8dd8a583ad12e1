"""The fast model: the reference module tree and parameter names, computed with kernels.

`make_fast(model)` turns a loaded `dsv4.reference.model.Dsv4Model` into a `FastModel` in place: the same
modules (so the same checkpoints load), with forward methods that run the Triton kernels of
`dsv4.fast.kernels`, and weights re-laid out once at load time:
- FP8 linears are dequantized to the model dtype (an e4m3 value times a power of two is exact in bf16)
  and run as dense GEMMs on unrounded activations (the reference with `set_quant_sim(True,
  activations=False)`: packed KV and indexer formats, no FP8 activation rounding);
- each MoE's MXFP4 experts are stacked for the fused expert kernel (the per-expert parameters become
  views into the stacked tensors, so names and bytes stay those of the checkpoint);
- the attention's linears that read one input (x, or the query latent) are concatenated the same way, so
  that a decode step runs one GEMM per input and output dtype (`SharedInput`);
- on CUDA the attention's and the shared experts' FP8 weights are also kept as stored (`Fp8Copy`, half the
  bytes of the bf16 copies, which prefill's GEMMs read): a batch-1 decode step reads those (`dsv4::fp8_gemv`) for
  the query latent's linears, wo_a and wo_b, the step's largest weight streams after the head and the experts,
  and the MoE's gather kernels read the shared expert's (its scales laid out per row as the routed experts').
The indexer's scores are the MQA kernel's on both paths: fp32 sums of exact products, where the reference in
bf16 rounds each head's dot product to bf16 first.

Two ways through the model:
- `hidden_states(ids, cache, start_pos)` (inherited): the module path, any chunk length, for prefill and
  bounded replay, against any cache implementing the reference interface (`dsv4.fast.cache.SlotCache`);
- `decode_step(ids, slots, state)`: one token for each of B sequences in `SlotState` slots, with static
  shapes, positions read from device memory and no host synchronization, so the runner captures it in
  a CUDA graph per batch size.

V4.1's Engram tables stay in pinned host memory when `dsv4.fast.engram_prefetch.keep_engram_on_host` ran
before the model moved to the GPU: a decode step, and a prefill forward whose rows fit the prefetch's buffers,
starts their rows' prefetch at its entry and waits for it at the Engram layers (a longer forward gathers them
at each Engram layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dsv4.fast.cache import POOL_BLOCK, LayerSlots, Rows, SlotState
from dsv4.fast.engram_prefetch import EngramPrefetcher, HostEngramEmbedding
from dsv4.fast.kernels.attention import sparse_attn_bf16, sparse_attn_fp4
from dsv4.fast.kernels.compressor import compressor_pool
from dsv4.fast.kernels.dense_gemv import beats_cublas, dense_gemv
from dsv4.fast.kernels.engram import engram_hash
from dsv4.fast.kernels.fp8_gemv import fp8_gemv, rotated_heads
from dsv4.fast.kernels.indexer import (
    candidate_mask,
    mqa_index_scores,
    mqa_index_scores_pool,
    mqa_index_topk,
    select_candidate_block_ids,
)
from dsv4.fast.kernels.indexer_query import indexer_query
from dsv4.fast.kernels.mhc import (
    mhc_post,
    mhc_post_finish,
    mhc_post_partial,
    mhc_post_sums,
    mhc_pre,
    mhc_pre_finish,
    mhc_pre_partial,
    summed_slots,
)
from dsv4.fast.kernels.moe_experts import (
    activation_planes,
    fp8_rows,
    moe_gather_slots,
    moe_mxfp4_with_shared,
    stack_expert_weights,
)
from dsv4.fast.kernels.moe_routing import gate_route, gate_route_normed
from dsv4.fast.kernels.quant import fp8_quant, mxfp4_quant, nvfp4_quant
from dsv4.fast.kernels.rope import query_heads
from dsv4.fast.kernels.topk import topk_select
from dsv4.fast.kernels.window_write import window_rows, window_write, window_write_rounded
from dsv4.quant import dequantize_fp8, dequantize_mxfp4, dequantize_nvfp4
from dsv4.reference.attention import V4_WINDOW_FP8_BLOCK, Attention, SharedKV
from dsv4.reference.indexer import Indexer, hadamard, index_scores
from dsv4.reference.linear import Linear, RMSNorm
from dsv4.reference.mhc import hc_collapse, hc_head_pre
from dsv4.reference.model import Block, Dsv4Model
from dsv4.reference.moe import MoE
from dsv4.reference.rope import Rotary

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------- linears
def mm_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T in fp32 from bf16 operands: a product of two bf16 values is exact in fp32 and
    the tensor cores accumulate in fp32, so this is an fp32 GEMM of the same values up to summation order,
    without fp32 copies of either operand."""
    flat = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
    return flat.view(*x.shape[:-1], weight.shape[0])


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T in fp32: by `mm_fp32_out` on bf16 CUDA operands, where the reference's
    x.float() @ w.float() costs a conversion of the weight per call and an fp32 GEMM at a small fraction of
    the tensor cores' rate (a tenth of an 8K prefill's GEMM time went there); elsewhere as the reference."""
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16:
        return mm_fp32_out(x, weight)
    return F.linear(x.float(), weight.float())


class FastLinear(Linear):
    """A dense linear with fp32 output (the compressors' projections), by `fp32_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.act_block else fp32_linear(x, self.weight)


@dataclass(frozen=True)
class Fp8Copy:
    """A linear's block-scaled FP8 weight as the checkpoint stores it, kept beside the bf16 copy for the batch-1
    decode GEMV: the same values (`dsv4::fp8_gemv` is the bf16 GEMM's sum up to fp32 summation order) in half the
    bytes. Batch 1 only: at two rows it gains too (1.28-1.51x cuBLAS on the bf16 copies, `bench/fp8_gemv.py`;
    from four rows on it loses), but a choice by batch size past 1 would add a compile of every layer kind (the
    batch dimension is symbolic past 1) for a batch size the step has not been measured at."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N / bn, K / bk] float8_e8m0fnu
    block: tuple[int, int]  # (bn, bk); (1, 32) for the MoE's shared expert, its scales laid out per row (`fp8_rows`)

    @staticmethod
    def serves(x: torch.Tensor) -> bool:
        return x.shape[0] == 1

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype, groups: int = 1,
                 norm: RMSNorm | None = None, start_successor: bool = False, rope: tuple | None = None,
                 squares: torch.Tensor | None = None) -> torch.Tensor:
        """x [1, groups * K] (with `norm`, norm(x), normalized in the kernel) -> [1, N] out_dtype (see fp8_gemv for
        groups, start_successor, rope: (cos, sin, heads, head_dim), and squares: x's partial sums of squares)."""
        weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
        return fp8_gemv(x, self.weight, self.scale, *self.block, out_dtype, groups, weight, eps, start_successor,
                        *(rope or (None, None, 0, 0)), squares)

    @staticmethod
    def stacked(copies: Iterable[Fp8Copy | None]) -> Fp8Copy | None:
        """The copies' rows in one weight; None unless every linear has one, all in the same blocks and each
        whole blocks of rows (so that their scale rows stack too)."""
        copies = list(copies)
        if not copies or any(c is None or c.block != copies[0].block or c.weight.shape[0] % c.block[0]
                             for c in copies):
            return None
        if len(copies) == 1:
            return copies[0]
        return Fp8Copy(torch.cat([c.weight for c in copies]), torch.cat([c.scale for c in copies]), copies[0].block)


class SharedInput:
    """Dense linears that read one input, their weights concatenated at load (each linear's `weight` becomes a
    view of its rows, so the checkpoint's names still hold them): the decode step runs one GEMM per output dtype
    where it ran one per linear, each a launch and a GEMV tail of its own. The fp32 linears (the compressors')
    form one GEMM with fp32 output, the others one with the input's dtype: a GEMM that rounds its own output,
    as each linear did. (One fp32 GEMM cast to bf16 after would not do: inside torch.compile a cast followed by
    the consumer's upcast can fold away, and the compiled step would skip a rounding the eager one makes.)
    A part whose linears all have FP8 copies (`fp8`, by linear) also stacks those, for the batch-1 GEMV."""

    def __init__(self, linears: dict[str, Linear], fp8: dict[Linear, Fp8Copy]):
        self.parts = []  # (names, widths, fp32, weight [sum of N, K], Fp8Copy of the same rows or None)
        for fp32 in (False, True):
            group = {name: lin for name, lin in linears.items() if lin.fp32 == fp32}
            if not group:
                continue
            widths = [lin.out_features for lin in group.values()]
            weight = torch.cat([lin.weight for lin in group.values()])  # [sum of widths, K]
            for lin, rows in zip(group.values(), weight.split(widths)):
                lin.weight.data = rows
            stored = Fp8Copy.stacked(fp8.get(lin) for lin in group.values())
            self.parts.append((tuple(group), widths, fp32, weight, stored))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for names, *_ in self.parts for name in names)

    def __call__(self, x: torch.Tensor, norm: RMSNorm | None = None, rope: tuple | None = None,
                 squares: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """x [B, K] -> each linear's output by name [B, N]; with `norm`, of norm(x): the batch-1 FP8 GEMV normalizes
        the rows it reads (`fp8_gemv`'s norm_weight: the norm's launch of its own gone where no other part reads
        x; by x's partial sums of squares where `squares` hands them on), the other parts read norm(x). rope (cos,
        sin [B, R/2] fp32, heads, head_dim): the first part's first heads come out rotated (`rotated_heads`; by the
        batch-1 FP8 GEMV, its rotation launch gone)."""
        outs, normed = {}, None
        for i, (names, widths, fp32, weight, stored) in enumerate(self.parts):
            out_dtype = torch.float32 if fp32 else x.dtype
            heads = rope if i == 0 else None
            if stored is not None and stored.serves(x):
                y = stored(x, out_dtype, norm=norm, rope=heads, squares=squares)
            else:
                if normed is None:
                    normed = x if norm is None else norm(x)
                if beats_cublas(normed, weight):
                    y = dense_gemv(normed, weight, out_dtype)
                else:
                    y = fp32_linear(normed, weight) if fp32 else F.linear(normed, weight)
                if heads is not None:
                    y = rotated_heads(y, *heads)
            outs.update(zip(names, y.split(widths, dim=-1)))
        return outs


# ---------------------------------------------------------------------------------------------- MoE
class FastMoE(MoE):
    """Routing in one kernel (gate GEMM included), routed MXFP4 experts and the shared expert in one op."""

    def prepare(self, fp8: dict[Linear, Fp8Copy]) -> None:
        """Stack the experts for the kernels; keep the shared expert's FP8 weights (`fp8`, by linear) for the
        batch-1 decode (`shared_fp8`), where there are."""
        if any(e.w1.fmt != "fp4" for e in self.experts):
            raise ValueError("the fast model runs MXFP4 routed experts; this checkpoint's experts are not MXFP4")
        stacked = stack_expert_weights(self, shared_dtype=self.gate.weight.dtype)
        self.limit = stacked.pop("limit")
        self.stacked = stacked
        self.shared_fp8 = self._shared_rows([fp8.get(getattr(self.shared_experts, n)) for n in ("w1", "w3", "w2")])
        # the gate GEMM's programs count themselves in here where its last one routes (`gate_route`'s count)
        self.register_buffer("route_count", torch.zeros(1, dtype=torch.int32, device=self.gate.weight.device),
                             persistent=False)
        inter = stacked["w2"].shape[-1] * 2
        for e, expert in enumerate(self.experts):  # the checkpoint's names now view the stacked bytes
            for name, data, scale, rows in (("w1", "w13", "s13", slice(0, inter)), ("w3", "w13", "s13", slice(inter, None)),
                                            ("w2", "w2", "s2", slice(None))):
                lin = getattr(expert, name)
                lin.weight.data = stacked[data][e, rows].view(lin.weight.dtype)
                lin.scale.data = stacked[scale][e, rows].view(lin.scale.dtype)
        sh = self.shared_experts
        if sh.w1.weight.dtype == stacked["shared13"].dtype:  # w1 and w3 view their stacked copy, not a second one
            sh.w1.weight.data, sh.w3.weight.data = stacked["shared13"].split(inter)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x: [B, S, D], input_ids: [B, S] -> [B, S, D]."""
        return summed_slots(self.slots(x.flatten(0, 1), input_ids.flatten()), x.dtype).view_as(x)

    def slots(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [N, D], input_ids [N] -> the output [N, D] in x's dtype, or for one token its slots [1, k + 1, D] fp32
        (the routed experts weighted, then the shared expert), whose sum in slot order rounded to x's dtype is the
        output (`summed_slots`): the decode step's FFN post sums them (`mhc_post_partial`, `mhc_post_sums`) where
        a kernel of its own did."""
        weights, ids = gate_route(x, *self._gate_args(input_ids))
        if x.shape[0] == 1:  # the decode step's token: the planes fuse into a compiled kernel
            return self._gathered(x, activation_planes(x), ids, weights)
        return moe_mxfp4_with_shared(x, *self._experts(ids, weights)).to(x.dtype)

    def normed_slots(self, x: torch.Tensor, squares: torch.Tensor | None, norm: RMSNorm,
                     input_ids: torch.Tensor) -> torch.Tensor:
        """slots(norm(x), input_ids), x's sums of squares by d step `squares` given (`mhc_post_partial`'s) or None.
        At one token with them, the gate GEMM normalizes x and hands the gather the normalized row and its planes
        (`gate_route_normed`): the norm's and the planes' launches go."""
        if squares is None or not self.normed_in_gate(x.shape[0]):
            return self.slots(norm(x), input_ids)
        weights, ids, xn, planes = gate_route_normed(x, squares, norm.weight, norm.eps, *self._gate_args(input_ids))
        return self._gathered(xn, planes, ids, weights)

    @staticmethod
    def normed_in_gate(rows: int) -> bool:
        """Whether `normed_slots` normalizes rows in the gate GEMM (one token: the gather's) given x's squares."""
        return rows == 1

    def _gate_args(self, input_ids: torch.Tensor) -> tuple:
        """gate_route's arguments after x: the gate's weight, bias, hashed ids, routing constants and count."""
        g = self.gate
        hashed = g.tid2eid[input_ids] if hasattr(g, "tid2eid") else None
        return (g.weight, getattr(g, "bias", None), hashed, g.topk, g.temp, g.scale, g.norm_topk_prob,
                g.scoring_func, self.route_count)

    def _experts(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        s = self.stacked
        return ids, weights, s["w13"], s["s13"], s["w2"], s["s2"], s["shared13"], s["shared2"], self.limit

    def _gathered(self, x: torch.Tensor, planes: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """One token's slots through the gather kernels (`moe_gather_slots`), the shared expert as stored."""
        stored = [t for c in self.shared_fp8 or () for t in (c.weight, c.scale)]
        return moe_gather_slots(x, planes, *self._experts(ids, weights), *stored)

    @staticmethod
    def _shared_rows(copies: list[Fp8Copy | None]) -> tuple[Fp8Copy, Fp8Copy] | None:
        """The shared expert's w1 / w3 / w2 as stored, re-laid out as the gather kernels read them (`fp8_rows`: a
        scale a row and 32 elements, block (1, 32)): w1 and w3 stacked as shared13's rows are, then w2. None
        unless all three are FP8 in blocks of whole 32-element groups."""
        if any(c is None or c.block[1] % 32 for c in copies):
            return None
        typed = lambda codes, exps: Fp8Copy(codes.view(torch.float8_e4m3fn), exps.view(torch.float8_e8m0fnu), (1, 32))
        rows = [typed(*fp8_rows(c.weight, c.scale, c.block)) for c in copies]
        return Fp8Copy.stacked(rows[:2]), rows[2]

    def fp8_pairs(self) -> list[tuple[torch.Tensor, Fp8Copy]]:
        """(bf16 copy, FP8 copy of the same rows) of each weight a batch-1 decode step reads as stored FP8."""
        return list(zip((self.stacked["shared13"], self.stacked["shared2"]), self.shared_fp8 or ()))


# ---------------------------------------------------------------------------------------------- attention
class DeviceRotary(Rotary):
    """Rotary with its frequencies computed once and kept on the model's device: the reference's
    per-call host computation would need a host-to-device copy, which stalls the host and cannot be
    captured in a CUDA graph. The same values (computed on the host, as the reference does)."""

    def __init__(self, rotary: Rotary, device: torch.device):
        super().__init__(rotary.dim, rotary.theta, rotary.yarn)
        self.inv_freq = super().frequencies(device)

    def frequencies(self, device: torch.device) -> torch.Tensor:
        return self.inv_freq


class FastIndexer(Indexer):
    """The module path's indexer (prefill, replay) with the decode step's kernels: scores by the MQA kernel,
    which never forms the reference's [S, H, T] products, and selections by the radix select, not a sort. A
    candidate consumer scores only the entries of its pool's blocks."""

    def _fake_mxfp4(self, t: torch.Tensor) -> torch.Tensor:
        """By the quantization kernel: bit-identical, without the reference codec's NaN check, whose host
        read would stall every forward."""
        return dequantize_mxfp4(*mxfp4_quant(t, 32), 32).to(t.dtype)

    def _query_heads(self, q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Under quant_sim by one kernel (`_by_kernel`), for the decode step and the prefill alike: q [B, S, Hi * di],
        w [B, S, Hi], cos / sin [B or 1, S, R/2]. The head weights come back in fp32 (w * weights_scale rounded to
        w's dtype: the reference's values), as the scoring kernels read them. In a compiled 8K prefill chunk V4's
        Hadamard butterflies alone were three inductor kernels of 0.2-0.5 ms."""
        if not self.quant_sim:
            return super()._query_heads(q, w, cos, sin)
        return self._by_kernel(q, w, cos, sin, self.weights_scale)

    def _key_codes(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Under quant_sim by the queries' kernel, each key a position of one head (the same steps; its head weight
        unused): in V4's 8K prefill the reference's Hadamard butterflies alone were ~70 eager launches a layer, each
        waiting on the host."""
        if not self.quant_sim:
            return super()._key_codes(k, cos, sin)
        codes, _ = self._by_kernel(k, k.new_ones(*k.shape[:2], 1), cos[None], sin[None], 1.0)
        return codes.view_as(k)

    def _by_kernel(self, q, w, cos, sin, w_scale: float):
        """`dsv4::indexer_query` (RoPE, V4's Hadamard transform, the MXFP4 rounding and the head weights in one
        pass, bit-identical to the reference's steps) a position a row: q [B, S, H * di], w [B, S, H], cos / sin
        [B or 1, S, R/2] -> (q' [B, S, H, di], w' [B, S, H] fp32)."""
        B, S, H = w.shape
        rows = lambda t: t.expand(B, S, -1).reshape(B * S, t.shape[-1])  # [B * S, ...]
        q, w = indexer_query(rows(q), rows(w), rows(cos), rows(sin), w_scale, not self.is_v41)
        return q.view(B, S, H, q.shape[-1]), w.view(B, S, H)  # q [B * S, H, di]

    def _scores(self, q, keys, w, visible) -> torch.Tensor:
        """Under quant_sim the keys are MXFP4 values (the cache's packed rows, decoded), which encode back to
        the same values (tests/test_quant.py), so the kernel scores them in that form; otherwise the
        reference's scores."""
        if not self.quant_sim:
            return super()._scores(q, keys, w, visible)
        return torch.stack([mqa_index_scores(qb, *mxfp4_quant(kb.contiguous(), 32), wb.float(), visible)
                            for qb, kb, wb in zip(q, keys, w)])  # [B, S, T], one sequence at a time

    def _candidate_blocks(self, score: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The pool as the kept blocks' ids [B, S, n] (-1 = none), not a [B, S, T] mask: a consumer scores only
        their entries (`_top_in_pool`)."""
        return torch.stack([select_candidate_block_ids(s, visible, self.candidate_topk_blocks,
                                                       self.candidate_block_size) for s in score])

    def _top(self, score: torch.Tensor) -> torch.Tensor:
        return torch.stack([topk_select(s, self.topk) for s in score])

    def narrow_pool(self, width: int, T: int) -> bool:
        """Whether a consumer scores only its pool of `width` blocks (packed keys, the pool at most half the row of
        T entries) rather than every entry under the pool's mask: per entry the pool kernels ran at ~0.6x the
        dense path's rate (H200: 64 queries x 16K pool entries scored and selected in 206 us, `indexer.json`;
        8192 x 8192 dense in 7.9 ms, `dev/prefill-breakdown-2096504.json`)."""
        return self.quant_sim and 2 * width * self.candidate_block_size <= T

    def _top_in_pool(self, q, keys, w, visible, pool) -> torch.Tensor:
        """Scores only the entries of the pool's blocks (O(pool) per query, where the reference scores all T and
        masks) and selects among them by the pool-layout radix select: the same picks. Where the pool is not
        narrow (`narrow_pool`), the reference's way over the pool as a mask."""
        T, block = keys.shape[1], self.candidate_block_size
        if not self.narrow_pool(pool.shape[-1], T):
            return super()._top_in_pool(q, keys, w, visible, candidate_mask(pool, T, block))
        return torch.stack([mqa_index_topk(qb, *mxfp4_quant(kb.contiguous(), 32), wb.float(), visible, self.topk, pb,
                                           block, ascending=True)  # the pool of `_candidate_blocks`: ascending ids
                            for qb, kb, wb, pb in zip(q, keys, w, pool)])


class StepRows(NamedTuple):
    """The cache rows a decode step writes and its window reads, the same in every layer (one window size and
    start a slot, one capacity a compression ratio), made once in the step's entry: each layer spent a launch on
    each (a one-element kernel before each cache write)."""

    ring: torch.Tensor  # [B]: the window ring row a row's new KV goes to (position p at p % W)
    # [B, W] int32: the ring rows a row attends to, flat over the slots (slot * W + ring row; -1 below the window
    # start), in the attention kernel's int32 (a cast inside the op would be a copy kernel of its own)
    attended: torch.Tensor
    # by compression ratio r, [B]: the compressed row a row's token completes (group (p + 1) / r - 1 where r divides
    # p + 1), else the store's spare row (its capacity), which takes the writes of tokens completing no group
    group: dict[int, torch.Tensor]
    # by an index-key store's capacity, [B, capacity / POOL_BLOCK] int32: the pool blocks of each row's slot (every
    # block of the slot, in the flat layout of all slots' keys), which its indexers score
    pool_blocks: dict[int, torch.Tensor]
    # by `FastAttention.rotation`, the RoPE tables (cos, sin) [B, R/2] fp32 of the rows' positions: each layer
    # computed its own in a launch before its window write (the q rotation and the attention read them too)
    cos_sin: dict[bool, tuple[torch.Tensor, torch.Tensor]]
    # by compression ratio r, the compressed layers' RoPE tables [B, R/2] of the first position of the group a row's
    # token would complete (an entry's rotation; position 0 before the first group), as `group` is made once
    entry_cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]]
    # by the ratio r of indexer layers, [B] int32: each row's visible end in the flat layout of every slot's index
    # keys (slot * rows + (p + 1) / r), which their scoring reads
    index_ends: dict[int, torch.Tensor]
    # by the ratio r of HCA layers, [B, capacity] int32: the compressed rows a row attends to, every visible entry
    # of its slot flat over the slots (-1 past them; `FastAttention._global_ids`)
    visible_rows: dict[int, torch.Tensor]

    @classmethod
    def of(cls, pos: torch.Tensor, slots: torch.Tensor, state: SlotState, rotaries: dict[bool, Rotary]) -> StepRows:
        W = state.window_size
        back = pos[:, None] - torch.arange(W, device=pos.device)  # [B, W]: positions p - W + 1 .. p
        attended = torch.where(back >= state.window_start[slots, None], slots[:, None] * W + back % W, -1).int()
        caps = state.ratio_capacity
        done = {r: (pos + 1) // r for r in caps}  # [B] by ratio: the groups a row's positions complete
        group = {r: torch.where((pos + 1) % r == 0, done[r] - 1, cap) for r, cap in caps.items()}
        blocks = {cap: slots[:, None] * (cap // POOL_BLOCK + 1) + torch.arange(cap // POOL_BLOCK, device=pos.device)
                  for cap in state.key_capacities}  # a slot's cap + POOL_BLOCK rows: its blocks and a spare one
        cos_sin = {rotation: rotary.cos_sin(pos) for rotation, rotary in rotaries.items()}
        entry_cos_sin = {r: rotaries[True].cos_sin((done[r] - 1).clamp(min=0) * r) for r in caps}
        stride = {r: cap + POOL_BLOCK for r, cap in caps.items()}  # a slot's rows in either store
        roles = state.config.layer_roles
        indexed = {q.compress_ratio for q in roles if q.owns_indexer}
        index_ends = {r: (slots * stride[r] + done[r]).int() for r in indexed}
        visible_rows = {}
        for r in {q.compress_ratio for q in roles if q.attention_kind == "hca"}:
            entries = torch.arange(caps[r], device=pos.device)
            visible_rows[r] = torch.where(entries < done[r][:, None], slots[:, None] * stride[r] + entries, -1).int()
        return cls(pos % W, attended, group, {cap: b.int() for cap, b in blocks.items()}, cos_sin, entry_cos_sin,
                   index_ends, visible_rows)


class FastAttention(Attention):
    """The module path with the sparse attention kernel, and the static decode step."""

    # the linears of each input, by name under the attention; those a layer has are concatenated (SharedInput)
    ON_X = ("wq_a", "wkv", "compressor.wkv", "compressor.wgate", "indexer.weights_proj", "indexer.compressor.wkv",
            "indexer.compressor.wgate")
    ON_QR = ("wq_b", "indexer.wq_b")

    @property
    def rotation(self) -> bool:
        """Which RoPE tables of a decode step this layer's positions take (`StepRows.cos_sin`): a compressed layer's
        (compress_rope_theta, YaRN) or a window layer's (rope_theta), as `Attention` builds its rotary."""
        return bool(self.role.compress_ratio)

    def share_inputs(self, fp8: dict[Linear, Fp8Copy]) -> None:
        """Concatenate the dense linears reading x, and those reading the query latent (see SharedInput); keep the
        FP8 copies (`fp8`, by linear) the batch-1 decode reads: of those parts, and of wo_a and wo_b."""
        modules = dict(self.named_modules())
        if any(modules[n].fmt != "dense" for n in self.ON_X + self.ON_QR if n in modules):
            raise ValueError("the attention's linears are concatenated once dense (make_fast dequantizes them first)")
        self.on_x = SharedInput({n: modules[n] for n in self.ON_X if n in modules}, fp8)
        self.on_qr = SharedInput({n: modules[n] for n in self.ON_QR if n in modules}, fp8)
        wo = fp8.get(self.wo_a), fp8.get(self.wo_b)
        self.wo_fp8 = None if None in wo else wo

    def fp8_pairs(self) -> list[tuple[torch.Tensor, Fp8Copy]]:
        """(bf16 copy, FP8 copy of the same rows) of each weight a batch-1 decode step reads as stored FP8."""
        pairs = [(weight, stored) for *_, weight, stored in self.on_x.parts + self.on_qr.parts if stored is not None]
        if self.wo_fp8 is not None:
            pairs += zip((self.wo_a.weight, self.wo_b.weight), self.wo_fp8)
        return pairs

    # -------------------------------------------------------------- module path (prefill, replay)
    def forward(self, x: torch.Tensor, positions: torch.Tensor, shared: SharedKV, cache) -> torch.Tensor:
        """As Attention.forward (batch 1): x [1, S, D] at positions [S] -> [1, S, D]."""
        if x.shape[0] != 1:
            raise ValueError(f"the fast module path runs one sequence at a time, got a batch of {x.shape[0]}")
        cos, sin = self.rotary.cos_sin(positions)
        q, qr, kv = self._q_kv(x, cos[None], sin[None])
        layer = self.role.layer_id
        past, past_pos = cache.window(layer)
        cache.append_window(layer, kv, positions)
        key_pos = positions
        if past is not None:
            kv, key_pos = torch.cat((past.to(kv.dtype), kv), dim=1), torch.cat((past_pos, positions))
        # the window: key rows of positions p - W + 1 .. p (key_pos is consecutive)
        back = positions[:, None] - torch.arange(self.window, device=x.device)  # [S, W]
        win_idx = torch.where(back >= key_pos[0], back - key_pos[0], -1)
        glob, glob_idx = kv.new_zeros(1, kv.shape[-1]), positions.new_zeros(positions.shape[0], 0)
        if self.role.compress_ratio:
            glob = self._compressed(x, qr, positions, shared, cache)[0]
            if self.role.index_source is None:  # HCA: every visible entry
                glob_idx = _selected_ids(self._visible_compressed(positions, shared, glob.shape[0]))
            else:  # CSA: the index source's picks (no [S, G] mask of them)
                glob_idx = shared.topk[self.role.index_source][0]
        o = sparse_attn_bf16(q[0], kv[0], win_idx, glob.to(kv.dtype), glob_idx, self.attn_sink, self.head_dim**-0.5,
                             cos, sin)
        return self._output(o.to(x.dtype)[None])

    # the reference codecs' NaN checks read the device back (a host stall every forward): the quantization
    # kernels instead, bit-identical
    def _fake_fp8(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return dequantize_fp8(*fp8_quant(x.contiguous(), block), (block,)).to(x.dtype)

    def _fake_nvfp4(self, x: torch.Tensor, block: int) -> torch.Tensor:
        return dequantize_nvfp4(*nvfp4_quant(x.contiguous(), block), block).to(x.dtype)

    # -------------------------------------------------------------- decode step
    def decode(self, x: torch.Tensor, norm: RMSNorm, pos: torch.Tensor, slots: torch.Tensor, rows: StepRows,
               view: LayerSlots, picks: torch.Tensor | None, pool: torch.Tensor | None, compress: bool = True,
               squares: torch.Tensor | None = None):
        """norm(x) [B, D] (x before the layer's attn_norm, `norm`, which the linears reading it apply: see
        SharedInput; `squares`: x's partial sums of squares where the FFN post before handed them on): one token of each
        sequence, at positions pos [B] of slots [B] (the cache rows they write and read: `rows`), in the layer's buffers
        `view`. `picks` [B, k] int32: the index source's top-k as rows of the compressed store (`_global_ids`, made once
        in the source's layer; a CSA layer without its own indexer); `pool`: the candidate source's blocks (a candidate
        consumer; see `_index_decode`); `compress`: run the compressor (off in a bounded replay, whose positions'
        entries and carries are restored). -> (out [B, D], picks, pool): this layer's top-k and candidate blocks where
        it computes them, else those given."""
        cos, sin = rows.cos_sin[self.rotation]  # [B, R/2]
        on_x = self.on_x(x, norm, squares=squares)  # {linear: [B, N]}, as on_qr below
        if self.is_v41:  # the rotation alone, in wq_b's GEMV at batch 1 (a launch of its own before)
            on_qr = self.on_qr(on_x["wq_a"], self.q_norm, (cos, sin, self.n_heads, self.head_dim))
            q = on_qr["wq_b"].unflatten(-1, (self.n_heads, self.head_dim))  # [B, H, Dh]
        else:  # V4's per-head norm, then the rotation: one kernel where the compiled step took three
            on_qr = self.on_qr(on_x["wq_a"], self.q_norm)
            q = query_heads(on_qr["wq_b"], cos, sin, self.n_heads, self.eps, True)
        # the attention's global entries and index lists from earlier layers: it starts beside the window row's write
        settled = not self.role.owns_indexer and not (self.role.owns_compressor and compress)
        self._write_kv_rows(on_x["wkv"], self.kv_norm, cos, sin, slots, rows.ring, view.window, settled)
        win_idx = rows.attended
        win_data, win_scale = view.window.flat()
        store = view.store
        if self.role.compress_ratio:
            if self.role.owns_compressor and compress:
                self._compress_decode(on_x, x.dtype, pos, slots, rows, view)
            if self.role.owns_indexer:  # the picks as store rows, once: the layers reading them attend to the same
                picks, pool = self._index_decode(on_x, on_qr, pos, slots, rows, view, pool)
                picks = self._global_ids(slots, view, picks)
            glob_idx = rows.visible_rows[self.role.compress_ratio] if picks is None else picks
        else:
            glob_idx = pos.new_zeros(pos.shape[0], 0, dtype=torch.int32)
        glob_data, glob_scale = store.flat()
        scale = self.head_dim**-0.5
        if store.fmt == "nvfp4":
            o = sparse_attn_fp4(q, win_data, win_scale, win_idx, glob_data, glob_scale, glob_idx,
                                self.attn_sink, scale, cos, sin, settled=settled)
        else:
            o = sparse_attn_bf16(q, win_data, win_idx, glob_data, glob_idx, self.attn_sink, scale, cos, sin,
                                 settled=settled)
        return self._output_decode(o.to(x.dtype)), picks, pool

    def _write_kv_rows(self, kv, norm: RMSNorm, cos, sin, slots, places, rows: Rows,
                       start_successor: bool = False) -> None:
        """Window rows or compressed entries kv [B, Dh] (wkv's output, a compressor's pooled latent) normed by
        `norm`, rotated at cos, sin [B, R/2] and stored at (slots, places) of `rows`. V4.1's rounding is a packed
        store's own encoding (the window's FP8, the entries' NVFP4): the three in one kernel (`dsv4::window_write`);
        V4's (an FP8 round trip of the unrotated channels, `_window_quant`) into its dense stores likewise
        (`dsv4::window_write_rounded`). start_successor: V4.1's kernel starts the next launch early."""
        if self.is_v41 and rows.scale is not None:
            window_write(kv, norm.weight, norm.eps, cos, sin, rows.data, rows.scale, slots, places, rows.block,
                         rows.fmt, start_successor=start_successor)
        elif self._rounds_v4_rows(rows):
            window_write_rounded(kv, norm.weight, norm.eps, cos, sin, rows.data, slots, places, V4_WINDOW_FP8_BLOCK)
        else:
            kv = window_rows(kv, norm.weight, norm.eps, cos, sin)  # [B, Dh]
            rows.write(slots, places, kv if self.is_v41 else self._window_quant(kv))

    def _rounds_v4_rows(self, rows: Rows) -> bool:
        """Whether rows written to `rows` take V4's rounding (`_window_quant`) in `dsv4::window_write_rounded`: a V4
        window or compressed store, dense, with quant_sim on."""
        return not self.is_v41 and self.quant_sim and rows.fmt == "dense"

    def _output_decode(self, o: torch.Tensor) -> torch.Tensor:
        """`_output` of one token a row, o [B, H, Dh] -> [B, D]; at batch 1 from wo_a's and wo_b's FP8 copies."""
        if self.wo_fp8 is None or not Fp8Copy.serves(o):
            return self._output(o[:, None])[:, 0]
        wo_a, wo_b = self.wo_fp8
        o = wo_a(o.reshape(o.shape[0], -1), o.dtype, groups=self.o_groups)  # [1, groups * o_lora_rank]
        return wo_b(o, o.dtype, start_successor=True)  # the site's post reads all but this early (`settled`)

    def _global_ids(self, slots, view: LayerSlots, picks) -> torch.Tensor:
        """The indexer's `picks` (entry ids [B, k], -1 none) as rows of the source's compressed store, flat over the
        slots: [B, k] int32, what the attention reads (an HCA layer's: `StepRows.visible_rows`)."""
        return torch.where(picks >= 0, slots[:, None] * view.store.data.shape[1] + picks, -1).int()

    def _index_decode(self, on_x, on_qr, pos, slots, rows: StepRows, view: LayerSlots, pool):
        """The indexer's top-k entry ids [B, k] (-1 = none), as Indexer.forward for one token per row, and the
        candidate blocks: a candidate source's selection, a consumer's `pool` (which restricts its scores); the pool
        is the kept blocks' ids [B, n] where it is narrow (its consumers score only those), else a mask [B, cap].
        `rows`: the step's (its pool blocks)."""
        ix, role = self.indexer, self.role
        B = pos.shape[0]
        visible = (pos + 1) // role.compress_ratio  # [B]
        cos, sin = rows.cos_sin[self.rotation]
        keys, cap = view.index_keys, view.capacity
        q_proj, w_proj = on_qr["indexer.wq_b"], on_x["indexer.weights_proj"]
        q, w = ix._query_heads(q_proj[:, None], w_proj[:, None], cos[:, None], sin[:, None])
        q, w = q[:, 0], w[:, 0]  # [B, Hi, di], [B, Hi]
        stride, block = keys.data.shape[1], ix.candidate_block_size
        ends = rows.index_ends[role.compress_ratio]
        # a static choice (the capacity's): the pool as block ids that consumers score alone, or as a mask
        narrow = ix.narrow_pool(min(-(-cap // block), ix.candidate_topk_blocks), cap) and stride % block == 0
        if role.candidate_role == "consumer" and narrow:
            k_data, k_scale = keys.flat()
            blocks = torch.where(pool >= 0, slots[:, None] * (stride // block) + pool, -1)
            # the source's pool (select_candidate_block_ids) ascends, and the slot's offset keeps it so
            ids = mqa_index_topk(q, k_data, k_scale, w.float(), ends, ix.topk, blocks, block,
                                 ascending=True)[:, -min(ix.topk, cap):]
            return torch.where(ids >= 0, ids - slots[:, None] * stride, -1), pool
        if keys.fmt == "mxfp4":
            k_data, k_scale = keys.flat()
            score = mqa_index_scores_pool(q, k_data, k_scale, w.float(), ends, rows.pool_blocks[cap], POOL_BLOCK)
        else:  # unpacked keys (quant_sim off): index_scores over the slot's rows
            score = index_scores(q[:, None], keys.data[slots, :cap].to(q.dtype), w[:, None])[:, 0]
            score = score.masked_fill(torch.arange(cap, device=pos.device) >= visible[:, None], NEG_INF)
        if role.candidate_role == "source":
            pool = select_candidate_block_ids(score, visible, ix.candidate_topk_blocks, block)
            pool = pool if narrow else candidate_mask(pool, cap, block)
        elif role.candidate_role == "consumer":
            score = score.masked_fill(~pool, NEG_INF)
        return topk_select(score, ix.topk).view(B, -1), pool

    def _compress_decode(self, on_x, dtype, pos, slots, rows: StepRows, view: LayerSlots) -> None:
        """The compressor step of one token per row (on_x: the projections of its x, dtype: x's): carry the
        token, and store the entry (and index key) of the group it completes at its `StepRows.group` row (rows
        completing no group write to the slot's spare row), rotated by `StepRows.entry_cos_sin`."""
        role, r, comp, store = self.role, self.role.compress_ratio, self.compressor, view.store
        pooled = _compressor_pool(comp, on_x, "compressor.", dtype, pos, slots, view.carry)
        row, (cos, sin) = rows.group[r], rows.entry_cos_sin[r]
        self._write_kv_rows(pooled, comp.norm, cos, sin, slots, row, store)
        if role.owns_index_keys:
            ix, keys = self.indexer, view.index_keys
            if self.is_v41:
                k, norm = ix.wk(comp.norm(pooled)), ix.k_norm
            else:
                k = _compressor_pool(ix.compressor, on_x, "indexer.compressor.", dtype, pos, slots, view.index_carry)
                norm = ix.compressor.norm
            transform = not self.is_v41 and ix.quant_sim  # V4's Hadamard rotation of the keys
            if keys.scale is not None:  # MXFP4: the norm, RoPE, the transform and the encoding in one kernel
                window_write(k, norm.weight, norm.eps, cos, sin, keys.data, keys.scale, slots, row, keys.block,
                             keys.fmt, transform)
            else:
                k = window_rows(k, norm.weight, norm.eps, cos, sin)
                keys.write(slots, row, hadamard(k) if transform else k)


def _compressor_pool(comp, on_x, name, dtype, pos, slots, carry) -> torch.Tensor:
    """Compressor.forward for one token per row up to its norm, on a ring of raw projections (row p % R for
    position p; R >= 2 * ratio, see SlotState). on_x: the projections of the rows' x, the compressor's under `name`.

    Returns the pooled latent [B, d] in `dtype` of the group ending at pos (meaningful where (pos + 1) % ratio
    == 0; elsewhere the caller drops it), which comp.norm then normalizes."""
    if comp.ratio == 1:
        return on_x[name + "wkv"]
    return compressor_pool(on_x[name + "wkv"], on_x[name + "wgate"], getattr(comp, "ape", None), *carry, pos, slots,
                           comp.ratio, comp.overlap, dtype)


def _selected_ids(allowed: torch.Tensor) -> torch.Tensor:
    """A bool mask [S, G] -> the allowed columns per row [S, G], -1 elsewhere (no host sync)."""
    G = allowed.shape[-1]
    cols = torch.arange(G, device=allowed.device).expand_as(allowed)
    return torch.where(allowed, cols, -1)


# ---------------------------------------------------------------------------------------------- blocks
class FastBlock(Block):
    attention_cls = FastAttention
    moe_cls = FastMoE

    def site(self, h: torch.Tensor, site: str, collapse_pre: torch.Tensor | None):
        """mHC pre-site pass for h [N, hc, D] -> (x, pre, post, comb); see dsv4.fast.kernels.mhc."""
        c = self.config
        return mhc_pre(h, *self.site_params(site), collapse_pre, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)

    def site_params(self, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An mHC site's (fn, scale, base): hc_{site}_fn, hc_{site}_scale, hc_{site}_base."""
        return tuple(getattr(self, f"hc_{site}_{p}") for p in ("fn", "scale", "base"))

    def forward(self, h, pre, input_ids, positions, shared, cache=None, hash_ids=None):
        """As Block.forward: h [B, S, hc, D]."""
        if self.role.engram:
            h = self.engram(h, hash_ids)
        B, S = h.shape[:2]
        single_pass = self.config.is_v41
        flat = h.flatten(0, 1)  # [N, hc, D]
        x, attn_pre, post, comb = self.site(flat, "attn", pre.flatten(0, 1) if single_pass else None)
        a = self.attn(self._attn_input(x).view(B, S, -1), positions, shared, cache)
        flat = mhc_post(a.flatten(0, 1), flat, post, comb)
        x, ffn_pre, post, comb = self.site(flat, "ffn", attn_pre if single_pass else None)
        f = self.ffn(self._ffn_input(x).view(B, S, -1), input_ids)
        flat = mhc_post(f.flatten(0, 1), flat, post, comb)
        return flat.view_as(h), ffn_pre.view(B, S, -1)

    def _attn_input(self, x: torch.Tensor) -> torch.Tensor:
        """attn_norm(x) for the module path, a prefill piece (`PREFILL_PIECES`): eager, an 8K chunk's norm is five
        passes over [S, D] in fp32 (0.55 ms at V4's width on the H100)."""
        return self.attn_norm(x)

    def _ffn_input(self, x: torch.Tensor) -> torch.Tensor:
        """ffn_norm(x), likewise."""
        return self.ffn_norm(x)

    def decode(self, h, pre, ids, pos, slots, rows, view: LayerSlots, picks, pool, engram_rows, compress=True,
               next_site=None):
        """One token per row: h [B, hc, D], pre, the step's cache rows, the layer's buffers `view`, the top-k and
        candidate blocks it takes and `compress` (FastAttention.decode), its Engram rows [B, C, head_dim] -> (h, pre,
        picks, pool). Everything layer-specific comes in as arguments, so layers of one kind share compiled code.

        pre is what the layer before left: V4.1's collapse weights [B, hc] (None for V4), or, where it took this
        layer's attention-site pass (`next_site`), that pass: (x [B, D], the site's coefficients as
        `decode_post_partial` returns them, x's squares or None). With `next_site` (the next layer's attention site:
        `site_params`) this layer's FFN post takes the next one's pass (`decode_post_partial`) and returns it as
        pre, at one token with x's squares, by which the next layer's first GEMV normalizes x (`SharedInput`)."""
        if self.role.engram:
            h = self.engram.mix(h[:, None], engram_rows[:, None])[:, 0]
        x, coefficients, squares = pre if isinstance(pre, tuple) else (*self.decode_pre_site(h, "attn", pre), None)
        a, picks, pool = self.attn.decode(x, self.attn_norm, pos, slots, rows, view, picks, pool, compress, squares)
        h, x, coefficients, squares = self.decode_between_sites(a, h, coefficients)
        # [B, D], or at one token the slots the fused posts sum
        f = self.ffn.normed_slots(x, squares, self.ffn_norm, ids)
        if next_site is not None:
            h, x, coefficients, squares = self.decode_post_partial(f, h, "ffn", coefficients, next_site,
                                                                   squares=Fp8Copy.serves(x))
            return h, (x, coefficients, squares), picks, pool
        h, pre = self.decode_post_site(f, h, "ffn", coefficients)
        return h, pre, picks, pool

    def decode_pre_site(self, h: torch.Tensor, site: str, pre: torch.Tensor | None):
        """A decode step's pre-site pass: h [B, hc, D] -> (x [B, D], what `decode_post_site` needs). V4.1 collapses
        with pre (the previous site's) and leaves this site's coefficients as partial sums: its post is the first to
        read them (`mhc_pre_partial`, `mhc_post_finish`: one launch fewer a site). V4: mhc_pre's post and comb."""
        if self.config.is_v41:
            return mhc_pre_partial(h, getattr(self, f"hc_{site}_fn"), pre)
        x, _, post, comb = self.site(h, site, None)
        return x, (post, comb)

    def decode_between_sites(self, a: torch.Tensor, h: torch.Tensor, coefficients):
        """The attention site's post, then the FFN site's pre pass: (h', x, the FFN site's coefficients, x's squares
        where the FFN's gate takes them, else None), as `decode_post_partial`."""
        gate_normed = FastMoE.normed_in_gate(a.shape[0])
        return self.decode_post_partial(a, h, "attn", coefficients, self.site_params("ffn"), squares=gate_normed,
                                        start_next=gate_normed)

    def decode_post_partial(self, f: torch.Tensor, h: torch.Tensor, site: str, coefficients, next_site: tuple,
                            squares: bool = False, start_next: bool = False):
        """A site's post, then the pre pass of the next site (this layer's FFN site, or the next layer's attention site;
        next_site: its `site_params`) -> (h', x, that site's coefficients, with `squares` (V4.1) x's sums of squares by
        d step for the consumer to normalize x by (the FFN's gate: `FastMoE.normed_slots`; the next layer's first GEMV:
        `SharedInput`), else None). V4.1: one kernel (`mhc_post_partial`: the new streams' partial sums and collapse
        taken while they are in registers; at one token 8-9 us where mhc_post_finish and mhc_pre_partial took 18, H100,
        `bench/mhc.py --sweep`). V4, whose sites collapse with their own pre: the post and the next site's partial sums
        in one kernel (`mhc_post_sums`), then its finish (`mhc_pre_finish`), two launches where mhc_post and mhc_pre
        took three. Both posts are `settled` (h and the coefficients were made before the sub-layer's kernels): they
        finish the coefficients before their PDL wait, beside the tail of the kernel before them (wo_b's GEMV and the
        MoE's down kernel start them early): V4.1's post 8.1 -> 2.0 us a launch on the H100 (session 52). `start_next`
        (the attention site's post, handing the squares to the gate): the post starts the gate GEMM as it passes its
        wait, so that the GEMM's first weight loads run beside the post's last work (session 63, H100: the gate 1.2-4 us
        faster a launch; the next layer's wq_a GEMV, started so by the FFN post, ran ~2.9 us slower, so that post does
        not). On the H200 (session 64) the step came out the same: the post ran ~1 us longer where the gate gained."""
        c = self.config
        fn_next, scale_next, base_next = next_site
        eps = (c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        if c.is_v41:
            scale, base = self.site_params(site)[1:]
            h, x, ws, xsq = mhc_post_partial(f, h, coefficients, scale, base, fn_next, *eps, settled=True,
                                             squares=squares, start_next=start_next)
            return h, x, ws, xsq if squares else None
        h, ws = mhc_post_sums(f, h, *coefficients, fn_next, settled=True)
        x, _, post, comb = mhc_pre_finish(h, ws, scale_next, base_next, *eps)
        return h, x, (post, comb), None

    def decode_post_site(self, f: torch.Tensor, h: torch.Tensor, site: str, coefficients):
        """The sub-layer's output f [B, D] (or the MoE's slots: `summed_slots`) spread over the streams h [B, hc, D]
        -> (h', this site's pre: V4.1's next collapse weights, None for V4). V4.1's post sums the slots in its kernel
        and is `settled`, as `decode_post_partial`'s."""
        c = self.config
        if c.is_v41:
            scale, base = self.site_params(site)[1:]
            return mhc_post_finish(f, h, coefficients, scale, base, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters,
                                   settled=True)
        return mhc_post(summed_slots(f, h.dtype), h, *coefficients), None


# ---------------------------------------------------------------------------------------------- model
class FastModel(Dsv4Model):
    block_cls = FastBlock
    engram_prefetch: EngramPrefetcher | None = None  # host-resident Engram tables (keep_engram_on_host)

    @torch.no_grad()
    def decode_step(self, ids: torch.Tensor, slots: torch.Tensor, state: SlotState,
                    parts: tuple[Callable, Callable, Callable] | None = None,
                    replay_from: torch.Tensor | None = None) -> torch.Tensor | None:
        """ids [B] (one new token per sequence) in slots [B] -> logits [B, vocab] fp32.

        Appends each token at its slot's length and advances the lengths; every shape is static and no
        value crosses to the host, so the runner captures this in a CUDA graph. `parts`: the entry, block
        and exit functions to run (`compile_decode`'s compiled ones; default: these, eagerly).

        With `replay_from` [1] (a restored slot's length minus the window), the step is that slot's bounded
        replay instead: ids [W] are its tokens at replay_from.. (slots: the slot W times), each row one of those
        positions. Every layer writes the rows' window KV before it attends, masked below replay_from (the new
        window start), so each row sees the rows before it, as in a forward over the window; the compressors
        are off (the restored entries and carries stay), lengths stay, and no logits are made (None).

        The layer loop stays in Python: it looks up each layer's buffers, hands each indexer's top-k to the
        layers that read it, and starts and awaits the Engram prefetch (stream and event calls a compiled
        region would break around), while every layer's own work runs in the one block function."""
        enter, block, leave = parts or (self.decode_enter, FastBlock.decode, self.decode_exit)
        h, pre, pos, step_rows, hash_ids = enter(ids, slots, state, replay_from)
        if self.engram_prefetch is not None:
            self.engram_prefetch.start(hash_ids[:, None])  # [B, 1, L, C]: one position per row
        topk, candidates = {}, None  # the indexers' top-k by layer id; the candidate source's blocks
        for i, layer in enumerate(self.layers):
            role = layer.role
            picks = None if role.owns_indexer else topk.get(role.index_source)
            pool = candidates if role.candidate_role == "consumer" else None
            engram_rows = self._engram_rows(layer, hash_ids) if role.engram else None
            view = state.layer_slots[role.layer_id]
            h, pre, picks, pool = block(layer, h, pre, ids, pos, slots, step_rows, view, picks, pool, engram_rows,
                                        replay_from is None, self._next_attn_site(i))
            if role.owns_indexer:
                topk[role.layer_id] = picks
            if role.candidate_role == "source":
                candidates = pool
        return leave(h, pre) if replay_from is None else None

    def _next_attn_site(self, i: int) -> tuple | None:
        """The attention site of self.layers[i + 1] (`site_params`), whose pre pass the FFN post of self.layers[i]
        then takes (`FastBlock.decode_post_partial`); None after the last layer and before an Engram layer (it mixes
        its rows into the streams before that pass)."""
        if i + 1 == len(self.layers) or self.layers[i + 1].role.engram:
            return None
        return self.layers[i + 1].site_params("attn")

    def decode_enter(self, ids: torch.Tensor, slots: torch.Tensor, state: SlotState,
                     replay_from: torch.Tensor | None = None):
        """The decode step's entry: positions [B], token and length writes (a replay's: the window start), the
        embedded streams h [B, hc, D], V4.1's first collapse weights pre [B, hc], the cache rows the step writes and
        its windows read (`StepRows`) and Engram hash ids [B, n_layers, C] (None without)."""
        c = self.config
        if replay_from is None:
            pos = state.lengths[slots]  # [B]
            state.tokens[slots, pos] = ids
            state.lengths[slots] = pos + 1
        else:  # the replayed positions; the slot's window restarts at the first
            pos = replay_from + torch.arange(ids.shape[0], device=ids.device)  # [W]
            state.window_start[slots] = replay_from.expand_as(slots)
        state.lengths[state.scratch :].zero_()  # padding rows write at position 0 of the scratch slot, every step
        h = self.embed(ids)[:, None].expand(-1, c.hc_mult, -1).contiguous()  # [B, hc, D]
        one_hot = (torch.arange(c.hc_mult, device=ids.device) == 0).float()  # V4.1's first collapse: stream 0
        # contiguous, as every later layer's pre: the first layer's kind shares their compiled block
        pre = one_hot.expand(ids.shape[0], -1).contiguous() if c.is_v41 else None
        hash_ids = self._decode_hash_ids(pos, slots, state) if c.is_v41 and c.engram_layer_ids else None
        rotaries = {layer.attn.rotation: layer.attn.rotary for layer in self.layers}
        return h, pre, pos, StepRows.of(pos, slots, state, rotaries), hash_ids

    def decode_exit(self, h: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
        """The streams h [B, hc, D] collapsed, normed and projected: logits [B, vocab] fp32."""
        c = self.config
        if c.is_v41:
            x = hc_collapse(h[:, None], pre[:, None])[:, 0]
        else:
            head_pre = hc_head_pre(h[:, None], self.hc_head_fn, self.hc_head_scale, self.hc_head_base, c.rms_norm_eps, c.hc_eps)
            x = hc_collapse(h[:, None], head_pre)[:, 0]
        return self.logits(x)

    def compile_decode(self, backend: str = "inductor") -> Callable:
        """decode_step with its entry, block and exit compiled (torch.compile fuses the torch glue between the
        kernels). Shapes are automatic dynamic: each part compiles for batch 1 and then once with the batch as
        a symbol, which serves every larger size. The block compiles per layer kind, not per layer (V4.1-Flash:
        8 kinds in 40 layers, V4-Flash: 4 in 43), so the start-up does not grow with depth; the kinds split a little
        further by whether the layer's attention-site pass came from the layer before and whether it takes the next
        one's (`_next_attn_site`: not around an Engram layer or at the ends).

        Compiled code lives on the functions' code objects, shared by every model in the process (a second
        runner of other slot sizes compiles again, with those sizes symbolic too). Past a code object's limit of
        compiles dynamo would run the rest eagerly, so the step raises the limit to what this model may need: a
        kind per layer at most, three times (batch 1, symbolic, and the bounded replay's), for two runners. The parts compile deterministic
        (`compile_options`): a decode step gives the same logits in every process."""
        options = compile_options(backend, deterministic=True)
        parts = tuple(torch.compile(f, backend=backend, dynamic=None, options=options)
                      for f in (self.decode_enter, FastBlock.decode, self.decode_exit))
        limit = max(torch._dynamo.config.recompile_limit, 6 * len(self.layers))

        def step(ids: torch.Tensor, slots: torch.Tensor, state: SlotState,
                 replay_from: torch.Tensor | None = None) -> torch.Tensor | None:
            with torch._dynamo.config.patch(recompile_limit=limit):
                return self.decode_step(ids, slots, state, parts, replay_from)

        return step

    def compile_prefill(self, backend: str = "inductor") -> None:
        """Compile the module path's cache-free pieces in place (`PREFILL_PIECES`: the attention's query, KV and
        output projections with their norms, RoPE and quantization steps, the indexer's queries, and each block's
        attn_norm and ffn_norm), where eager torch spends most of a prefill's time outside the kernels on
        elementwise passes over [S, H, Dh] tensors.

        The cache reads and writes, the compressors' carry and the kernels stay eager between them. One compiled
        function per piece serves every module of its class (each module's attribute shadows the class's method
        with the compiled function bound to it), compiled for the first chunk length and then with the length as a
        symbol. The decode step's compile inlines the pieces it calls. In place, as `nn.Module.compile`: every later
        forward of this model runs them compiled, through whichever runner (one that must run uncompiled needs a
        model of its own)."""
        for cls, names in PREFILL_PIECES:
            for name in names:
                method = getattr(cls, name)
                compiled = torch.compile(method, backend=backend, dynamic=None, options=compile_options(backend))
                for module in self.modules():
                    if isinstance(module, cls):
                        setattr(module, name, _compiled_piece(compiled, method, module))

    def _check_prompt(self, input_ids: torch.Tensor) -> None:
        """The runner checks prompts where they arrive (on the host, before the upload: `Runner._upload`);
        a check of device ids here would stall the host every forward. `forward` checks its own."""

    def forward(self, input_ids: torch.Tensor, cache=None, start_pos: int = 0) -> torch.Tensor:
        """The reference's forward (the module path without a runner, as `Dsv4ForCausalLM` runs it), its ids
        checked as the reference checks them."""
        self.check_token_ids(input_ids)
        return super().forward(input_ids, cache=cache, start_pos=start_pos)

    def _engram_rows(self, layer: FastBlock, hash_ids: torch.Tensor) -> torch.Tensor:
        """The decode step's rows of an Engram layer [B, C, head_dim]: from the prefetch (the current stream
        waits for its gather here), or gathered from the device-resident table now."""
        index = self.config.engram_layer_ids.index(layer.role.layer_id)
        if self.engram_prefetch is not None:
            return self.engram_prefetch.wait(index)[:, 0]
        return layer.engram.embed(hash_ids[:, index], self.embed.weight.dtype)

    def engram_hash_ids(self, history: torch.Tensor, start_pos: int) -> torch.Tensor:
        """As the reference; with host tables a forward's rows start coming now, on the prefetch's side stream (when
        they fit its buffers as planned; the Engram layers of a longer forward gather their rows themselves)."""
        ids = super().engram_hash_ids(history, start_pos)  # [B, S, L, C]
        pre = self.engram_prefetch
        if pre is not None and pre.fits(ids.shape[0] * ids.shape[1], ids.shape[3]):
            pre.start(ids, hold=True)
        return ids

    def _decode_hash_ids(self, pos, slots, state: SlotState) -> torch.Tensor:
        """Engram rows of the new tokens [B, n_layers, (N-1)*H] from the slots' last N tokens."""
        hasher, N = self.engram_hasher, self.config.engram_max_ngram_size
        back = pos[:, None] - torch.arange(N - 1, -1, -1, device=pos.device)  # [B, N], oldest first
        tokens = state.tokens[slots[:, None], back.clamp(min=0)]
        compressed = hasher.compress(tokens).masked_fill(back < 0, -1)  # before the start: DEAD, i.e. padding
        rows = engram_hash(compressed, N - 1, hasher.multipliers, hasher.primes, hasher.offsets, hasher.pad)
        return rows[:, 0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits from bf16 operands: exact products, fp32 accumulation, no fp32 copy of the head."""
        x = self.norm(hidden)
        if x.is_cuda and x.dtype == torch.bfloat16:
            return mm_fp32_out(x, self.head.weight)
        return F.linear(x.float(), self.head.weight.float())


def compile_options(backend: str, deterministic: bool = False) -> dict | None:
    """torch.compile options for the model's parts: inductor fuses bf16 glue into fp32 arithmetic unless told to
    round where the model's code casts. `deterministic`: inductor makes no choice by timing (reduction configs,
    padding), so every process compiles the same kernels and computes the same logits. Two processes compiling the
    decode step from empty caches (H200, V4.1 layers 2-5, `bench/decode_compile.py`): without it batch-1 logits
    agreed bit for bit and batch-8 ones differed by up to 0.033; with it both agreed, at the same step times (1.52
    / 3.46 ms). Inductor's kernels launch with programmatic dependent launch, as the Triton ops' do (`pdl`; inductor
    emits it on Hopper and later only, and waits wherever a kernel reads what the one before it wrote)."""
    if backend != "inductor":
        return None
    options = {"emulate_precision_casts": True, "deterministic": deterministic}
    if hasattr(torch._inductor.config.triton, "enable_pdl"):  # torch >= 2.10
        options["triton.enable_pdl"] = True
    return options


def _compiled_piece(compiled: Callable, method: Callable, module: torch.nn.Module) -> Callable:
    """`compiled` bound to `module`; inside another compiled region (the decode step's parts) the plain method,
    which that region's trace inlines (a compiled function traced from within a compiled region depends on how
    each torch version unwraps it: torch 2.11 dropped the bound module)."""

    def piece(*args):
        if torch.compiler.is_compiling():
            return method(module, *args)
        return compiled(module, *args)

    return piece


# what FastModel.compile_prefill compiles: (class, methods)
PREFILL_PIECES = ((FastAttention, ("_q_kv", "_output")), (FastIndexer, ("_queries",)),
                  (FastBlock, ("_attn_input", "_ffn_input")))


def make_fast(model: Dsv4Model, packed_kv: bool = True, fp8_decode: bool | None = None) -> FastModel:
    """Turn a loaded reference model into the fast model, in place (see the module docstring).

    `packed_kv` keeps the KV cache and index keys in the released formats (FP8 / NVFP4 / MXFP4, the
    reference's quant_sim steps); off, they stay in the model dtype and the model computes as the
    reference with quant_sim off (what the whole-model A-vs-B tests compare: rounding-free, so no
    rounding boundary can amplify a summation-order difference).

    The fast classes add no parameters, only forward methods; switching the instances' classes keeps
    every module, name and tensor of the checkpoint where the loader put it. Move the model to its
    device first: the re-laid-out weights and RoPE frequencies are made where the weights are.

    `fp8_decode` (default: on CUDA) keeps the attention's and the shared expert's FP8 weights as stored beside
    their bf16 copies for the batch-1 decode step (`Fp8Copy`): ~0.16 GB a V4.1-Flash layer more. Off the GPU the ops
    run their twins, which read the bf16 copies (fp8_gemv's dequantizes every call): correct, not faster."""
    if isinstance(model, FastModel):  # already converted: its weights are laid out; only the KV formats change
        _attach_engram_prefetch(model)
        model.set_quant_sim(packed_kv, activations=False)
        return model
    if model.embed.weight.is_meta:
        raise ValueError("make_fast needs a loaded model (its weights are still on the meta device)")
    if model.embed.weight.is_cuda and model.embed.weight.dtype != torch.bfloat16:
        # the kernels' tensor-core paths take bf16 operands: another dtype would not compute what it says
        raise ValueError(f"the fast model on CUDA computes in bfloat16; load the model in bfloat16, not "
                         f"{model.embed.weight.dtype}")
    model.__class__ = FastModel
    device = model.embed.weight.device
    for block in model.layers:
        block.__class__ = FastBlock
        block.attn.__class__ = FastAttention
        block.ffn.__class__ = FastMoE
        block.attn.rotary = DeviceRotary(block.attn.rotary, device)
        if hasattr(block.attn, "indexer"):
            block.attn.indexer.__class__ = FastIndexer
    dtype = model.embed.weight.dtype
    if fp8_decode is None:
        fp8_decode = device.type == "cuda"
    # the attention's and the shared experts' FP8 linears as stored, by linear; what share_inputs and prepare do
    # not keep goes with this function
    stored = {m: Fp8Copy(m.weight.detach(), m.scale.detach(), m.block) for block in model.layers
              for part in (block.attn, block.ffn.shared_experts) for m in part.modules()
              if isinstance(m, Linear) and m.fmt == "fp8"} if fp8_decode else {}
    for m in model.modules():
        if isinstance(m, Linear) and m.fmt == "fp8":
            _dequantize_in_place(m, torch.float32 if m.fp32 else dtype)
        if isinstance(m, Linear) and m.fp32 and m.fmt == "dense":
            m.__class__ = FastLinear
    for block in model.layers:
        block.ffn.prepare(stored)
        block.attn.share_inputs(stored)
    _attach_engram_prefetch(model)
    model.set_quant_sim(packed_kv, activations=False)
    return model


def _attach_engram_prefetch(model: FastModel) -> None:
    """A prefetcher over the Engram tables kept in host memory (`keep_engram_on_host`), if there are any."""
    embeds = [b.engram.embed for b in model.layers if b.role.engram]
    host = [isinstance(e, HostEngramEmbedding) for e in embeds]
    if not any(host):
        return
    if not all(host):
        raise ValueError("some Engram tables are in host memory and some are not: keep_engram_on_host moves them all")
    weight, prefetch = model.embed.weight, model.engram_prefetch
    if prefetch is None or prefetch.device != weight.device:
        model.engram_prefetch = EngramPrefetcher([e.table for e in embeds], weight.device, dtype=weight.dtype)
    for index, embed in enumerate(embeds):  # a prefill's Engram layers take the rows its forward's entry started
        embed.prefetch, embed.index = model.engram_prefetch, index


def _dequantize_in_place(linear: Linear, dtype: torch.dtype) -> None:
    """An FP8 linear becomes a dense one holding its exact values."""
    weight = linear.dequantized_weight().to(dtype)
    linear.fmt = "dense"
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    linear.register_parameter("scale", None)
