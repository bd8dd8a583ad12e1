"""Fused mHC: the pre-site pass (project, split, Sinkhorn, collapse) and the post-site expand.

`dsv4::mhc_pre(h, fn, scale, base, collapse_pre, norm_eps, hc_eps, iters) -> (x, pre, post, comb)`
    h [N, hc, D] (bf16/fp32), fn [M=(2+hc)*hc, hc*D] fp32, scale [3], base [M] fp32,
    collapse_pre [N, hc] fp32 or None. x [N, D] in h's dtype; pre, post [N, hc] and comb [N, hc, hc] fp32.
    mixes = (h_flat @ fn^T) * rsqrt(mean(h_flat^2) + norm_eps), split into pre / post / comb with
    Sinkhorn (`iters` column normalizations, the first after a row softmax), and x = sum_k w_k h_k with
    w = collapse_pre when given (V4.1 single-pass: the previous site's pre) else this site's pre.
`dsv4::mhc_post(f, residual, post, comb) -> h'`
    f [N, D], residual [N, hc, D], post [N, hc], comb [N, hc, hc] -> [N, hc, D] in f's dtype,
    h'_k = post_k f + sum_j comb[j, k] residual_j in fp32.

`dsv4::mhc_pre_partial(h, fn, collapse_pre) -> (x, ws)` and
`dsv4::mhc_post_finish(f, residual, ws, scale, base, norm_eps, hc_eps, iters, settled) -> (h', pre)`
    V4.1's decode pair: a site's pre, post and comb are first read by its post (x collapses with the previous
    site's pre), so the post kernel finishes them from the partial kernel's workspace ws [S, N, M + 1]
    (`partial_splits`) and the finish kernel's launch goes; pre [N, hc] fp32 is the next site's collapse weights.
`dsv4::mhc_post_partial(f, residual, ws, scale, base, fn_next, norm_eps, hc_eps, iters, settled, squares,
start_next) -> (h', x, ws_next, squares)`
    mhc_post_finish, then mhc_pre_partial of the next site on h' (collapsing with this site's pre) in the same
    kernel, a program per (row, d step of the partial pass): V4.1's attention post and FFN pre in one launch. Its
    projection runs on the CUDA cores in fp32 (one row a program, so the Sinkhorn stays in threads). Up to
    POST_PARTIAL_MAX_N rows; more take the two kernels (every program finishes its row's coefficients again).
    f may be the MoE's slots [N, S, D] fp32 (the gather path's routed experts and shared expert), summed in slot
    order and rounded to the streams' dtype as the module sums them (`summed_slots`): the decode step's FFN post
    takes the sum where a kernel of its own made it (mhc_post_finish's too).
    settled (the three posts; default False): the caller vouches that residual and the coefficients' inputs were
    written before the kernel that made f (the decode step: a sub-layer ran between the site's pre pass and its
    post). The kernel then reads them and finishes the coefficients before its PDL wait, and waits only for f;
    the kernels before the decode step's posts (wo_b's FP8 GEMV, the MoE's down kernel) start it early
    (`start_successor`), so that chain runs beside their last programs. start_next (with settled): the kernel
    after this one starts once this one has waited (the decode step's gate GEMM after the attention post: its
    first weight loads run beside the post's last work).
`dsv4::mhc_post_sums(f, residual, post, comb, fn_next, settled) -> (h', ws_next)` and
`dsv4::mhc_pre_finish(h, ws, scale, base, norm_eps, hc_eps, iters) -> (x, pre, post, comb)`
    V4's decode pair (each site collapses with its own pre, so x waits for the finish): the post with the
    coefficients given and the next site's partial sums on h' in the same kernel (mhc_post_partial's, without
    the finish and the collapse), then mhc_pre's second kernel alone: two launches a site where mhc_post and
    mhc_pre took three.

Twins: `dsv4.reference.mhc` (hc_project, hc_split_sinkhorn, hc_collapse, hc_expand) on [1, N, ...]; the pair's
twins split hc_project's sums by D range as the workspace holds them.

mhc_pre runs as two launches:
  1. `_pre_partial_kernel`, grid (token blocks, D splits): each program reads its slice of h once (all
     hc streams for one range of d), accumulates the partial projection h_flat @ fn^T on the tensor
     cores and the partial sum of squares, and writes both to a small fp32 workspace [S, N, M + 1].
     With collapse_pre given, it also writes x for its d range from the same registers, so h is read
     from memory exactly once.
  2. `_pre_finish_kernel`, grid (token blocks, D chunks): sums the S partials, applies rsqrt, the split
     and Sinkhorn (fp32, IEEE division), writes pre/post/comb; without collapse_pre it then collapses its
     d chunk with this site's pre (h is read a second time: the weights need the full row first).
The projection is fp32-exact: bf16 h meets fn split into three bf16 pieces (hi + mid + lo carry all 24
bits of fp32), three bf16 MMAs with fp32 accumulation; fp32 h uses Triton's tf32x3. Each step's MMA
result joins the running sum through an ordinary fp32 add, so tensor-core accumulation rounding stays
within one step.
"""

from __future__ import annotations

import functools

import torch

from dsv4.fast.kernels import pdl, start_successor, tl, to_bf16, triton, use_triton, wait_for_predecessor
from dsv4.fast.kernels.torch_math import exp
from dsv4.reference.mhc import hc_collapse, hc_expand, hc_project, hc_split_sinkhorn

# ------------------------------------------------------------------------------------------------
# Twins: the reference functions on [1, N, ...]


def mhc_pre_twin(h, fn, scale, base, collapse_pre, norm_eps, hc_eps, iters):
    hb = h.unsqueeze(0)
    mixes = hc_project(hb, fn, norm_eps)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, h.shape[1], iters, hc_eps)
    w = pre if collapse_pre is None else collapse_pre.float().unsqueeze(0)
    x = hc_collapse(hb, w)
    return x[0], pre[0], post[0], comb[0]


def mhc_post_twin(f, residual, post, comb):
    return hc_expand(f.unsqueeze(0), residual.unsqueeze(0), post.unsqueeze(0), comb.unsqueeze(0))[0]


def partial_sums_twin(h, fn):
    """The workspace [S, N, M + 1] of h's pre pass: split s's partial mixes (its d range of every stream against
    fn) and partial sum of squares, S = `partial_splits`."""
    N, hc, D = h.shape
    S = partial_splits(D, h.element_size())
    hf = h.float().view(N, hc, S, D // S)
    fv = fn.float().view(-1, hc, S, D // S)
    return torch.cat([torch.einsum("nksd,mksd->snm", hf, fv), hf.square().sum(dim=(1, 3)).T[..., None]], dim=-1)


def mhc_pre_partial_twin(h, fn, collapse_pre):
    """x collapsed with collapse_pre, and the workspace (`partial_sums_twin`)."""
    return hc_collapse(h.unsqueeze(0), collapse_pre.float().unsqueeze(0))[0], partial_sums_twin(h, fn)


def summed_slots(f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A sub-layer's output f [N, D] as it is, or the MoE's slots [N, S, D] fp32 summed in slot order and rounded
    to `dtype` (the streams'), as the MoE module returns them."""
    return f.sum(dim=1).to(dtype) if f.dim() == 3 else f


def mhc_post_partial_twin(f, residual, ws, scale, base, fn_next, norm_eps, hc_eps, iters, squares=False):
    """The site's post (mhc_post_finish's twin), then the next site's partial pass on its output (mhc_pre_partial's,
    collapsing with this site's pre): (h', x, the next site's workspace, x's squares by d step, or none without
    `squares`). f: [N, D] or slots (`summed_slots`)."""
    out, pre = mhc_post_finish_twin(summed_slots(f, residual.dtype), residual, ws, scale, base, norm_eps, hc_eps,
                                    iters)
    x, ws_next = mhc_pre_partial_twin(out, fn_next, pre)
    return out, x, ws_next, squares_by_step(x, squares)


def squares_by_step(x: torch.Tensor, wanted: bool = True) -> torch.Tensor:
    """x [N, D] -> [N, S] fp32: the sums of its squares over each of the partial pass's S d steps
    (`partial_splits`), which sum to rms_norm's sum of squares: what the FFN's gate normalizes x by. Not wanted:
    [N, 0], nothing computed."""
    N, D = x.shape
    if not wanted:
        return x.new_empty(N, 0, dtype=torch.float32)
    return x.float().square().view(N, partial_splits(D, x.element_size()), -1).sum(-1)


def finished_coefficients_twin(ws, scale, base, hc, D, norm_eps, hc_eps, iters):
    """The workspace's splits summed into the site's mixes (hc_project's), split and Sinkhorn: (pre, post, comb)."""
    mixes = ws[..., :-1].sum(dim=0) * torch.rsqrt(ws[..., -1].sum(dim=0) / (hc * D) + norm_eps)[:, None]
    return tuple(t[0] for t in hc_split_sinkhorn(mixes.unsqueeze(0), scale, base, hc, iters, hc_eps))


def mhc_post_finish_twin(f, residual, ws, scale, base, norm_eps, hc_eps, iters):
    """The site's coefficients finished from the workspace, then the expand: (h', pre)."""
    _, hc, D = residual.shape
    pre, post, comb = finished_coefficients_twin(ws, scale, base, hc, D, norm_eps, hc_eps, iters)
    return mhc_post_twin(f, residual, post, comb), pre


def mhc_post_sums_twin(f, residual, post, comb, fn_next):
    """V4's post, then the next site's partial sums on its output: (h', the next site's workspace). f: [N, D] or
    slots (`summed_slots`)."""
    out = mhc_post_twin(summed_slots(f, residual.dtype), residual, post, comb)
    return out, partial_sums_twin(out, fn_next)


def mhc_pre_finish_twin(h, ws, scale, base, norm_eps, hc_eps, iters):
    """A site's coefficients finished from its workspace, and x collapsed with its own pre: (x, pre, post, comb)."""
    _, hc, D = h.shape
    pre, post, comb = finished_coefficients_twin(ws, scale, base, hc, D, norm_eps, hc_eps, iters)
    return hc_collapse(h.unsqueeze(0), pre.unsqueeze(0))[0], pre, post, comb


# ------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _mma(acc, a, b, INTERP: tl.constexpr):
    # the interpreter's dot mishandles bf16 operands; fp32 gives the same exact products there
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _pre_partial_kernel(
    h_ptr, fn_ptr, w_ptr, x_ptr, ws_ptr,
    N, D, steps_per_prog,
    stride_hn, stride_hk, stride_wn, stride_xn,
    HC: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    COLLAPSE: tl.constexpr, BF16_SPLIT: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, MP)
    cmask = cols < M
    dd = tl.arange(0, BD)
    K = HC * D

    acc = tl.zeros((BN, MP), dtype=tl.float32)
    sq = tl.zeros((BN, BD), dtype=tl.float32)
    xacc = tl.zeros((BN, BD), dtype=tl.float32)
    if COLLAPSE:  # the rows' collapse weights [BN, HC], loaded once: a load in the loop waited on memory each step
        streams = tl.arange(0, HC)
        w_rows = tl.load(w_ptr + rows64[:, None] * stride_wn + streams[None, :], mask=rmask[:, None], other=0.0)
    # one flat loop over (d step, stream), d-major: one h tile and one fn tile live per iteration (the
    # pipeline keeps num_stages of them in flight), and the hc streams of a d step arrive back to back
    # so the collapse can finish that step's x on its last stream
    t_begin = pid_s * steps_per_prog * HC
    t_end = tl.minimum(t_begin + steps_per_prog * HC, (D // BD) * HC)
    for t in range(t_begin, t_end):
        d0 = (t // HC) * BD
        k = t % HC
        hv = tl.load(h_ptr + rows64[:, None] * stride_hn + k * stride_hk + (d0 + dd)[None, :],
                     mask=rmask[:, None], other=0.0)
        # fn^T tile [BD, MP]: column m is fn[m, k*D + d0 : k*D + d0 + BD]
        fv = tl.trans(tl.load(fn_ptr + cols[:, None].to(tl.int64) * K + (k * D + d0 + dd)[None, :],
                              mask=cmask[:, None], other=0.0))
        h32 = hv.to(tl.float32)
        sq += h32 * h32
        # each step's product is summed into acc by an fp32 add (correctly rounded): tensor cores may
        # truncate in their own accumulation, and the running sum would collect that over all of K
        if BF16_SPLIT:
            f1 = fv.to(tl.bfloat16)
            r1 = fv - f1.to(tl.float32)
            f2 = r1.to(tl.bfloat16)
            f3 = (r1 - f2.to(tl.float32)).to(tl.bfloat16)
            part = _mma(tl.zeros((BN, MP), dtype=tl.float32), hv, f3, INTERP)
            part = _mma(part, hv, f2, INTERP)
            acc += _mma(part, hv, f1, INTERP)
        elif INTERP:
            acc += tl.dot(h32, fv, input_precision="ieee")
        else:
            acc += tl.dot(h32, fv, input_precision="tf32x3")
        if COLLAPSE:
            wk = tl.sum(tl.where(streams[None, :] == k, w_rows, 0.0), axis=1)  # [BN], stream k's weight
            xacc += wk[:, None] * h32
            last = (dd * 0 + k) == HC - 1  # [BD], all true on a step's last stream
            tl.store(x_ptr + rows64[:, None] * stride_xn + (d0 + dd)[None, :], xacc.to(x_ptr.dtype.element_ty),
                     mask=rmask[:, None] & last[None, :])
            xacc = tl.where(last[None, :], 0.0, xacc)
    # workspace [S, N, M + 1]: the M partial mixes, then the partial sum of squares
    ws_row = ws_ptr + (pid_s * N + rows64) * (M + 1)
    tl.store(ws_row[:, None] + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])
    tl.store(ws_row + M, tl.sum(sq, axis=1), mask=rmask)


@triton.jit
def _coefficients(ws_ptr, scale_ptr, base_ptr, rows64, rmask, N, D, n_split, norm_eps, hc_eps, iters,
                  HC: tl.constexpr, M: tl.constexpr, SB: tl.constexpr, ACCURATE: tl.constexpr,
                  THREAD_SINKHORN: tl.constexpr, CACHE: tl.constexpr):
    """The rows' pre [BN, HC], post [BN, HC] and comb [BN, HC, HC] (fp32) from the partial kernel's workspace
    [n_split, N, M + 1]: the splits' mixes and sums of squares summed, rsqrt, split, Sinkhorn. CACHE: the
    workspace loads' cache modifier (`_post_partial_kernel`'s SETTLED reads it from the L2)."""
    BN: tl.constexpr = rows64.shape[0]
    c = tl.arange(0, HC)
    jk = c[:, None] * HC + c[None, :]  # comb[j, k] sits at mixes[2 hc + j hc + k]
    # sums a split lane [SB, ...], added across the loop's steps and over the lanes once after it: a sum over the
    # lanes a step crossed threads (shuffles, shared memory and barriers) in every step
    ss = tl.zeros((SB, BN), dtype=tl.float32)
    pre_raw = tl.zeros((SB, BN, HC), dtype=tl.float32)
    post_raw = tl.zeros((SB, BN, HC), dtype=tl.float32)
    comb_raw = tl.zeros((SB, BN, HC, HC), dtype=tl.float32)
    # the site's scales and biases first: after the loop their round trip would stand between it and the Sinkhorn
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + c)
    b_post = tl.load(base_ptr + HC + c)
    b_comb = tl.load(base_ptr + 2 * HC + jk)
    # SB splits a step, their loads all in flight at once: one split a step waited out an L2 round trip per
    # split (80 of them for one token at V4.1 widths), most of this kernel's time at decode
    sb = tl.arange(0, SB)
    for s0 in tl.range(0, n_split, SB, num_stages=2):
        s = s0 + sb
        row = ws_ptr + (s[:, None] * N + rows64[None, :]) * (M + 1)  # [SB, BN]
        live = (s < n_split)[:, None] & rmask[None, :]
        ss += tl.load(row + M, mask=live, other=0.0, cache_modifier=CACHE)
        pre_raw += tl.load(row[:, :, None] + c[None, None, :], mask=live[:, :, None], other=0.0, cache_modifier=CACHE)
        post_raw += tl.load(row[:, :, None] + HC + c[None, None, :], mask=live[:, :, None], other=0.0,
                            cache_modifier=CACHE)
        comb_raw += tl.load(row[:, :, None, None] + 2 * HC + jk[None, None, :, :], mask=live[:, :, None, None],
                            other=0.0, cache_modifier=CACHE)
    ss = tl.sum(ss, axis=0)
    pre_raw = tl.sum(pre_raw, axis=0)
    post_raw = tl.sum(post_raw, axis=0)
    comb_raw = tl.sum(comb_raw, axis=0)

    rs = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, (HC * D) * 1.0) + norm_eps))

    pre = tl.div_rn(1.0, 1.0 + exp(-((pre_raw * rs[:, None]) * s_pre + b_pre[None, :]), ACCURATE)) + hc_eps
    post = 2.0 * tl.div_rn(1.0, 1.0 + exp(-((post_raw * rs[:, None]) * s_post + b_post[None, :]), ACCURATE))
    comb = (comb_raw * rs[:, None, None]) * s_comb + b_comb[None, :, :]
    comb = exp(comb - tl.max(comb, axis=2)[:, :, None], ACCURATE)
    comb = tl.div_rn(comb, tl.sum(comb, axis=2)[:, :, None]) + hc_eps
    comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    if THREAD_SINKHORN:
        comb = _sinkhorn4_in_threads(comb, jk, hc_eps, iters - 1, ACCURATE)
    else:
        for _ in range(iters - 1):
            comb = tl.div_rn(comb, tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    return pre, post, comb


@triton.jit
def _pre_finish_kernel(
    ws_ptr, scale_ptr, base_ptr, h_ptr, x_ptr, pre_ptr, post_ptr, comb_ptr,
    N, D, n_split, d_per_prog, norm_eps, hc_eps, iters,
    stride_hn, stride_hk, stride_xn,
    HC: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, SB: tl.constexpr,
    COLLAPSE: tl.constexpr, ACCURATE: tl.constexpr, THREAD_SINKHORN: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    c = tl.arange(0, HC)
    r2 = rmask[:, None]
    r3 = rmask[:, None, None]
    jk = c[:, None] * HC + c[None, :]
    dd = tl.arange(0, BD)
    d_begin = pid_d * d_per_prog
    streams = h_ptr + rows64[:, None, None] * stride_hn + c[None, :, None] * stride_hk + dd[None, None, :]
    if COLLAPSE:  # the first d chunk of every stream, loaded before the coefficients: its round trip runs under
        # their chain (the workspace's sums, the Sinkhorn) rather than after it (a decode token's program has one)
        first = tl.load(streams + d_begin, mask=r3, other=0.0)  # [BN, HC, BD]
    pre, post, comb = _coefficients(ws_ptr, scale_ptr, base_ptr, rows64, rmask, N, D, n_split, norm_eps, hc_eps,
                                    iters, HC, M, SB, ACCURATE, THREAD_SINKHORN, "")

    if pid_d == 0:
        tl.store(pre_ptr + rows64[:, None] * HC + c[None, :], pre, mask=r2)
        tl.store(post_ptr + rows64[:, None] * HC + c[None, :], post, mask=r2)
        tl.store(comb_ptr + rows64[:, None, None] * (HC * HC) + jk[None, :, :], comb, mask=r3)

    if COLLAPSE:
        x_rows = x_ptr + rows64[:, None] * stride_xn + dd[None, :]
        _store_collapsed(x_rows + d_begin, first, pre, r2, HC)
        for d0 in range(d_begin + BD, tl.minimum(d_begin + d_per_prog, D), BD):
            _store_collapsed(x_rows + d0, tl.load(streams + d0, mask=r3, other=0.0), pre, r2, HC)


@triton.jit
def _store_collapsed(x_tile, h, pre, r2, HC: tl.constexpr):
    """x = sum over the streams k of pre[:, k] h[:, k], in stream order in fp32, of a d chunk h [BN, HC, BD],
    stored at x_tile [BN, BD] (rows masked by r2)."""
    c = tl.arange(0, HC)
    xacc = tl.zeros((h.shape[0], h.shape[2]), dtype=tl.float32)
    for k in tl.static_range(HC):
        wk = tl.sum(tl.where(c[None, :] == k, pre, 0.0), axis=1)  # [BN]
        hk = tl.sum(tl.where(c[None, :, None] == k, h.to(tl.float32), 0.0), axis=1)  # [BN, BD]: stream k, exact
        xacc += wk[:, None] * hk
    tl.store(x_tile, xacc.to(x_tile.dtype.element_ty), mask=r2)


@triton.jit
def _normalized4(a, b, c, d, eps, ACCURATE: tl.constexpr):
    """(a, b, c, d) / ((a + c) + (b + d) + eps), correctly rounded: the sum in the order of tl.sum over 4 lanes.

    On the GPU the four quotients share one refined reciprocal of the sum and each takes the hardware division's
    own correction (q = x r, then q + (x - s q) r: the `div.rn.f32` fast path, which its `FCHK` leaves only for
    operands near the ends of the exponent range; Sinkhorn's are in (0, 1] over sums in [1e-6, 5))."""
    s = (a + c) + (b + d) + eps
    if ACCURATE:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [s], dtype=tl.float32, is_pure=True,
                                      pack=1)
        r = tl.fma(tl.fma(-s, r, 1.0), r, r)
        return _corrected(a, s, r), _corrected(b, s, r), _corrected(c, s, r), _corrected(d, s, r)
    else:
        return tl.div_rn(a, s), tl.div_rn(b, s), tl.div_rn(c, s), tl.div_rn(d, s)


@triton.jit
def _corrected(x, s, r):
    """x / s from r ~ 1/s: the quotient x r and one residual step (both as `div.rn.f32`'s fast path computes)."""
    q = x * r
    return tl.fma(tl.fma(-s, q, x), r, q)


@triton.jit
def _entry(comb, jk, idx: tl.constexpr):
    """comb[:, j, k] for idx = 4 j + k, as a [BN] tensor."""
    return tl.sum(tl.sum(tl.where(jk[None, :, :] == idx, comb, 0.0), axis=2), axis=1)


@triton.jit
def _sinkhorn4_in_threads(comb, jk, eps, steps, ACCURATE: tl.constexpr):
    """`steps` Sinkhorn steps (rows, then columns) of comb [BN, 4, 4], each the IEEE step of its sums (the lane
    form's butterfly order, tested bit for bit against torch), with each token's 16 entries held by every thread
    as [BN] tensors: no shuffles in the loop, where the lane form's chain is a shuffle reduction and a division an
    entry a lane (0.28 us a step on the H200)."""
    c00, c01, c02, c03 = _entry(comb, jk, 0), _entry(comb, jk, 1), _entry(comb, jk, 2), _entry(comb, jk, 3)
    c10, c11, c12, c13 = _entry(comb, jk, 4), _entry(comb, jk, 5), _entry(comb, jk, 6), _entry(comb, jk, 7)
    c20, c21, c22, c23 = _entry(comb, jk, 8), _entry(comb, jk, 9), _entry(comb, jk, 10), _entry(comb, jk, 11)
    c30, c31, c32, c33 = _entry(comb, jk, 12), _entry(comb, jk, 13), _entry(comb, jk, 14), _entry(comb, jk, 15)
    for _ in range(steps):
        c00, c01, c02, c03 = _normalized4(c00, c01, c02, c03, eps, ACCURATE)
        c10, c11, c12, c13 = _normalized4(c10, c11, c12, c13, eps, ACCURATE)
        c20, c21, c22, c23 = _normalized4(c20, c21, c22, c23, eps, ACCURATE)
        c30, c31, c32, c33 = _normalized4(c30, c31, c32, c33, eps, ACCURATE)
        c00, c10, c20, c30 = _normalized4(c00, c10, c20, c30, eps, ACCURATE)
        c01, c11, c21, c31 = _normalized4(c01, c11, c21, c31, eps, ACCURATE)
        c02, c12, c22, c32 = _normalized4(c02, c12, c22, c32, eps, ACCURATE)
        c03, c13, c23, c33 = _normalized4(c03, c13, c23, c33, eps, ACCURATE)
    comb = _placed_row(comb, jk, 0, c00, c01, c02, c03)
    comb = _placed_row(comb, jk, 1, c10, c11, c12, c13)
    comb = _placed_row(comb, jk, 2, c20, c21, c22, c23)
    return _placed_row(comb, jk, 3, c30, c31, c32, c33)


@triton.jit
def _placed_row(comb, jk, j: tl.constexpr, a, b, c, d):
    """comb with row j set to the [BN] tensors (a, b, c, d)."""
    at = jk[None, :, :]
    comb = tl.where(at == 4 * j, a[:, None, None], comb)
    comb = tl.where(at == 4 * j + 1, b[:, None, None], comb)
    comb = tl.where(at == 4 * j + 2, c[:, None, None], comb)
    return tl.where(at == 4 * j + 3, d[:, None, None], comb)


@triton.jit
def _streams_tile(res_ptr, rows64, rmask, pid_d, D, stride_rn, stride_rk, HC: tl.constexpr, BD: tl.constexpr,
                  CACHE: tl.constexpr):
    """The program's d tile of the residual streams [BN, HC, BD], fp32 (CACHE: the loads' cache modifier). The
    kernels that finish coefficients load it first, so this round trip runs under the partial sums and the
    Sinkhorn chain rather than after it."""
    c = tl.arange(0, HC)
    dd = pid_d * BD + tl.arange(0, BD)
    m2 = rmask[:, None] & (dd < D)[None, :]
    return tl.load(res_ptr + rows64[:, None, None] * stride_rn + c[None, :, None] * stride_rk + dd[None, None, :],
                   mask=m2[:, None, :], other=0.0, cache_modifier=CACHE).to(tl.float32)


@triton.jit
def _sublayer_tile(f_ptr, res_ptr, rows64, rmask, pid_d, D, stride_fn, stride_fs, BD: tl.constexpr,
                   SLOTS: tl.constexpr, INTERP: tl.constexpr):
    """The program's d tile of the sub-layer's output f [BN, BD], fp32. SLOTS (> 0): f is the MoE's slots [N, SLOTS,
    D] fp32 (slot stride stride_fs), summed in slot order and rounded to the streams' dtype (`summed_slots`)."""
    dd = pid_d * BD + tl.arange(0, BD)
    m2 = rmask[:, None] & (dd < D)[None, :]
    f_tile = f_ptr + rows64[:, None] * stride_fn + dd[None, :]
    fv = tl.load(f_tile, mask=m2, other=0.0).to(tl.float32)
    if SLOTS:
        for slot in tl.static_range(1, SLOTS):
            fv += tl.load(f_tile + slot * stride_fs, mask=m2, other=0.0)
        if res_ptr.dtype.element_ty == tl.bfloat16:
            fv = to_bf16(fv, INTERP).to(tl.float32)
    return fv


@triton.jit
def _expand(fv, res, out_ptr, post, comb, rows64, rmask, pid_d, D, stride_on, stride_ok, HC: tl.constexpr,
            BD: tl.constexpr, INTERP: tl.constexpr):
    """The program's d tile of h'_k = post_k f + sum_j comb[j, k] residual_j in fp32 (j in order), stored in the
    output's dtype and returned as stored ([BN, HC, BD]); fv, res from `_post_inputs`, post [BN, HC] and comb
    [BN, HC, HC] fp32 in registers."""
    c = tl.arange(0, HC)
    dd = pid_d * BD + tl.arange(0, BD)
    m2 = rmask[:, None] & (dd < D)[None, :]
    mixed = tl.zeros((rows64.shape[0], HC, BD), dtype=tl.float32)
    for j in tl.static_range(HC):
        cj = tl.sum(tl.where(c[None, :, None] == j, comb, 0.0), axis=1)  # [BN, HC]: comb[:, j, :]
        rj = tl.sum(tl.where(c[None, :, None] == j, res, 0.0), axis=1)  # [BN, BD]: stream j (exact: one term)
        mixed += cj[:, :, None] * rj[:, None, :]
    out = post[:, :, None] * fv[:, None, :] + mixed
    optr = out_ptr + rows64[:, None, None] * stride_on + c[None, :, None] * stride_ok + dd[None, None, :]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        out = to_bf16(out, INTERP)  # to nearest (the interpreter's cast truncates)
    else:
        out = out.to(out_ptr.dtype.element_ty)
    tl.store(optr, out, mask=m2[:, None, :])
    return out


@triton.jit
def _post_kernel(
    f_ptr, res_ptr, post_ptr, comb_ptr, out_ptr,
    N, D,
    stride_fn, stride_rn, stride_rk, stride_on, stride_ok,
    HC: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_predecessor(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    c = tl.arange(0, HC)
    jk = c[:, None] * HC + c[None, :]
    post = tl.load(post_ptr + rows64[:, None] * HC + c[None, :], mask=rmask[:, None], other=0.0)
    comb = tl.load(comb_ptr + rows64[:, None, None] * (HC * HC) + jk[None, :, :], mask=rmask[:, None, None], other=0.0)
    res = _streams_tile(res_ptr, rows64, rmask, tl.program_id(1), D, stride_rn, stride_rk, HC, BD, "")
    fv = _sublayer_tile(f_ptr, res_ptr, rows64, rmask, tl.program_id(1), D, stride_fn, 0, BD, 0, INTERP)
    _expand(fv, res, out_ptr, post, comb, rows64, rmask, tl.program_id(1), D, stride_on, stride_ok, HC, BD, INTERP)


@triton.jit
def _post_finish_kernel(
    f_ptr, res_ptr, ws_ptr, scale_ptr, base_ptr, out_ptr, pre_ptr,
    N, D, n_split, norm_eps, hc_eps, iters,
    stride_fn, stride_fs, stride_rn, stride_rk, stride_on, stride_ok,
    HC: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, SB: tl.constexpr, SLOTS: tl.constexpr,
    ACCURATE: tl.constexpr, THREAD_SINKHORN: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
    SETTLED: tl.constexpr,
):
    """mhc_post with the site's coefficients finished here from the partial kernel's workspace (what the finish
    kernel did): every program of a row finishes them, the first of its d tiles stores pre. SLOTS and SETTLED as
    `_post_partial_kernel`'s."""
    if not SETTLED:
        wait_for_predecessor(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    fv, res, pre, post, comb = _post_inputs(
        f_ptr, res_ptr, ws_ptr, scale_ptr, base_ptr, ws_ptr, ws_ptr, rows64, rmask, tl.program_id(1), N, D, n_split,
        norm_eps, hc_eps, iters, stride_fn, stride_fs, stride_rn, stride_rk, HC, M, BD, SB, True, SLOTS, ACCURATE,
        THREAD_SINKHORN, INTERP, PDL, SETTLED)
    if tl.program_id(1) == 0:
        c = tl.arange(0, HC)
        tl.store(pre_ptr + rows64[:, None] * HC + c[None, :], pre, mask=rmask[:, None])
    _expand(fv, res, out_ptr, post, comb, rows64, rmask, tl.program_id(1), D, stride_on, stride_ok, HC, BD, INTERP)


@triton.jit
def _site_coefficients(ws_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, rows64, rmask, N, D, n_split, norm_eps,
                       hc_eps, iters, HC: tl.constexpr, M: tl.constexpr, SB: tl.constexpr, FINISH: tl.constexpr,
                       ACCURATE: tl.constexpr, THREAD_SINKHORN: tl.constexpr, CACHE: tl.constexpr):
    """A post's (pre, post, comb): FINISH, finished from the site's workspace (`_coefficients`); else post and comb
    as given (pre unused: post's stands in)."""
    if FINISH:
        return _coefficients(ws_ptr, scale_ptr, base_ptr, rows64, rmask, N, D, n_split, norm_eps, hc_eps, iters, HC,
                             M, SB, ACCURATE, THREAD_SINKHORN, CACHE)
    c = tl.arange(0, HC)
    jk = c[:, None] * HC + c[None, :]
    post = tl.load(post_ptr + rows64[:, None] * HC + c[None, :], mask=rmask[:, None], other=0.0, cache_modifier=CACHE)
    comb = tl.load(comb_ptr + rows64[:, None, None] * (HC * HC) + jk[None, :, :], mask=rmask[:, None, None],
                   other=0.0, cache_modifier=CACHE)
    return post, post, comb


@triton.jit
def _post_inputs(f_ptr, res_ptr, ws_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, rows64, rmask, pid_d, N, D, n_split,
                 norm_eps, hc_eps, iters, stride_fn, stride_fs, stride_rn, stride_rk, HC: tl.constexpr,
                 M: tl.constexpr, BD: tl.constexpr, SB: tl.constexpr, FINISH: tl.constexpr, SLOTS: tl.constexpr,
                 ACCURATE: tl.constexpr, THREAD_SINKHORN: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr,
                 SETTLED: tl.constexpr):
    """A post program's inputs: its tiles of f and the streams, and the site's (pre, post, comb)
    (`_site_coefficients`). The kernel has waited for its predecessor before this, or with SETTLED (everything but
    f written before the kernel it follows) not yet: then the streams and the coefficients' chain run before the
    wait, beside the predecessor's tail, and only f's load follows it; else f's round trip runs under the chain."""
    CACHE: tl.constexpr = ".cg" if SETTLED else ""  # before the wait an SM's L1 may hold an older layer's lines
    res = _streams_tile(res_ptr, rows64, rmask, pid_d, D, stride_rn, stride_rk, HC, BD, CACHE)
    if not SETTLED:
        fv = _sublayer_tile(f_ptr, res_ptr, rows64, rmask, pid_d, D, stride_fn, stride_fs, BD, SLOTS, INTERP)
    pre, post, comb = _site_coefficients(ws_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, rows64, rmask, N, D, n_split,
                                         norm_eps, hc_eps, iters, HC, M, SB, FINISH, ACCURATE, THREAD_SINKHORN, CACHE)
    if SETTLED:
        wait_for_predecessor(PDL)
        fv = _sublayer_tile(f_ptr, res_ptr, rows64, rmask, pid_d, D, stride_fn, stride_fs, BD, SLOTS, INTERP)
    return fv, res, pre, post, comb


@triton.jit
def _post_partial_kernel(
    f_ptr, res_ptr, ws_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, fn_ptr, out_ptr, x_ptr, ws_next_ptr, xsq_ptr,
    N, D, n_split, norm_eps, hc_eps, iters,
    stride_fn, stride_fs, stride_rn, stride_rk, stride_on, stride_ok, stride_xn,
    HC: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, BD: tl.constexpr, SB: tl.constexpr, FINISH: tl.constexpr,
    SLOTS: tl.constexpr, ACCURATE: tl.constexpr, THREAD_SINKHORN: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr, SETTLED: tl.constexpr, SQUARES: tl.constexpr, START: tl.constexpr,
):
    """Program (row, d step): a site's post, then the next site's partial pass over the new streams' d step while they
    are in registers (as `_pre_partial_kernel`, its projection in fp32 on the CUDA cores: one row). FINISH (V4.1):
    the post's coefficients finished from this site's workspace ws (as `_post_finish_kernel`) and x collapsed with
    this site's pre, with SQUARES the sum of its d step's squares (as stored) to xsq [N, programs]; else (V4) post
    and comb as given and no x (the next site collapses with its own pre, which its finish makes). SLOTS: f is the
    MoE's slots (`_sublayer_tile`). SETTLED: everything but f was written before the kernel this one follows, so all
    of it, and the coefficients' chain, comes before the PDL wait, beside that kernel's tail; only f waits
    (`mhc_post_partial`'s settled). START: the next kernel starts once this one's programs have waited
    (`mhc_post_partial`'s start_next)."""
    if not SETTLED:
        wait_for_predecessor(PDL)
    rows64 = (tl.program_id(0) + tl.arange(0, 1)).to(tl.int64)  # [1]: one row (the Sinkhorn in threads, at hc 4)
    rmask = rows64 < N
    pid_s = tl.program_id(1)
    c = tl.arange(0, HC)
    cols = tl.arange(0, MP)
    dd = pid_s * BD + tl.arange(0, BD)
    # fn's columns of every stream's d step [HC, MP, BD], loaded first, as the expand's inputs: a weight,
    # so nothing waits for it, and a load a stream after the Sinkhorn chain put four DRAM round trips in series
    fn = tl.load(fn_ptr + cols[None, :, None].to(tl.int64) * (HC * D) + (c[:, None, None] * D + dd[None, None, :]),
                 mask=(cols < M)[None, :, None], other=0.0)
    fv, res, pre, post, comb = _post_inputs(
        f_ptr, res_ptr, ws_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, rows64, rmask, pid_s, N, D, n_split, norm_eps,
        hc_eps, iters, stride_fn, stride_fs, stride_rn, stride_rk, HC, M, BD, SB, FINISH, SLOTS, ACCURATE,
        THREAD_SINKHORN, INTERP, PDL, SETTLED)
    start_successor(START)
    h = _expand(fv, res, out_ptr, post, comb, rows64, rmask, pid_s, D, stride_on, stride_ok, HC, BD,
                INTERP).to(tl.float32)  # [1, HC, BD], as stored
    # the next site's partial mixes and this row's x, each one reduction over the streams: summed stream by stream
    # in order (each stream picked out by a masked sum first), the kernel ran ~700 more instructions a thread
    acc = tl.sum(tl.sum(tl.reshape(h, (HC, BD))[:, None, :] * fn, axis=2), axis=0)[None, :]  # [1, MP]
    if FINISH:
        x = tl.sum(pre[:, :, None] * h, axis=1)  # [1, BD]: collapsed with this site's pre
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + rows64[:, None] * stride_xn + dd[None, :], x, mask=rmask[:, None])
        if SQUARES:
            x = x.to(tl.float32)
            tl.store(xsq_ptr + rows64 * tl.num_programs(1) + pid_s, tl.sum(x * x, axis=1), mask=rmask)
    ws_row = ws_next_ptr + (pid_s * N + rows64) * (M + 1)
    tl.store(ws_row[:, None] + cols[None, :], acc, mask=rmask[:, None] & (cols < M)[None, :])
    tl.store(ws_row + M, tl.sum(tl.sum(h * h, axis=2), axis=1), mask=rmask)


# ------------------------------------------------------------------------------------------------
# Launch configuration


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs_target(t: torch.Tensor) -> int:
    # about two programs per multiprocessor; the interpreter runs programs one by one, so few there
    return 2 * _num_sms(t.device.index or 0) if t.is_cuda else 2


def _pow2_block(D: int, cap: int) -> int:
    """cap rounded up to a power of two, halved while it does not divide D (not below 16). Plain Python:
    `partial_splits` serves the twins too, which run where Triton is not installed."""
    b = 1 << max(0, cap - 1).bit_length()
    while b > 16 and D % b:
        b //= 2
    return b


def pre_config(N: int, D: int, hc: int, elt: int, target: int, cfg: dict | None = None) -> dict:
    """Tiles of mhc_pre's first kernel: BN tokens a program (the MMA's M, >= 16), BD columns of d a step,
    `split` programs along D each doing `per` steps, and warps / pipeline stages. `cfg` overrides any.

    Big token counts use a big BN so the fn slice a program holds serves more tokens (fn is re-read from
    L2 once per token block); small ones split D until about `target` programs are busy. A pipeline
    stage holds one h tile and one fn tile; stages are capped to keep within ~160 KB of shared memory.
    """
    cfg = cfg or {}
    BN = cfg.get("BN") or (16 if N <= 16 else 32 if N <= 32 else 64 if N <= 1024 else 128)
    # defaults that compile without register spills for sm_90 (ptxas -v, Triton 3.9)
    BD = _pow2_block(D, cfg.get("BD") or (32 if BN >= 128 or elt > 2 else 64))  # a power of two >= 16 dividing D
    MP = max(16, triton.next_power_of_2((2 + hc) * hc))
    nb = triton.cdiv(N, BN)
    steps = D // BD
    split = cfg.get("split") or max(1, min(steps, triton.cdiv(target, nb)))
    per = triton.cdiv(steps, split)
    stage_bytes = BN * BD * elt + BD * MP * 4
    return {
        "BN": BN, "BD": BD, "MP": MP, "split": triton.cdiv(steps, per), "per": per,
        "num_warps": cfg.get("num_warps") or (4 if BN <= 16 else 8),
        "num_stages": cfg.get("num_stages") or max(1, min(4, (160 * 1024) // stage_bytes)),
    }


# rows up to which mhc_post_partial runs as one kernel: each of a row's programs (D / 64 of them) finishes the row's
# coefficients, a Sinkhorn chain in every thread, so past a few rows that redundant work outgrows the launch it
# saves (4 rows, 2 warps: ~2M warp instructions); more rows take the post and the partial pass apart
POST_PARTIAL_MAX_N = 4


def post_partial_warps(N: int) -> int:
    """mhc_post_partial's warps: at one token 4 (8.2 us against 8.9 at 2 and 11.5 at 8, V4.1's decode pair on the
    H100, `bench/mhc.py --sweep`, session 42), at 4 tokens 2 (11.9 against 13.2 at 4)."""
    return 4 if N == 1 else 2


def partial_splits(D: int, elt: int) -> int:
    """The D splits of `mhc_pre_partial`'s workspace: one d step of pre_config's (BD at few tokens) a program, so the
    count depends on D and the element size alone and the op's fake knows its shape."""
    return D // _pow2_block(D, 32 if elt > 2 else 64)


def sinkhorn_in_threads(hc: int, BN: int) -> bool:
    """Whether the finish runs its Sinkhorn steps in threads (`_sinkhorn4_in_threads`): 4 x 4 matrices, one token
    a program."""
    return hc == 4 and BN == 1


def finish_config(N: int, D: int, split: int, collapse_now: bool, target: int, cfg: dict | None = None) -> dict:
    """Tiles of mhc_pre's second kernel: BN tokens a program, BD columns a collapse step, `chunks` programs along D
    of `d_per` columns each (one when the first kernel collapsed), SB of the `split` partials summed a step, and
    warps. `cfg` (BN2, SB, finish_warps) overrides."""
    cfg = cfg or {}
    # the Sinkhorn loop is a chain of tiny reductions: at decode sizes one warp per token keeps them in warp
    # shuffles (H200, N = 1..64: 20 us against 30-38 us for 16 tokens on 4 warps)
    small = N <= 256
    BN = cfg.get("BN2", 1 if small else 16)
    BD = _pow2_block(D, 64)  # wider tiles cost registers (255 at 128 columns) without fewer bytes
    chunks = 1 if collapse_now else max(1, min(D // BD, triton.cdiv(target, triton.cdiv(N, BN))))
    d_per = triton.cdiv(D // BD, chunks) * BD
    return {"BN": BN, "BD": BD, "chunks": triton.cdiv(D, d_per), "d_per": d_per,
            "SB": cfg.get("SB") or min(triton.next_power_of_2(split), 32 if small else 8),
            "num_warps": cfg.get("finish_warps", 1 if small else 4)}


def post_config(N: int, D: int, cfg: dict | None = None) -> dict:
    """Tiles of mhc_post's kernel: BN tokens and BD columns a program, warps. `cfg` overrides any."""
    cfg = cfg or {}
    # 1024 bf16 columns: 16-byte accesses with 4 warps; fewer columns for few tokens, so more programs run
    return {"BN": cfg.get("BN", 1), "BD": cfg.get("BD", min(1024 if N >= 64 else 256, triton.next_power_of_2(D))),
            "num_warps": cfg.get("num_warps", 4)}


def _hc_supported(hc: int, D: int) -> bool:
    return hc >= 2 and hc & (hc - 1) == 0 and D % 16 == 0


# ------------------------------------------------------------------------------------------------
# Ops


def mhc_pre_triton(h, fn, scale, base, collapse_pre, norm_eps, hc_eps, iters, cfg: dict | None = None):
    """The Triton path of mhc_pre; `cfg` (BN, BD, split, target, num_warps, num_stages, BN2, finish_warps, SB)
    overrides the tiles (`target`: the program count the D split aims at; SB: the splits the second kernel sums a
    step)."""
    cfg = cfg or {}
    h = h.contiguous()
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    N, hc, D = h.shape
    target = cfg.get("target") or _programs_target(h)
    c = pre_config(N, D, hc, h.element_size(), target, cfg)
    outs = _pre_outputs(h)
    if N == 0:
        return outs
    collapse_now = collapse_pre is not None
    x, pre = outs[:2]
    ws = _partials(h, fn, collapse_pre.float().contiguous() if collapse_now else pre, x, c, collapse_now)
    _finish(h, ws, scale, base, outs, norm_eps, hc_eps, iters, not collapse_now, target, cfg)
    return outs


def _pre_outputs(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pre pass's outputs for h [N, hc, D]: x [N, D] in h's dtype, pre and post [N, hc], comb [N, hc, hc] fp32."""
    N, hc, D = h.shape
    pre = torch.empty(N, hc, dtype=torch.float32, device=h.device)
    return (torch.empty(N, D, dtype=h.dtype, device=h.device), pre, torch.empty_like(pre),
            torch.empty(N, hc, hc, dtype=torch.float32, device=h.device))


def _finish(h, ws, scale, base, outs: tuple, norm_eps, hc_eps, iters, collapse: bool, target: int,
            cfg: dict | None):
    """`_pre_finish_kernel` on the workspace ws [split, N, M + 1] of h [N, hc, D] (contiguous; scale and base fp32)
    into outs (`_pre_outputs`); with `collapse` it collapses x with the pre it makes (h read again)."""
    x, pre, post, comb = outs
    N, hc, D = h.shape
    split = ws.shape[0]
    f = finish_config(N, D, split, not collapse, target, cfg)
    _pre_finish_kernel[(triton.cdiv(N, f["BN"]), f["chunks"])](
        ws, scale, base, h, x, pre, post, comb,
        N, D, split, f["d_per"], norm_eps, hc_eps, iters,
        h.stride(0), h.stride(1), x.stride(0),
        HC=hc, M=(2 + hc) * hc, BN=f["BN"], BD=f["BD"], SB=f["SB"],
        COLLAPSE=collapse, ACCURATE=h.is_cuda, THREAD_SINKHORN=sinkhorn_in_threads(hc, f["BN"]), PDL=pdl(h),
        num_warps=f["num_warps"], launch_pdl=pdl(h),
    )


def _partials(h, fn, w, x, c: dict, collapse: bool) -> torch.Tensor:
    """`_pre_partial_kernel` on h [N, hc, D] (contiguous) and fn (fp32, contiguous) at tiles c (`pre_config`): the
    workspace [split, N, M + 1]; with `collapse`, x [N, D] too, collapsed with the weights w [N, hc]."""
    N, hc, D = h.shape
    M = (2 + hc) * hc
    ws = torch.empty(c["split"], N, M + 1, dtype=torch.float32, device=h.device)
    launch = functools.partial(
        _pre_partial_kernel[(triton.cdiv(N, c["BN"]), c["split"])],
        h, fn, w, x, ws,
        N, D, c["per"],
        h.stride(0), h.stride(1), w.stride(0), x.stride(0),
        HC=hc, M=M, MP=c["MP"], BN=c["BN"], BD=c["BD"],
        COLLAPSE=collapse, BF16_SPLIT=h.dtype == torch.bfloat16, INTERP=not h.is_cuda, PDL=pdl(h),
        num_warps=c["num_warps"], launch_pdl=pdl(h),
    )
    try:
        launch(num_stages=c["num_stages"])
    except triton.runtime.errors.OutOfResources:  # a tile the shared-memory estimate let through
        launch(num_stages=1)
    return ws


def mhc_pre_partial_triton(h, fn, collapse_pre):
    """The Triton path of mhc_pre_partial; collapse_pre None: the workspace alone (x is left empty)."""
    h, fn = h.contiguous(), fn.float().contiguous()
    N, hc, D = h.shape
    x = torch.empty(N, D, dtype=h.dtype, device=h.device)
    S = partial_splits(D, h.element_size())
    if N == 0:
        return x, torch.empty(S, 0, (2 + hc) * hc + 1, dtype=torch.float32, device=h.device)
    c = pre_config(N, D, hc, h.element_size(), _programs_target(h), {"BD": D // S, "split": S})
    collapse = collapse_pre is not None
    w = collapse_pre.float().contiguous() if collapse else torch.empty(N, hc, dtype=torch.float32, device=h.device)
    return x, _partials(h, fn, w, x, c, collapse)


def mhc_pre_finish_triton(h, ws, scale, base, norm_eps, hc_eps, iters):
    h, ws = h.contiguous(), ws.contiguous()
    scale, base = scale.float().contiguous(), base.float().contiguous()
    outs = _pre_outputs(h)
    if h.shape[0]:
        _finish(h, ws, scale, base, outs, norm_eps, hc_eps, iters, True, _programs_target(h), None)
    return outs


def mhc_post_finish_triton(f, residual, ws, scale, base, norm_eps, hc_eps, iters, settled: bool = False,
                           cfg: dict | None = None):
    (residual, ws, scale, base), settled = _as_read((residual, ws, scale, base), settled)
    f = f.contiguous()
    N, hc, D = residual.shape
    out = torch.empty(N, hc, D, dtype=_output_dtype(f, residual), device=f.device)
    pre = torch.empty(N, hc, dtype=torch.float32, device=f.device)
    if N == 0:
        return out, pre
    c = post_config(N, D, cfg)
    split = ws.shape[0]
    slots, stride_fs = _slots(f)
    _post_finish_kernel[(triton.cdiv(N, c["BN"]), triton.cdiv(D, c["BD"]))](
        f, residual, ws, scale, base, out, pre,
        N, D, split, norm_eps, hc_eps, iters,
        f.stride(0), stride_fs, residual.stride(0), residual.stride(1), out.stride(0), out.stride(1),
        HC=hc, M=(2 + hc) * hc, BN=c["BN"], BD=c["BD"], SB=min(triton.next_power_of_2(split), 32), SLOTS=slots,
        ACCURATE=f.is_cuda, THREAD_SINKHORN=sinkhorn_in_threads(hc, c["BN"]), INTERP=not f.is_cuda, PDL=pdl(f),
        SETTLED=settled, num_warps=c["num_warps"], launch_pdl=pdl(f),
    )
    return out, pre


def _slots(f: torch.Tensor) -> tuple[int, int]:
    """(slots, slot stride) of a post's f: the MoE's slots [N, S, D], or (0, 0) for a plain [N, D]."""
    return (f.shape[1], f.stride(1)) if f.dim() == 3 else (0, 0)


def _as_read(given: tuple, settled: bool) -> tuple[tuple, bool]:
    """A post's residual streams (first, in their dtype) and coefficient inputs (fp32) as its kernel reads them, and
    whether it may still read them before its PDL wait (`settled`): not where one had to be copied here first (the
    copy is then the kernel just before it)."""
    read = (given[0].contiguous(), *(t.float().contiguous() for t in given[1:]))
    return read, settled and all(a is b for a, b in zip(given, read))


def mhc_post_partial_triton(f, residual, ws, scale, base, fn_next, norm_eps, hc_eps, iters, settled: bool = False,
                            squares: bool = False, start_next: bool = False, cfg: dict | None = None):
    """The Triton path of mhc_post_partial; `cfg` (num_warps) overrides the launch's warps (`post_partial_warps`)."""
    if residual.shape[0] > POST_PARTIAL_MAX_N:
        out, pre = mhc_post_finish_triton(f, residual, ws, scale, base, norm_eps, hc_eps, iters, settled)
        x, ws_next = mhc_pre_partial_triton(out, fn_next, pre)
        return out, x, ws_next, squares_by_step(x, squares)
    return _post_partial(f, residual, fn_next, (ws, scale, base, ws, ws), (norm_eps, hc_eps, iters), True, settled,
                         cfg, squares, start_next)


def mhc_post_sums_triton(f, residual, post, comb, fn_next, settled: bool = False, cfg: dict | None = None):
    """The Triton path of mhc_post_sums; `cfg` as mhc_post_partial_triton's."""
    if residual.shape[0] > POST_PARTIAL_MAX_N:
        out = mhc_post_triton(summed_slots(f, residual.dtype), residual, post, comb)
        return out, mhc_pre_partial_triton(out, fn_next, None)[1]
    out, _, ws_next, _ = _post_partial(f, residual, fn_next, (post, post, post, post, comb), (0.0, 0.0, 0), False,
                                       settled, cfg, False, False)
    return out, ws_next


def _post_partial(f, residual, fn_next, coefficients: tuple, finish_args: tuple, finish: bool, settled: bool,
                  cfg: dict | None, squares: bool, start_next: bool):
    """`_post_partial_kernel` -> (h', x, the next site's workspace, x's squares by d step: [N, 0] unless `squares`,
    which asks a finishing pass for them); coefficients: (ws, scale,
    base, post, comb) as the kernel takes them (FINISH reads the first three, else the last two; the others stand in
    for the pointers), finish_args (norm_eps, hc_eps, iters). settled (`mhc_post_partial`): read before the PDL wait
    all but f, unless one of them had to be copied here first (the copy would be the kernel it follows); with
    start_next too, start the next kernel once waited (`_post_partial_kernel`'s START)."""
    (residual, fn_next, *coefficients), settled = _as_read((residual, fn_next, *coefficients), settled)
    f = f.contiguous()
    N, hc, D = residual.shape
    M = (2 + hc) * hc
    dtype = _output_dtype(f, residual)
    S = partial_splits(D, dtype.itemsize)
    out = torch.empty(N, hc, D, dtype=dtype, device=f.device)
    x = torch.empty(N, D, dtype=dtype, device=f.device)
    ws_next = torch.empty(S, N, M + 1, dtype=torch.float32, device=f.device)
    xsq = torch.empty(N, S if squares else 0, dtype=torch.float32, device=f.device)
    if N == 0:
        return out, x, ws_next, xsq
    split = coefficients[0].shape[0] if finish else 1  # without a finish no splits are read: one compile for all N
    slots, stride_fs = _slots(f)
    _post_partial_kernel[(N, S)](
        f, residual, *coefficients, fn_next, out, x, ws_next, xsq,
        N, D, split, *finish_args,
        f.stride(0), stride_fs, residual.stride(0), residual.stride(1), out.stride(0), out.stride(1), x.stride(0),
        HC=hc, M=M, MP=triton.next_power_of_2(M), BD=D // S, SB=min(triton.next_power_of_2(split), 32),
        FINISH=finish, SLOTS=slots, ACCURATE=f.is_cuda, THREAD_SINKHORN=sinkhorn_in_threads(hc, 1),
        INTERP=not f.is_cuda, PDL=pdl(f), SETTLED=settled, SQUARES=squares, START=settled and start_next and pdl(f),
        num_warps=(cfg or {}).get("num_warps", post_partial_warps(N)), launch_pdl=pdl(f),
    )
    return out, x, ws_next, xsq


def mhc_post_triton(f, residual, post, comb, cfg: dict | None = None):
    cfg = cfg or {}
    f, residual = f.contiguous(), residual.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    N, hc, D = residual.shape
    out = torch.empty(N, hc, D, dtype=f.dtype, device=f.device)
    if N == 0:
        return out
    c = post_config(N, D, cfg)
    _post_kernel[(triton.cdiv(N, c["BN"]), triton.cdiv(D, c["BD"]))](
        f, residual, post, comb, out,
        N, D,
        f.stride(0), residual.stride(0), residual.stride(1), out.stride(0), out.stride(1),
        HC=hc, BN=c["BN"], BD=c["BD"], INTERP=not f.is_cuda, PDL=pdl(f), num_warps=c["num_warps"], launch_pdl=pdl(f),
    )
    return out


@torch.library.custom_op("dsv4::mhc_pre", mutates_args=())
def mhc_pre(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    collapse_pre: torch.Tensor | None,
    norm_eps: float,
    hc_eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused mHC pre-site pass: h [N, hc, D] -> x [N, D], pre [N, hc], post [N, hc], comb [N, hc, hc]."""
    if use_triton(h) and _hc_supported(h.shape[1], h.shape[2]):
        return mhc_pre_triton(h, fn, scale, base, collapse_pre, norm_eps, hc_eps, iters)
    x, pre, post, comb = mhc_pre_twin(h, fn, scale, base, collapse_pre, norm_eps, hc_eps, iters)
    return x.contiguous(), pre.contiguous(), post.contiguous(), comb.contiguous()


@mhc_pre.register_fake
def _(h, fn, scale, base, collapse_pre, norm_eps, hc_eps, iters):
    return _fake_pre(h)


def _fake_pre(h: torch.Tensor):
    """A pre pass's outputs for h [N, hc, D] (as `_pre_outputs` makes them)."""
    N, hc, D = h.shape
    f32 = torch.float32
    return h.new_empty(N, D), h.new_empty(N, hc, dtype=f32), h.new_empty(N, hc, dtype=f32), h.new_empty(N, hc, hc, dtype=f32)


@torch.library.custom_op("dsv4::mhc_post", mutates_args=())
def mhc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC expand: h'_k = post_k f + sum_j comb[j, k] residual_j; [N, D], [N, hc, D] -> [N, hc, D]."""
    if use_triton(f) and _hc_supported(residual.shape[1], 16):
        return mhc_post_triton(f, residual, post, comb)
    return mhc_post_twin(f, residual, post, comb).contiguous()


@mhc_post.register_fake
def _(f, residual, post, comb):
    return residual.new_empty(residual.shape, dtype=f.dtype)


@torch.library.custom_op("dsv4::mhc_pre_partial", mutates_args=())
def mhc_pre_partial(h: torch.Tensor, fn: torch.Tensor, collapse_pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V4.1's pre-site pass up to its partial sums: h [N, hc, D] -> x [N, D] collapsed with collapse_pre [N, hc]
    (the previous site's pre) and the workspace [S, N, M + 1] (`partial_splits`) that `mhc_post_finish` finishes.
    In V4.1 a site's pre, post and comb are first read by its post, so the finish kernel's launch goes."""
    if use_triton(h) and _hc_supported(h.shape[1], h.shape[2]):
        return mhc_pre_partial_triton(h, fn, collapse_pre)
    x, ws = mhc_pre_partial_twin(h, fn, collapse_pre)
    return x.contiguous(), ws.contiguous()


@mhc_pre_partial.register_fake
def _(h, fn, collapse_pre):
    N, hc, D = h.shape
    return h.new_empty(N, D), _fake_workspace(h, hc, D)


@torch.library.custom_op("dsv4::mhc_post_finish", mutates_args=())
def mhc_post_finish(f: torch.Tensor, residual: torch.Tensor, ws: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                    norm_eps: float, hc_eps: float, iters: int,
                    settled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """mhc_post with the site's coefficients finished from `mhc_pre_partial`'s workspace ws: f [N, D], residual
    [N, hc, D] -> (h' [N, hc, D] in f's dtype, the site's pre [N, hc] fp32, the next site's collapse weights).
    f may be the MoE's slots and settled is residual and ws's, as mhc_post_partial's."""
    _check_f(f, residual, "mhc_post_finish")
    if use_triton(f) and _hc_supported(residual.shape[1], 16):
        return mhc_post_finish_triton(f, residual, ws, scale, base, norm_eps, hc_eps, iters, settled)
    out, pre = mhc_post_finish_twin(summed_slots(f, residual.dtype), residual, ws, scale, base, norm_eps, hc_eps,
                                    iters)
    return out.contiguous(), pre.contiguous()


@mhc_post_finish.register_fake
def _(f, residual, ws, scale, base, norm_eps, hc_eps, iters, settled=False):
    _check_f(f, residual, "mhc_post_finish")
    return (residual.new_empty(residual.shape, dtype=_output_dtype(f, residual)),
            residual.new_empty(residual.shape[:2], dtype=torch.float32))


@torch.library.custom_op("dsv4::mhc_post_partial", mutates_args=())
def mhc_post_partial(f: torch.Tensor, residual: torch.Tensor, ws: torch.Tensor, scale: torch.Tensor,
                     base: torch.Tensor, fn_next: torch.Tensor, norm_eps: float, hc_eps: float,
                     iters: int, settled: bool = False, squares: bool = False,
                     start_next: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mhc_post_finish, then mhc_pre_partial of the next site (fn_next) on its output collapsing with this site's
    pre, in one kernel: f [N, D], residual [N, hc, D], ws -> (h' [N, hc, D], x [N, D], the next site's workspace,
    with `squares` x's squares by d step [N, S] fp32, else [N, 0]: `squares_by_step`, for a consumer normalizing x
    without a pass over it).
    f may be the MoE's slots [N, S, D] fp32, summed in the kernel (`summed_slots`; the outputs in residual's dtype).
    settled: the caller knows that residual and ws were written before the kernel that made f (a sub-layer ran
    between the site's pre pass and this post, as in the decode step), so the kernel reads them and finishes the
    coefficients before its PDL wait, beside that kernel's tail, and waits only to read f. Wrong where residual
    or ws comes from the kernel just before: the default reads nothing before the wait. start_next: with settled,
    the kernel after this one starts once this one's programs have waited (the decode step's gate GEMM, which asks
    for its first weights before its own wait); the same values."""
    _check_f(f, residual, "mhc_post_partial")
    if use_triton(f) and _hc_supported(residual.shape[1], residual.shape[2]):
        return mhc_post_partial_triton(f, residual, ws, scale, base, fn_next, norm_eps, hc_eps, iters, settled,
                                       squares, start_next)
    return tuple(t.contiguous() for t in mhc_post_partial_twin(f, residual, ws, scale, base, fn_next, norm_eps,
                                                                hc_eps, iters, squares))


@mhc_post_partial.register_fake
def _(f, residual, ws, scale, base, fn_next, norm_eps, hc_eps, iters, settled=False, squares=False, start_next=False):
    _check_f(f, residual, "mhc_post_partial")
    N, hc, D = residual.shape
    dtype = _output_dtype(f, residual)
    return (residual.new_empty(residual.shape, dtype=dtype), f.new_empty(N, D, dtype=dtype),
            _fake_workspace(residual, hc, D, dtype),
            f.new_empty(N, partial_splits(D, dtype.itemsize) if squares else 0, dtype=torch.float32))


def _fake_workspace(t: torch.Tensor, hc: int, D: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The partial pass's workspace [S, N, M + 1] for t's rows in `dtype` (default t's)."""
    itemsize = (dtype or t.dtype).itemsize
    return t.new_empty(partial_splits(D, itemsize), t.shape[0], (2 + hc) * hc + 1, dtype=torch.float32)


def _output_dtype(f: torch.Tensor, residual: torch.Tensor) -> torch.dtype:
    """A post's output dtype: the sub-layer output's, or the streams' for the MoE's slots (`summed_slots`)."""
    return residual.dtype if f.dim() == 3 else f.dtype


def _check_f(f: torch.Tensor, residual: torch.Tensor, what: str) -> None:
    """A fused post's f: [N, D], or the MoE's slots [N, S, D] fp32."""
    N, _, D = residual.shape
    if not (f.shape == (N, D) or (f.dim() == 3 and f.shape[::2] == (N, D) and f.dtype == torch.float32)):
        raise ValueError(f"{what}: f [{N}, {D}] or fp32 slots [{N}, S, {D}] expected, got {f.dtype} "
                         f"{tuple(f.shape)}")


@torch.library.custom_op("dsv4::mhc_post_sums", mutates_args=())
def mhc_post_sums(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  fn_next: torch.Tensor, settled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """V4's decode: mhc_post, then the next site's partial sums (fn_next) on its output, in one kernel (up to
    POST_PARTIAL_MAX_N rows): f [N, D], residual [N, hc, D], post [N, hc], comb [N, hc, hc] -> (h' [N, hc, D],
    the next site's workspace [S, N, M + 1], which `mhc_pre_finish` finishes). f may be the MoE's slots and
    settled is residual, post and comb's, as mhc_post_partial's."""
    _check_f(f, residual, "mhc_post_sums")
    if use_triton(f) and _hc_supported(residual.shape[1], residual.shape[2]):
        return mhc_post_sums_triton(f, residual, post, comb, fn_next, settled)
    out, ws = mhc_post_sums_twin(f, residual, post, comb, fn_next)
    return out.contiguous(), ws.contiguous()


@mhc_post_sums.register_fake
def _(f, residual, post, comb, fn_next, settled=False):
    _check_f(f, residual, "mhc_post_sums")
    _, hc, D = residual.shape
    dtype = _output_dtype(f, residual)
    return residual.new_empty(residual.shape, dtype=dtype), _fake_workspace(residual, hc, D, dtype)


@torch.library.custom_op("dsv4::mhc_pre_finish", mutates_args=())
def mhc_pre_finish(h: torch.Tensor, ws: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                   hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mhc_pre from the partial sums of h [N, hc, D] already made (`mhc_post_sums`' workspace ws): the second
    kernel alone -> x [N, D] collapsed with this site's pre, pre, post [N, hc], comb [N, hc, hc]."""
    if use_triton(h) and _hc_supported(h.shape[1], h.shape[2]):
        return mhc_pre_finish_triton(h, ws, scale, base, norm_eps, hc_eps, iters)
    return tuple(t.contiguous() for t in mhc_pre_finish_twin(h, ws, scale, base, norm_eps, hc_eps, iters))


@mhc_pre_finish.register_fake
def _(h, ws, scale, base, norm_eps, hc_eps, iters):
    return _fake_pre(h)
