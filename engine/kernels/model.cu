// The CUDA backend's model kernels (docs/model.md §2): every op of the DeepSeek-V3.2 forward in a plain,
// correct form. The fast kernels of the later issues (sparse MLA decode, the indexer, prefill attention,
// FP8 GEMM/MoE) replace these one by one; until then these define what "correct on the GPU" means.
//
// Exactness rule (docs/model.md §2.6): every output element is computed by one warp or one thread in an
// order fixed by the weight shapes and the row's own lengths, never by the batch: a row's values do not
// depend on the other rows of the batch, where it sits in it, or how many there are.
//
// All activations are f32. Weight matrices are either f32 `[n, k]` or e4m3 codes `[n, kpad]` (K padded to
// a multiple of 128 with zero codes) with f32 block scales `[ceil(n / b0), ceil(k / b1)]`. Several
// matrices of one shape (the routed experts of a layer) sit back to back; a row picks its matrix through
// `sel` (null: matrix 0).
#include "common.cuh"

#define WARPS 8
#define ROWS_PER_CTA 8
#define ACT_GROUP 128

__device__ __forceinline__ float tandem_e4m3_val(u8 b) {
    u32 h2;
    const u16 in = b;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
    const u16 lo = (u16)(h2 & 0xffffu);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(lo));
    return f;
}

__device__ __forceinline__ u8 tandem_e4m3(float x) { return (u8)(tandem_e4m3x2(x, 0.0f) & 0xff); }

__device__ __forceinline__ float tandem_bf16_val(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Reductions over a warp and over the CTA, by `op`: a sum in round-to-nearest (never contracted into an
// FMA) or a max. An ordered reduction of `n` values starts from `start(v)` and combines `v[FROM..n]` into
// it: a sum starts from 0, a max from the first value.
struct TandemAdd {
    enum { FROM = 0 };
    __device__ __forceinline__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
    __device__ __forceinline__ float start(const float*) const { return 0.0f; }
};

struct TandemMax {
    enum { FROM = 1 };
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
    __device__ __forceinline__ float start(const float* v) const { return v[0]; }
};

// Over the warp by a fixed butterfly: the same lanes give the same bits.
template <class Op>
__device__ __forceinline__ float tandem_warp_reduce(float v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float tandem_warp_sum(float v) { return tandem_warp_reduce(v, TandemAdd()); }

// Over the CTA (blockDim.x a multiple of 32, at most 1024): warp results, then thread 0 combines them in
// warp order. `red` holds 32 floats. Every thread gets the result.
template <class Op>
__device__ __forceinline__ float tandem_block_reduce(float v, float* red, Op op) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    v = tandem_warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = op.start(red);
        for (int w = Op::FROM; w < warps; ++w) s = op(s, red[w]);
        red[0] = s;
    }
    __syncthreads();
    return red[0];
}

__device__ __forceinline__ float tandem_block_sum(float v, float* red) { return tandem_block_reduce(v, red, TandemAdd()); }

__device__ __forceinline__ float tandem_block_max(float v, float* red) { return tandem_block_reduce(v, red, TandemMax()); }

// The ue8m0 or plain group scale of engine::fp8::group_scale.
__device__ __forceinline__ float tandem_group_scale(float amax, int ue8m0) {
    if (ue8m0) return tandem_ue8m0_scale(amax);
    return __fmul_rn(fmaxf(amax, TANDEM_AMAX_FLOOR), 1.0f / TANDEM_E4M3_MAX);
}

// e4m3 code of x / s (as engine::fp8::quantize_group: multiply by 1/s for power-of-two scales).
__device__ __forceinline__ u8 tandem_quant(float x, float s, int ue8m0) {
    const float q = ue8m0 ? __fmul_rn(x, __frcp_rn(s)) : __fdiv_rn(x, s);
    return tandem_e4m3(fminf(fmaxf(q, -TANDEM_E4M3_MAX), TANDEM_E4M3_MAX));
}

// ---------------------------------------------------------------------------------------------------
// Embedding, norms, elementwise.

// out[r] = table[tokens[r]], or zeros where zero_rows[r] != 0 (the MTP input at position 0).
extern "C" __global__ void tandem_embed(const float* __restrict__ table, const int* __restrict__ tokens,
                                        const int* __restrict__ zero_rows, float* __restrict__ out, int hidden) {
    const int r = blockIdx.x;
    const bool zero = zero_rows != nullptr && zero_rows[r] != 0;
    const float* src = table + (i64)tokens[r] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) out[(i64)r * hidden + i] = zero ? 0.0f : src[i];
}

// RMSNorm of each row: x * (1 / sqrt(mean(x^2) + eps)) * w. One CTA per row; in_stride / out_stride in
// floats (rows of a wider matrix, e.g. the latent part of kv_a's output).
// Rows of at most RMS_VEC x 4 x blockDim.x values that are 16-byte aligned (every row the backend norms) are
// read once, 16 bytes at a time, into registers with the weights, all loads issued before the first sum:
// a row is one round of memory latency instead of one per loop step (a decode row of 7168 values was 20 us on
// an H100 with the two strided loops, which other rows still take). Thread t sums its values in j order
// (float4 j: elements 4 (t + j blockDim.x) .. + 3), then the block's fixed-order reduction: a row's bits depend
// on its values, its width and its alignment only.
#define RMS_VEC 8
extern "C" __global__ void tandem_rms_norm(const float* __restrict__ x, i64 in_stride, const float* __restrict__ w,
                                           float* __restrict__ out, i64 out_stride, int d, float eps) {
    __shared__ float red[32];
    const float* xr = x + (i64)blockIdx.x * in_stride;
    float* o = out + (i64)blockIdx.x * out_stride;
    const bool vec = (d & 3) == 0 && d <= RMS_VEC * 4 * (int)blockDim.x &&
                     ((reinterpret_cast<unsigned long long>(xr) | reinterpret_cast<unsigned long long>(o) |
                       reinterpret_cast<unsigned long long>(w)) & 15) == 0;
    if (vec) {
        float4 v[RMS_VEC], g[RMS_VEC];
        const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int j = 0; j < RMS_VEC; ++j) {
            const int i = 4 * (threadIdx.x + j * blockDim.x);
            v[j] = i < d ? *reinterpret_cast<const float4*>(xr + i) : zero;
            g[j] = i < d ? *reinterpret_cast<const float4*>(w + i) : zero;
        }
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < RMS_VEC; ++j) {
            acc = __fmaf_rn(v[j].x, v[j].x, acc);
            acc = __fmaf_rn(v[j].y, v[j].y, acc);
            acc = __fmaf_rn(v[j].z, v[j].z, acc);
            acc = __fmaf_rn(v[j].w, v[j].w, acc);
        }
        const float ms = __fdiv_rn(tandem_block_sum(acc, red), (float)d);
        const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
#pragma unroll
        for (int j = 0; j < RMS_VEC; ++j) {
            const int i = 4 * (threadIdx.x + j * blockDim.x);
            if (i < d)
                *reinterpret_cast<float4*>(o + i) =
                    make_float4(__fmul_rn(__fmul_rn(v[j].x, inv), g[j].x), __fmul_rn(__fmul_rn(v[j].y, inv), g[j].y),
                                __fmul_rn(__fmul_rn(v[j].z, inv), g[j].z), __fmul_rn(__fmul_rn(v[j].w, inv), g[j].w));
        }
        return;
    }
    float acc = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) acc = __fmaf_rn(xr[i], xr[i], acc);
    const float ms = __fdiv_rn(tandem_block_sum(acc, red), (float)d);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
}

// h += x
extern "C" __global__ void tandem_add(float* __restrict__ h, const float* __restrict__ x, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        h[i] = __fadd_rn(h[i], x[i]);
}

// out = silu(g) * u, silu(x) = x / (1 + exp(-x)).
extern "C" __global__ void tandem_silu_mul(const float* __restrict__ g, const float* __restrict__ u,
                                           float* __restrict__ out, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float a = g[i];
        const float s = __fdiv_rn(a, __fadd_rn(1.0f, expf(-a)));
        out[i] = __fmul_rn(s, u[i]);
    }
}

// Copies rows: out[i] = x[rows[i]] (width floats each).
extern "C" __global__ void tandem_gather_rows(const float* __restrict__ x, const int* __restrict__ rows,
                                             float* __restrict__ out, int width) {
    const float* src = x + (i64)rows[blockIdx.x] * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[(i64)blockIdx.x * width + i] = src[i];
}

// The row of each request a whole decode step drafts from (engine::cuda::backend::issue_step): `second[i]`
// where row `first[i]`'s sampled token is the request's draft `draft[i]` (accepted), else `first[i]`; for
// i < *count, 0 past it (cap entries).
extern "C" __global__ void tandem_step_draft_rows(const int* __restrict__ sampled, const int* __restrict__ first,
                                                  const int* __restrict__ second, const int* __restrict__ draft,
                                                  const int* __restrict__ count, int cap, int* __restrict__ idx) {
    const int items = *count;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < cap; i += gridDim.x * blockDim.x) {
        int r = 0;
        if (i < items) {
            r = first[i];
            if (second[i] >= 0 && sampled[r] == draft[i]) r = second[i];
        }
        idx[i] = r;
    }
}

// ---------------------------------------------------------------------------------------------------
// Linear layers.

// Activation quantization per row per 128 channels (engine::fp8::quantize_group_values): codes
// [rows, kpad] (zero past k) and scales [rows, kpad / 128], or with `scale_ld` > 0 transposed,
// [kpad / 128, scale_ld] (the FP8 GEMM's layout, engine::cuda::gemm). Row r quantizes x's row
// row_src[r] where a row map is given (the routed experts' grouped rows, engine::cuda::moe), else row r.
// One warp per (row, group), blockDim / 32 groups per CTA, ACT_ROWS rows per pass (their loads issued before
// any row's reduction, so a warp keeps several in flight); rows past the grid's y extent are taken in further
// passes. Where k is a multiple of 4, lane l takes channels 4l..4l+3 of its group (one 16-byte load, one
// 4-byte store), else l, l + 32, ...: the same codes and scales either way (the amax is order-free), and a
// row's codes do not depend on the rows beside it.
#ifndef ACT_ROWS
#define ACT_ROWS 4
#endif
extern "C" __global__ void tandem_act_quant(const float* __restrict__ x, int k, int kpad, int ue8m0,
                                            u8* __restrict__ codes, float* __restrict__ scales, int scale_ld,
                                            int rows, const int* __restrict__ row_src) {
    const int lane = threadIdx.x & 31, g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (g * ACT_GROUP >= kpad) return;  // a warp past the last group (whole warps: no barrier below)
    const bool vec = (k & 3) == 0;
    for (int r0 = blockIdx.y * ACT_ROWS; r0 < rows; r0 += gridDim.y * ACT_ROWS) {
        float v[ACT_ROWS][4];
#pragma unroll
        for (int i = 0; i < ACT_ROWS; ++i) {
            const int r = r0 + i;
            if (r >= rows) {
#pragma unroll
                for (int j = 0; j < 4; ++j) v[i][j] = 0.0f;
                continue;
            }
            const float* xr = x + (i64)(row_src != nullptr ? row_src[r] : r) * k;
            if (vec) {
                const int c = g * ACT_GROUP + 4 * lane;
                const float4 q = c < k ? *(const float4*)(xr + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                v[i][0] = q.x, v[i][1] = q.y, v[i][2] = q.z, v[i][3] = q.w;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int c = g * ACT_GROUP + j * 32 + lane;
                    v[i][j] = c < k ? xr[c] : 0.0f;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < ACT_ROWS; ++i) {
            const int r = r0 + i;
            if (r >= rows) break;  // uniform across the warp
            u8* out = codes + (i64)r * kpad + g * ACT_GROUP;
            float amax = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(v[i][j]));
            amax = tandem_warp_amax(amax);
            const float s = tandem_group_scale(amax, ue8m0);
            if (vec) {
                // Channels past k hold zeros, whose code is 0.
                u32 word = 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) word |= (u32)tandem_quant(v[i][j], s, ue8m0) << (8 * j);
                *(u32*)(out + 4 * lane) = word;
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int c = g * ACT_GROUP + j * 32 + lane;
                    out[j * 32 + lane] = c < k ? tandem_quant(v[i][j], s, ue8m0) : (u8)0;
                }
            }
            if (lane == 0) scales[scale_ld > 0 ? (i64)g * scale_ld + r : (i64)r * (kpad / ACT_GROUP) + g] = s;
        }
    }
}

// y[m, c] = sum over K segments of (qa[m] . w[c] over the segment) * sa[m, seg] * ws[c / b0, seg]
// (docs/model.md §2.1), a segment being 128 channels or a weight block when that is smaller (64 or 32).
// Activation row of output row m: m / a_div (the routed experts' (token, slot) rows share their token's
// activations). A warp computes one column for ROWS_PER_CTA rows; lane l holds channels l, l + 32, ... of
// each segment; each segment's products are summed by the warp's butterfly, then added in segment order.
extern "C" __global__ void __launch_bounds__(WARPS * 32) tandem_gemm_fp8(
    const u8* __restrict__ qa, const float* __restrict__ sa, int a_div,
    const u8* __restrict__ w, const float* __restrict__ ws, const int* __restrict__ sel, i64 w_stride,
    i64 ws_stride, float* __restrict__ y, int rows, int n, int k, int kpad, int b0, int b1) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.x * WARPS + warp;
    if (c >= n) return;
    const int r0 = blockIdx.y * ROWS_PER_CTA;
    const int seg = b1 < ACT_GROUP ? b1 : ACT_GROUP;
    const int per_lane = seg / 32;
    const int scale_cols = (k + b1 - 1) / b1;
    const int groups = kpad / ACT_GROUP;
    for (int i = 0; i < ROWS_PER_CTA; ++i) {
        const int m = r0 + i;
        if (m >= rows) break;
        const i64 mat = sel != nullptr ? (i64)sel[m] : 0;
        const u8* wr = w + mat * w_stride + (i64)c * kpad;
        const float* wsr = ws + mat * ws_stride + (i64)(c / b0) * scale_cols;
        const int am = m / a_div;
        const u8* ar = qa + (i64)am * kpad;
        float acc = 0.0f;
        for (int lo = 0; lo < k; lo += seg) {
            float p = 0.0f;
            for (int j = 0; j < per_lane; ++j) {
                const int ch = lo + j * 32 + lane;
                p = __fmaf_rn(tandem_e4m3_val(ar[ch]), tandem_e4m3_val(wr[ch]), p);
            }
            p = tandem_warp_sum(p);
            const float scale = __fmul_rn(sa[(i64)am * groups + lo / ACT_GROUP], wsr[lo / b1]);
            acc = __fadd_rn(acc, __fmul_rn(p, scale));
        }
        if (lane == 0) y[(i64)m * n + c] = acc;
    }
}

// y[m, c] = x[m / a_div] . w[c] in f32. K is cut into chunks of `chunk` channels (a multiple of 512, from the
// weight shape: engine::cuda::weights::f32_chunk); in a chunk lane l sums channels 4l..4l+3, 4l+128.. by FMA
// (16-byte loads; one channel at a time from l, l + 32, ... where k is not a multiple of 4), then the warp's
// butterfly; the chunks' sums add left to right. With `part` each chunk is its own CTA (grid z) and leaves its
// sum in part[z][m][c] for tandem_gemm_f32_combine (the backend's narrow linears: more warps in flight);
// without, a warp adds its chunks in sequence. The same operations either way, and the same as tandem_gemm_f32_tiled's. The loop is
// unrolled F32R_UNROLL times (its loads in flight together; the sums keep their order).
#ifndef F32R_UNROLL
#define F32R_UNROLL 4
#endif
#define TANDEM_PRAGMA(x) _Pragma(#x)
#define TANDEM_UNROLL(n) TANDEM_PRAGMA(unroll n)
__device__ __forceinline__ float tandem_f32_chunk_sum(const float* __restrict__ xr, const float* __restrict__ wr,
                                                      int lo, int hi, bool vec, int lane) {
    float p = 0.0f;
    if (vec) {
        TANDEM_UNROLL(F32R_UNROLL)
        for (int ch = lo + 4 * lane; ch < hi; ch += 128) {
            const float4 a = *(const float4*)(xr + ch), b = *(const float4*)(wr + ch);
            p = __fmaf_rn(a.x, b.x, p);
            p = __fmaf_rn(a.y, b.y, p);
            p = __fmaf_rn(a.z, b.z, p);
            p = __fmaf_rn(a.w, b.w, p);
        }
    } else {
        for (int ch = lo + lane; ch < hi; ch += 32) p = __fmaf_rn(xr[ch], wr[ch], p);
    }
    return tandem_warp_sum(p);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) tandem_gemm_f32(
    const float* __restrict__ x, int a_div, const float* __restrict__ w, const int* __restrict__ sel, i64 w_stride,
    float* __restrict__ y, int rows, int n, int k, int chunk, float* __restrict__ part) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.x * WARPS + warp;
    if (c >= n) return;
    const int r0 = blockIdx.y * ROWS_PER_CTA;
    const bool vec = (k & 3) == 0 && (w_stride & 3) == 0;
    for (int i = 0; i < ROWS_PER_CTA; ++i) {
        const int m = r0 + i;
        if (m >= rows) break;
        const i64 mat = sel != nullptr ? (i64)sel[m] : 0;
        const float* wr = w + mat * w_stride + (i64)c * k;
        const float* xr = x + (i64)(m / a_div) * k;
        if (part != nullptr) {
            const int lo = blockIdx.z * chunk;
            const float s = tandem_f32_chunk_sum(xr, wr, lo, min(k, lo + chunk), vec, lane);
            if (lane == 0) part[((i64)blockIdx.z * rows + m) * n + c] = s;
            continue;
        }
        float total = 0.0f;
        for (int lo = 0; lo < k; lo += chunk) {
            const float s = tandem_f32_chunk_sum(xr, wr, lo, min(k, lo + chunk), vec, lane);
            total = lo == 0 ? s : __fadd_rn(total, s);
        }
        if (lane == 0) y[(i64)m * n + c] = total;
    }
}

// y[i] = part[0][i] + part[1][i] + ... (left to right): the chunks of tandem_gemm_f32 / _tiled with `part`.
extern "C" __global__ void tandem_gemm_f32_combine(const float* __restrict__ part, float* __restrict__ y, i64 len,
                                                   int chunks) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (i64)gridDim.x * blockDim.x) {
        float s = part[i];
        for (int z = 1; z < chunks; ++z) s = __fadd_rn(s, part[(i64)z * len + i]);
        y[i] = s;
    }
}

// (F32T_COLS, F32T_ROWS and F32T_SUB can be overridden for timing experiments: bench/gpu/f32_bench.py F32_DEFINES.)
#ifndef F32T_COLS
#define F32T_COLS 4  // columns per warp
#endif
#ifndef F32T_ROWS
#define F32T_ROWS 8  // rows per CTA
#endif
#ifndef F32T_SUB
#define F32T_SUB 4  // 128-channel sub-steps per step: their weight loads are in flight together
#endif
#define F32T_K (128 * F32T_SUB)  // channels per step
static_assert(512 % F32T_K == 0, "f32 chunks are multiples of 512 channels (engine::cuda::weights::f32_chunk)");

// tandem_gemm_f32's product for one matrix and k a multiple of 4 (the router gate, the indexer's weights_proj
// and every f32 linear of the full-precision path), with the same bits: in each K chunk lane l sums channels
// 4l..4l+3, 4l+128, ... by FMA in that order, then the warp's butterfly, and the chunks add left to right
// (lane 0 keeps the totals; with `part`, one chunk per grid z into part[z][m][c]). It reads each weight once per F32T_ROWS rows
// instead of once per row: a CTA stages its rows' next F32T_K channels of x in shared memory, each warp loads
// its F32T_COLS columns' weights for all F32T_SUB sub-steps first, then keeps the sums of those columns for
// all the rows. A row's sums are the same operations whatever rows share the CTA, so its bits depend neither
// on the batch nor on which of the two kernels ran (the backend takes this one from 16 rows,
// engine::cuda::weights).
extern "C" __global__ void __launch_bounds__(WARPS * 32)
    tandem_gemm_f32_tiled(const float* __restrict__ x, int a_div, const float* __restrict__ w, float* __restrict__ y,
                          int rows, int n, int k, int chunk, float* __restrict__ part) {
    __shared__ __align__(16) float xs[F32T_ROWS][F32T_K];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = (blockIdx.x * WARPS + warp) * F32T_COLS, r0 = blockIdx.y * F32T_ROWS;
    const int nr = min(F32T_ROWS, rows - r0);
    float acc[F32T_COLS][F32T_ROWS];
#pragma unroll
    for (int j = 0; j < F32T_COLS; ++j)
#pragma unroll
        for (int r = 0; r < F32T_ROWS; ++r) acc[j][r] = 0.0f;
    // The chunks' running totals, kept by lane 0 in shared memory (registers would halve the CTAs an SM holds).
    __shared__ float totals[WARPS][F32T_COLS * F32T_ROWS];
    float* const total = totals[warp];
    // A chunk's sums through the butterfly, added to the chunks before (left to right) and started again.
    auto fold = [&](bool first) {
#pragma unroll
        for (int j = 0; j < F32T_COLS; ++j)
#pragma unroll
            for (int r = 0; r < F32T_ROWS; ++r) {
                const float s = tandem_warp_sum(acc[j][r]);
                if (lane == 0) total[j * F32T_ROWS + r] = first ? s : __fadd_rn(total[j * F32T_ROWS + r], s);
                acc[j][r] = 0.0f;
            }
    };
    // With `part`, this CTA's chunk only (grid z); without, every chunk in turn.
    const int k_lo = part != nullptr ? blockIdx.z * chunk : 0;
    const int k_hi = part != nullptr ? min(k, k_lo + chunk) : k;
    for (int kb = k_lo; kb < k_hi; kb += F32T_K) {
        if (kb > k_lo && kb % chunk == 0) fold(kb == chunk);
        for (int i = threadIdx.x; i < F32T_ROWS * (F32T_K / 4); i += WARPS * 32) {
            const int r = i / (F32T_K / 4), q = 4 * (i % (F32T_K / 4)), m = r0 + r;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (m < rows && kb + q < k_hi) v = *(const float4*)(x + (i64)(m / a_div) * k + kb + q);
            *(float4*)&xs[r][q] = v;
        }
        float4 wv[F32T_SUB][F32T_COLS];
#pragma unroll
        for (int u = 0; u < F32T_SUB; ++u) {
            const int ch = kb + 128 * u + 4 * lane;
#pragma unroll
            for (int j = 0; j < F32T_COLS; ++j)
                wv[u][j] = c0 + j < n && ch < k_hi ? *(const float4*)(w + (i64)(c0 + j) * k + ch)
                                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < F32T_SUB; ++u) {
            if (kb + 128 * u + 4 * lane >= k_hi) break;  // a lane past its chunk adds nothing, as in the row kernel
#pragma unroll
            for (int r = 0; r < F32T_ROWS; ++r) {
                if (r >= nr) break;  // uniform
                const float4 a = *(const float4*)&xs[r][128 * u + 4 * lane];
#pragma unroll
                for (int j = 0; j < F32T_COLS; ++j) {
                    acc[j][r] = __fmaf_rn(a.x, wv[u][j].x, acc[j][r]);
                    acc[j][r] = __fmaf_rn(a.y, wv[u][j].y, acc[j][r]);
                    acc[j][r] = __fmaf_rn(a.z, wv[u][j].z, acc[j][r]);
                    acc[j][r] = __fmaf_rn(a.w, wv[u][j].w, acc[j][r]);
                }
            }
        }
        __syncthreads();
    }
    fold(part != nullptr || k <= chunk);
#pragma unroll
    for (int j = 0; j < F32T_COLS; ++j)
#pragma unroll
        for (int r = 0; r < F32T_ROWS; ++r) {
            if (r >= nr) break;
            if (lane != 0 || c0 + j >= n) continue;
            if (part != nullptr)
                part[((i64)blockIdx.z * rows + r0 + r) * n + c0 + j] = total[j * F32T_ROWS + r];
            else
                y[(i64)(r0 + r) * n + c0 + j] = total[j * F32T_ROWS + r];
        }
}

#define BF16W_COLS 4   // columns per warp
#define BF16W_ROWS 16  // rows per CTA
#define BF16W_K 256    // channels per step: 32 lanes x 8

// y[m, c] = x[m / a_div] . w[c] with bf16 weights (the checkpoint's lm_head, MTP head, eh_proj and indexer
// weights_proj: exact in f32, so the values are the CPU's) and f32 sums, for any rows. A CTA of WARPS warps
// computes BF16W_COLS columns per warp for BF16W_ROWS rows: it stages the rows' next BF16W_K channels of x in
// shared memory, and each lane reads 8 consecutive bf16 of each of its warp's columns once per step (16-byte
// loads) for all the CTA's rows, so a decode batch of up to 16 rows reads the weights once.
// Exactness: lane l sums channels 8 l + 256 j + e (j ascending, then e = 0..7) by FMA, then the warp's
// butterfly: the same operations for an element whatever the batch, the row's place in it or the grid.
extern "C" __global__ void __launch_bounds__(WARPS * 32) tandem_gemm_bf16w(const float* __restrict__ x, int a_div,
                                                                          const u16* __restrict__ w,
                                                                          float* __restrict__ y, int rows, int n,
                                                                          int k) {
    __shared__ __align__(16) float xs[BF16W_ROWS][BF16W_K];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c0 = (blockIdx.x * WARPS + warp) * BF16W_COLS, r0 = blockIdx.y * BF16W_ROWS;
    const int nr = min(BF16W_ROWS, rows - r0);
    // 16-byte weight loads need rows of a multiple of 8 channels; other widths load one value at a time.
    const bool vec = (k & 7) == 0;
    float acc[BF16W_COLS][BF16W_ROWS];
#pragma unroll
    for (int j = 0; j < BF16W_COLS; ++j)
#pragma unroll
        for (int r = 0; r < BF16W_ROWS; ++r) acc[j][r] = 0.0f;
    for (int kb = 0; kb < k; kb += BF16W_K) {
        for (int i = threadIdx.x; i < BF16W_ROWS * BF16W_K; i += WARPS * 32) {
            const int r = i / BF16W_K, ch = kb + i % BF16W_K, m = r0 + r;
            xs[r][i % BF16W_K] = (m < rows && ch < k) ? x[(i64)(m / a_div) * k + ch] : 0.0f;
        }
        __syncthreads();
        const int ch0 = kb + 8 * lane;
        float wv[BF16W_COLS][8];
#pragma unroll
        for (int j = 0; j < BF16W_COLS; ++j) {
            const int c = c0 + j;
            const u16* wr = w + (i64)c * k + ch0;
            if (c < n && vec && ch0 + 8 <= k) {
                const uint4 q = *(const uint4*)wr;
                const u32 h[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    wv[j][2 * e] = __uint_as_float(h[e] << 16);
                    wv[j][2 * e + 1] = __uint_as_float(h[e] & 0xffff0000u);
                }
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) wv[j][e] = (c < n && ch0 + e < k) ? tandem_bf16_val(wr[e]) : 0.0f;
            }
        }
#pragma unroll
        for (int r = 0; r < BF16W_ROWS; ++r) {
            if (r >= nr) break;  // the CTA's rows past the batch (uniform): no work, no effect on the others
            const float4 a = *(const float4*)&xs[r][8 * lane], b = *(const float4*)&xs[r][8 * lane + 4];
            const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
            for (int e = 0; e < 8; ++e)
#pragma unroll
                for (int j = 0; j < BF16W_COLS; ++j) acc[j][r] = __fmaf_rn(xv[e], wv[j][e], acc[j][r]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < BF16W_COLS; ++j) {
#pragma unroll
        for (int r = 0; r < BF16W_ROWS; ++r) {
            const float v = tandem_warp_sum(acc[j][r]);
            if (lane == 0 && c0 + j < n && r0 + r < rows) y[(i64)(r0 + r) * n + c0 + j] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Rotary embeddings (engine::rope): cos and sin of pair i at position p, computed in double as the CPU
// does, then scaled by the YaRN attention factor and rounded to f32.

__device__ __forceinline__ void tandem_cos_sin(int pos, const double* __restrict__ inv_freq, double attn_factor,
                                               int pairs, float* cs, float* sn) {
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        double s, c;
        sincos((double)pos * inv_freq[i], &s, &c);
        cs[i] = (float)(c * attn_factor);
        sn[i] = (float)(s * attn_factor);
    }
}

__device__ __forceinline__ void tandem_rotate(float* a, float* b, float c, float s) {
    const float x = *a, y = *b;
    *a = __fsub_rn(__fmul_rn(x, c), __fmul_rn(y, s));
    *b = __fadd_rn(__fmul_rn(x, s), __fmul_rn(y, c));
}

// MLA after its projections, grid (rows, ceil(heads / MLA_POST_HEADS)): interleaved RoPE on the last `rd` dims of
// MLA_POST_HEADS query heads per CTA (in place in q [rows, heads, nope + rd]); the first CTA of a row also makes
// the cached latent c = RMSNorm(kv[:rank]) * kv_norm_w and the rotated shared key k_pe = rope(kv[rank:]) from
// kv_a's output kv [rows, rank + rd]. (One CTA per row rotating all 128 heads was 14 us a launch at batch 1: a
// chain of dependent loads; every value's arithmetic is the same whichever CTA does it.)
#define MLA_POST_HEADS 16
extern "C" __global__ void tandem_mla_post(float* __restrict__ q, const float* __restrict__ kv,
                                           const float* __restrict__ kv_norm_w, const int* __restrict__ positions,
                                           const double* __restrict__ inv_freq, double attn_factor,
                                           float* __restrict__ c, float* __restrict__ k_pe, int heads, int nope,
                                           int rd, int rank, float eps) {
    __shared__ float cs[64], sn[64], red[32];
    const int r = blockIdx.x, pairs = rd / 2;
    tandem_cos_sin(positions[r], inv_freq, attn_factor, pairs, cs, sn);
    __syncthreads();
    const int qk = nope + rd;
    const int h0 = blockIdx.y * MLA_POST_HEADS, nh = min(heads - h0, MLA_POST_HEADS);
    for (int t = threadIdx.x; t < nh * pairs; t += blockDim.x) {
        const int h = h0 + t / pairs, i = t % pairs;
        float* base = q + ((i64)r * heads + h) * qk + nope;
        tandem_rotate(base + 2 * i, base + 2 * i + 1, cs[i], sn[i]);
    }
    if (blockIdx.y != 0) return;
    const float* row = kv + (i64)r * (rank + rd);
    float acc = 0.0f;
    for (int i = threadIdx.x; i < rank; i += blockDim.x) acc = __fmaf_rn(row[i], row[i], acc);
    const float ms = __fdiv_rn(tandem_block_sum(acc, red), (float)rank);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
    for (int i = threadIdx.x; i < rank; i += blockDim.x)
        c[(i64)r * rank + i] = __fmul_rn(__fmul_rn(row[i], inv), kv_norm_w[i]);
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        float a = row[rank + 2 * i], b = row[rank + 2 * i + 1];
        tandem_rotate(&a, &b, cs[i], sn[i]);
        k_pe[(i64)r * rd + 2 * i] = a;
        k_pe[(i64)r * rd + 2 * i + 1] = b;
    }
}

// Orthonormal Walsh-Hadamard transform of 128 values in shared memory by 128 threads (Sylvester order).
__device__ __forceinline__ void tandem_hadamard128(float* v) {
    const int t = threadIdx.x;
    for (int h = 1; h < 128; h <<= 1) {
        __syncthreads();
        float mine = 0.0f;
        if (t < 128) {
            const bool low = (t & h) == 0;
            const float a = v[low ? t : t - h], b = v[low ? t + h : t];
            mine = low ? __fadd_rn(a, b) : __fsub_rn(a, b);
        }
        __syncthreads();
        if (t < 128) v[t] = mine;
    }
    __syncthreads();
    if (t < 128) v[t] = __fmul_rn(v[t], 0.08838834764831845f);  // 128^-0.5
    __syncthreads();
}

#define INDEXER_POST_HEADS 2  // query heads per CTA (engine::cuda::backend launches heads_pad / 2 per row)

// The lightning indexer after its projections (docs/model.md §2.3), CTAs of 128 threads, grid (rows,
// ceil(heads_pad / INDEXER_POST_HEADS)): the first CTA of a row computes its key = Hadamard(NeoX-rope(
// LayerNorm(k))) on the FIRST rd dims, written to keys [rows, 128]; each CTA INDEXER_POST_HEADS heads: each
// head's query = Hadamard(NeoX-rope(q)), then (fp8) quantized to e4m3 codes with a ue8m0 scale folded
// into its head weight, w = weights_proj * head_scale (* q scale). Heads past `heads` up to `heads_pad`
// get zero codes and weights. Outputs: q_codes [rows, heads_pad, 128] (fp8) or q_f32 [rows, heads, 128].
extern "C" __global__ void __launch_bounds__(128) tandem_indexer_post(
    const float* __restrict__ q, float* __restrict__ k, const float* __restrict__ wts,
    const float* __restrict__ norm_w, const float* __restrict__ norm_b, const int* __restrict__ positions,
    const double* __restrict__ inv_freq, double attn_factor, float head_scale, float norm_eps, int heads,
    int heads_pad, int rd, int fp8, u8* __restrict__ q_codes, float* __restrict__ q_f32,
    float* __restrict__ w_out) {
    __shared__ float v[128], cs[64], sn[64], red[32];
    const int r = blockIdx.x, t = threadIdx.x, half = rd / 2;
    tandem_cos_sin(positions[r], inv_freq, attn_factor, half, cs, sn);
    if (blockIdx.y == 0) {
        // Key: LayerNorm with weight and bias.
        float* kr = k + (i64)r * 128;
        const float x = kr[t];
        const float mean = __fdiv_rn(tandem_block_sum(x, red), 128.0f);
        const float d = __fsub_rn(x, mean);
        const float var = __fdiv_rn(tandem_block_sum(__fmul_rn(d, d), red), 128.0f);
        const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, norm_eps)));
        v[t] = __fadd_rn(__fmul_rn(__fmul_rn(d, inv), norm_w[t]), norm_b[t]);
        __syncthreads();
        if (t < half) tandem_rotate(&v[t], &v[t + half], cs[t], sn[t]);
        tandem_hadamard128(v);
        kr[t] = v[t];
    }
    const int h_end = min(heads_pad, (int)(blockIdx.y + 1) * INDEXER_POST_HEADS);
    for (int h = blockIdx.y * INDEXER_POST_HEADS; h < h_end; ++h) {
        const i64 qi = ((i64)r * heads_pad + h) * 128 + t;
        if (h >= heads) {
            if (fp8) q_codes[qi] = 0;
            if (t == 0) w_out[(i64)r * heads_pad + h] = 0.0f;
            continue;
        }
        __syncthreads();
        v[t] = q[((i64)r * heads + h) * 128 + t];
        __syncthreads();
        if (t < half) tandem_rotate(&v[t], &v[t + half], cs[t], sn[t]);
        tandem_hadamard128(v);
        float wh = __fmul_rn(wts[(i64)r * heads + h], head_scale);
        if (fp8) {
            // One 128-wide group per head: amax over the CTA (max is order-free).
            const float amax = tandem_block_max(fabsf(v[t]), red);
            const float s = tandem_ue8m0_scale(amax);
            q_codes[qi] = tandem_quant(v[t], s, 1);
            wh = __fmul_rn(wh, s);
        } else {
            q_f32[((i64)r * heads + h) * 128 + t] = v[t];
        }
        if (t == 0) w_out[(i64)r * heads_pad + h] = wh;
    }
}

// ---------------------------------------------------------------------------------------------------
// Caches in the f32 format (the FP8 encoders are the cache_quant family): the latent entry is c then
// k_pe as f32; an indexer block is 64 keys of `dim` f32.
extern "C" __global__ void tandem_write_cache_f32(const float* __restrict__ c, const float* __restrict__ k_pe,
                                                  const float* __restrict__ keys, const i64* __restrict__ slots,
                                                  float* __restrict__ latent, float* __restrict__ index_blocks,
                                                  int rank, int rd, int dim, i64 num_slots) {
    const int t = blockIdx.x;
    const i64 slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;
    float* e = latent + slot * (rank + rd);
    for (int i = threadIdx.x; i < rank; i += blockDim.x) e[i] = c[(i64)t * rank + i];
    for (int i = threadIdx.x; i < rd; i += blockDim.x) e[rank + i] = k_pe[(i64)t * rd + i];
    // Block b holds slots b*64 .. b*64+63 at b * 64 * dim: the same offset as slot * dim.
    for (int i = threadIdx.x; i < dim; i += blockDim.x) index_blocks[slot * dim + i] = keys[(i64)t * dim + i];
}

// Dequantized latent of one cache slot into shared or global memory: c [rank], k_pe [rd].
__device__ __forceinline__ const u8* tandem_latent_entry(const u8* latent, i64 slot, int fp8, int rank, int rd) {
    const i64 bytes = fp8 ? (i64)rank + 4 * (rank / 128) + 2 * rd : 4 * (i64)(rank + rd);
    return latent + slot * bytes;
}

__device__ __forceinline__ float tandem_latent_c(const u8* e, int i, int fp8, int rank) {
    if (!fp8) return reinterpret_cast<const float*>(e)[i];
    const float s = reinterpret_cast<const float*>(e + rank)[i / 128];
    return __fmul_rn(tandem_e4m3_val(e[i]), s);
}

__device__ __forceinline__ float tandem_latent_kpe(const u8* e, int i, int fp8, int rank) {
    if (!fp8) return reinterpret_cast<const float*>(e)[rank + i];
    return tandem_bf16_val(reinterpret_cast<const u16*>(e + rank + 4 * (rank / 128))[i]);
}

// Reads cache slots back (dequantized): c [n, rank], k_pe [n, rd] for slots[j] (the MHA form's context).
extern "C" __global__ void tandem_read_latents(const u8* __restrict__ latent, const i64* __restrict__ slots, int fp8,
                                               int rank, int rd, float* __restrict__ c, float* __restrict__ k_pe) {
    const int j = blockIdx.x;
    const u8* e = tandem_latent_entry(latent, slots[j], fp8, rank, rd);
    for (int i = threadIdx.x; i < rank; i += blockDim.x) c[(i64)j * rank + i] = tandem_latent_c(e, i, fp8, rank);
    for (int i = threadIdx.x; i < rd; i += blockDim.x) k_pe[(i64)j * rd + i] = tandem_latent_kpe(e, i, fp8, rank);
}

// Indexer scores over f32 keys (the `full` precision): I[r, s] = sum_h w[r, h] * relu(q[r, h] . k[s]) for
// s < lengths[r], keys found through the row's block table. One thread per key, the heads summed in
// engine::cpu::indexer::head_sum's order. `w` is [rows, w_stride] (rows padded to a multiple of 8 heads).
extern "C" __global__ void tandem_indexer_scores_f32(const float* __restrict__ q, const float* __restrict__ w,
                                                     int heads, int w_stride, const float* __restrict__ index_blocks,
                                                     const int* __restrict__ block_table, int max_blocks,
                                                     const int* __restrict__ lengths, float* __restrict__ scores,
                                                     i64 score_stride) {
    const int row = blockIdx.y, s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= lengths[row]) return;
    const int phys = block_table[(i64)row * max_blocks + s / 64];
    const float* key = index_blocks + ((i64)phys * 64 + s % 64) * 128;
    // The heads in engine::cpu::indexer::head_sum's order: partial (h / 2) % 4, then (P0 + P1) + (P2 + P3).
    float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int h = 0; h < heads; ++h) {
        const float* qh = q + ((i64)row * heads + h) * 128;
        float d = 0.0f;
        for (int i = 0; i < 128; ++i) d = __fmaf_rn(qh[i], key[i], d);
        p[(h >> 1) & 3] = __fmaf_rn(fmaxf(d, 0.0f), w[(i64)row * w_stride + h], p[(h >> 1) & 3]);
    }
    scores[(i64)row * score_stride + s] = __fadd_rn(__fadd_rn(p[0], p[1]), __fadd_rn(p[2], p[3]));
}

// ---------------------------------------------------------------------------------------------------
// Attention over the selected tokens (docs/model.md §2.2). One CTA per (head, row); `sel` holds each row's
// selected positions ascending, then -1. Scores are summed by a warp per token, the softmax runs over the
// CTA in a fixed order, and each output element is a sequential sum over the selected tokens.

// Softmax of p[0..n) in place (max-subtracted), by the CTA.
__device__ __forceinline__ void tandem_softmax(float* p, int n, float* red) {
    float m = -__int_as_float(0x7f800000);
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, p[i]);
    m = tandem_block_max(m, red);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(__fsub_rn(p[i], m));
        p[i] = e;
        sum = __fadd_rn(sum, e);
    }
    const float inv = __fdiv_rn(1.0f, tandem_block_sum(sum, red));
    for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = __fmul_rn(p[i], inv);
    __syncthreads();
}

__device__ __forceinline__ int tandem_selected(const int* sel, int topk) {
    int n = 0;
    while (n < topk && sel[n] >= 0) ++n;
    return n;
}

// Absorbed MQA over the FP8 (or f32) latent cache: q_abs = W_UK^T q_nope, p = softmax((q_abs . c +
// q_pe . k_pe) * scale) over the selected tokens, lat = sum p c, out = W_UV lat.
// Dynamic shared memory: (2 * rank + rd + topk) floats.
extern "C" __global__ void __launch_bounds__(256) tandem_mla_decode(
    const float* __restrict__ q, const float* __restrict__ w_uk_t, const float* __restrict__ w_uv,
    const int* __restrict__ sel_all, int topk, const int* __restrict__ block_table, int max_blocks,
    const u8* __restrict__ latent, int fp8, float* __restrict__ out, int heads, int nope, int rd, int rank,
    int vd, float scale) {
    extern __shared__ float sm[];
    __shared__ float red[32];
    float* q_abs = sm;
    float* q_pe = q_abs + rank;
    float* lat = q_pe + rd;
    float* p = lat + rank;
    const int h = blockIdx.x, r = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int qk = nope + rd;
    const float* qh = q + ((i64)r * heads + h) * qk;
    const float* wk = w_uk_t + (i64)h * rank * nope;
    for (int c = threadIdx.x; c < rank; c += blockDim.x) {
        float a = 0.0f;
        for (int d = 0; d < nope; ++d) a = __fmaf_rn(wk[(i64)c * nope + d], qh[d], a);
        q_abs[c] = a;
    }
    for (int i = threadIdx.x; i < rd; i += blockDim.x) q_pe[i] = qh[nope + i];
    const int* sel = sel_all + (i64)r * topk;
    const int n = tandem_selected(sel, topk);
    const int* table = block_table + (i64)r * max_blocks;
    __syncthreads();
    for (int i = warp; i < n; i += warps) {
        const int pos = sel[i];
        const i64 slot = (i64)table[pos / 64] * 64 + pos % 64;
        const u8* e = tandem_latent_entry(latent, slot, fp8, rank, rd);
        float a = 0.0f;
        for (int c = lane; c < rank; c += 32) a = __fmaf_rn(q_abs[c], tandem_latent_c(e, c, fp8, rank), a);
        for (int c = lane; c < rd; c += 32) a = __fmaf_rn(q_pe[c], tandem_latent_kpe(e, c, fp8, rank), a);
        a = tandem_warp_sum(a);
        if (lane == 0) p[i] = __fmul_rn(a, scale);
    }
    __syncthreads();
    tandem_softmax(p, n, red);
    for (int c = threadIdx.x; c < rank; c += blockDim.x) {
        float a = 0.0f;
        for (int i = 0; i < n; ++i) {
            const int pos = sel[i];
            const i64 slot = (i64)table[pos / 64] * 64 + pos % 64;
            a = __fmaf_rn(p[i], tandem_latent_c(tandem_latent_entry(latent, slot, fp8, rank, rd), c, fp8, rank), a);
        }
        lat[c] = a;
    }
    __syncthreads();
    const float* wv = w_uv + (i64)h * vd * rank;
    for (int d = warp; d < vd; d += warps) {
        float a = 0.0f;
        for (int c = lane; c < rank; c += 32) a = __fmaf_rn(wv[(i64)d * rank + c], lat[c], a);
        a = tandem_warp_sum(a);
        if (lane == 0) out[((i64)r * heads + h) * vd + d] = a;
    }
}

// The FP8 decode path's projections around engine/kernels/sparse_mla.cu (docs/model.md §2.2): the absorbed
// query qb[r, h] = bf16(W_UK^T[h] q_nope[r, h]) then bf16(q_pe[r, h]) (rank + rd values), and after the
// attention out[r, h] = W_UV[h] lat[r, h]. A CTA takes one head and up to MLA_PROJ_ROWS rows (the head's
// weights are read once for all of them); a warp computes MLA_PROJ_OUTS outputs at a time: lane l sums the
// inputs 4l..4l+3, 4l+128.. (FMA, in that order), then the warp's butterfly. A row's values do not depend
// on the rows it shares the CTA with (the CTA's row count only decides which sums are reduced).
#define MLA_PROJ_ROWS 16
#define MLA_PROJ_OUTS 4

// A weight value: f32, or bf16 where every value of the absorbed weights is exact in bf16 (an FP8
// checkpoint with power-of-two block scales: e4m3 times 2^k), which halves the bytes read and gives the
// same products.
__device__ __forceinline__ float tandem_wval(const float* w, i64 i) { return w[i]; }
__device__ __forceinline__ float tandem_wval(const u16* w, i64 i) { return tandem_bf16_val(w[i]); }

// Four consecutive weights at w + i (i a multiple of 4; rows of a multiple of 4 values: 8- or 16-byte loads).
__device__ __forceinline__ void tandem_wval4(const float* w, i64 i, float (&v)[4]) {
    const float4 q = *(const float4*)(w + i);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
}
__device__ __forceinline__ void tandem_wval4(const u16* w, i64 i, float (&v)[4]) {
    const uint2 q = *(const uint2*)(w + i);
    v[0] = __uint_as_float(q.x << 16), v[1] = __uint_as_float(q.x & 0xffff0000u);
    v[2] = __uint_as_float(q.y << 16), v[3] = __uint_as_float(q.y & 0xffff0000u);
}

// out(j, o) = sum_i w[o * in + i] * xs[j * in + i] for the CTA's nr rows (xs in shared memory) and outputs
// o < outs, handed to store(j, o, value) on lane 0.
template <typename W, typename Store>
__device__ __forceinline__ void mla_head_proj(const W* __restrict__ w, const float* xs, int in, int outs, int nr,
                                              Store store) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool vec = (in & 3) == 0;
    for (int o0 = warp * MLA_PROJ_OUTS; o0 < outs; o0 += WARPS * MLA_PROJ_OUTS) {
        float acc[MLA_PROJ_OUTS][MLA_PROJ_ROWS];
#pragma unroll
        for (int u = 0; u < MLA_PROJ_OUTS; ++u)
#pragma unroll
            for (int j = 0; j < MLA_PROJ_ROWS; ++j) acc[u][j] = 0.0f;
        for (int i0 = 4 * lane; i0 < in; i0 += 128) {
            float wv[MLA_PROJ_OUTS][4];
#pragma unroll
            for (int u = 0; u < MLA_PROJ_OUTS; ++u) {
                const int o = o0 + u;
                if (o < outs && vec) {
                    tandem_wval4(w, (i64)o * in + i0, wv[u]);
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e) wv[u][e] = o < outs && i0 + e < in ? tandem_wval(w, (i64)o * in + i0 + e) : 0.0f;
                }
            }
#pragma unroll
            for (int j = 0; j < MLA_PROJ_ROWS; ++j) {
                if (j >= nr) break;  // uniform
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = i0 + e < in ? xs[j * in + i0 + e] : 0.0f;
#pragma unroll
                    for (int u = 0; u < MLA_PROJ_OUTS; ++u) acc[u][j] = __fmaf_rn(wv[u][e], x, acc[u][j]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < MLA_PROJ_OUTS; ++u)
#pragma unroll
            for (int j = 0; j < MLA_PROJ_ROWS; ++j) {
                if (j >= nr) break;  // uniform
                const float a = tandem_warp_sum(acc[u][j]);
                if (lane == 0 && o0 + u < outs) store(j, o0 + u, a);
            }
    }
}

template <typename W>
__device__ __forceinline__ void mla_absorb_q_body(const float* __restrict__ q, const W* __restrict__ w_uk_t,
                                                  u16* __restrict__ qb, int rows, int heads, int nope, int rd,
                                                  int rank) {
    extern __shared__ float qs[];  // [MLA_PROJ_ROWS][nope]
    const int h = blockIdx.x, r0 = blockIdx.y * MLA_PROJ_ROWS;
    const int nr = min(MLA_PROJ_ROWS, rows - r0), qk = nope + rd;
    for (int i = threadIdx.x; i < nr * nope; i += blockDim.x)
        qs[i] = q[((i64)(r0 + i / nope) * heads + h) * qk + i % nope];
    for (int i = threadIdx.x; i < nr * rd; i += blockDim.x) {
        const i64 row = r0 + i / rd;
        qb[(row * heads + h) * (rank + rd) + rank + i % rd] = tandem_bf16(q[(row * heads + h) * qk + nope + i % rd]);
    }
    __syncthreads();
    mla_head_proj(w_uk_t + (i64)h * rank * nope, qs, nope, rank, nr, [&](int j, int c, float a) {
        qb[((i64)(r0 + j) * heads + h) * (rank + rd) + c] = tandem_bf16(a);
    });
}

template <typename W>
__device__ __forceinline__ void mla_up_v_body(const float* __restrict__ lat, const W* __restrict__ w_uv,
                                              float* __restrict__ out, int rows, int heads, int rank, int vd) {
    extern __shared__ float ls[];  // [MLA_PROJ_ROWS][rank]
    const int h = blockIdx.x, r0 = blockIdx.y * MLA_PROJ_ROWS;
    const int nr = min(MLA_PROJ_ROWS, rows - r0);
    for (int i = threadIdx.x; i < nr * rank; i += blockDim.x)
        ls[i] = lat[((i64)(r0 + i / rank) * heads + h) * rank + i % rank];
    __syncthreads();
    mla_head_proj(w_uv + (i64)h * vd * rank, ls, rank, vd, nr,
                  [&](int j, int d, float a) { out[((i64)(r0 + j) * heads + h) * vd + d] = a; });
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) tandem_mla_absorb_q(
    const float* __restrict__ q, const float* __restrict__ w_uk_t, u16* __restrict__ qb, int rows, int heads,
    int nope, int rd, int rank) {
    mla_absorb_q_body(q, w_uk_t, qb, rows, heads, nope, rd, rank);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) tandem_mla_absorb_q_bf16w(
    const float* __restrict__ q, const u16* __restrict__ w_uk_t, u16* __restrict__ qb, int rows, int heads,
    int nope, int rd, int rank) {
    mla_absorb_q_body(q, w_uk_t, qb, rows, heads, nope, rd, rank);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) tandem_mla_up_v(
    const float* __restrict__ lat, const float* __restrict__ w_uv, float* __restrict__ out, int rows, int heads,
    int rank, int vd) {
    mla_up_v_body(lat, w_uv, out, rows, heads, rank, vd);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) tandem_mla_up_v_bf16w(
    const float* __restrict__ lat, const u16* __restrict__ w_uv, float* __restrict__ out, int rows, int heads,
    int rank, int vd) {
    mla_up_v_body(lat, w_uv, out, rows, heads, rank, vd);
}

// MHA over decompressed keys and values: kv [ctx rows, heads, nope + vd] (kv_b of the cached latents),
// k_pe [ctx rows, rd]; row r's context starts at ctx row ctx0[r]. Dynamic shared memory: topk floats.
extern "C" __global__ void __launch_bounds__(256) tandem_mla_prefill(
    const float* __restrict__ q, const float* __restrict__ kv, const float* __restrict__ k_pe,
    const int* __restrict__ ctx0, const int* __restrict__ sel_all, int topk, float* __restrict__ out, int heads,
    int nope, int rd, int vd, float scale) {
    extern __shared__ float p[];
    __shared__ float red[32];
    const int h = blockIdx.x, r = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int qk = nope + rd, kvw = nope + vd;
    const float* qh = q + ((i64)r * heads + h) * qk;
    const int* sel = sel_all + (i64)r * topk;
    const int n = tandem_selected(sel, topk);
    const i64 base = ctx0[r];
    for (int i = warp; i < n; i += warps) {
        const i64 s = base + sel[i];
        const float* kr = kv + (s * heads + h) * kvw;
        const float* kp = k_pe + s * rd;
        float a = 0.0f;
        for (int d = lane; d < nope; d += 32) a = __fmaf_rn(qh[d], kr[d], a);
        for (int d = lane; d < rd; d += 32) a = __fmaf_rn(qh[nope + d], kp[d], a);
        a = tandem_warp_sum(a);
        if (lane == 0) p[i] = __fmul_rn(a, scale);
    }
    __syncthreads();
    tandem_softmax(p, n, red);
    for (int d = threadIdx.x; d < vd; d += blockDim.x) {
        float a = 0.0f;
        for (int i = 0; i < n; ++i) a = __fmaf_rn(p[i], kv[((base + sel[i]) * heads + h) * kvw + nope + d], a);
        out[((i64)r * heads + h) * vd + d] = a;
    }
}

// ---------------------------------------------------------------------------------------------------
// MoE (docs/model.md §2.4).

// engine::cpu::moe::ranks_before: a before b when larger (IEEE, -0 == +0, NaN last), ties lower index.
__device__ __forceinline__ bool tandem_ranks_before(float va, int a, float vb, int b) {
    const bool na = va != va, nb = vb != vb;
    if (na || nb) return !na && nb ? true : (na && nb ? a < b : false);
    if (va != vb) return va > vb;
    return a < b;
}

#define MAX_EXPERTS 512
#define MAX_GROUPS 64

#define ROUTE_MAX_K 32

// A before b in tandem_ranks_before's order, where an index < 0 is no candidate (after every candidate).
__device__ __forceinline__ bool route_better(float va, int a, float vb, int b) {
    if (b < 0) return a >= 0;
    if (a < 0) return false;
    return tandem_ranks_before(va, a, vb, b);
}

// Routing, one CTA per token, thread e for expert e (blockDim.x >= experts, a multiple of 32). Scores
// (sigmoid or softmax of the gate logits); selection scores add the correction bias; group-limited choice
// of topk_group groups (a group's score: its best, or with a bias its two best added), then the top k
// experts (engine::cpu::moe::route: ranks_before's order, ties to the lower index, NaN last); ids
// ascending, weights from the unbiased scores, normalized (summed in ascending id order) when `norm`, times
// `scaling`. The steps are the CPU's operations in the CPU's order (the softmax sum and the weight sum in
// ascending order on one thread, the choices by exact comparisons). The order is strict and total, so a
// choice by rank (a candidate is chosen when fewer than k candidates rank before it; a group when fewer than
// topk_group groups do) is the same set, in the same order, as choosing the best k times: the rank form runs
// every candidate's comparisons at once instead of k rounds of one warp's (60 us a call on an H100 at any
// batch). expf is within rounding of the CPU's exp, so the ids equal the CPU's wherever the scores do and the
// weights agree to rounding (engine/tests/gpu.rs).
extern "C" __global__ void __launch_bounds__(MAX_EXPERTS)
    tandem_route(const float* __restrict__ logits, const float* __restrict__ bias, int tokens, int experts, int n_group,
                 int topk_group, int k, int sigmoid_scores, int norm, float scaling, int* __restrict__ ids,
                 float* __restrict__ weights) {
    __shared__ float s_score[MAX_EXPERTS], s_sel[MAX_EXPERTS], s_gs[MAX_GROUPS];  // s_score: the softmax's
    __shared__ unsigned char s_ok[MAX_EXPERTS];
    __shared__ unsigned long long s_groups;
    __shared__ float s_sum;
    __shared__ int got_id[ROUTE_MAX_K];
    __shared__ float got_score[ROUTE_MAX_K];
    __shared__ float red[32];
    const int t = blockIdx.x, e = threadIdx.x;
    if (t >= tokens) return;  // the whole CTA
    const bool mine = e < experts;
    const float le = mine ? logits[(i64)t * experts + e] : 0.0f;
    float sc;
    if (sigmoid_scores) {
        sc = mine ? __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-le))) : 0.0f;
    } else {
        const float m = tandem_block_max(mine ? le : -__int_as_float(0x7f800000), red);
        const float ex = mine ? expf(__fsub_rn(le, m)) : 0.0f;
        if (mine) s_score[e] = ex;
        __syncthreads();
        // The sum in ascending expert order, on one thread (the CPU's order).
        if (e == 0) {
            float sum = 0.0f;
            for (int q = 0; q < experts; ++q) sum = __fadd_rn(sum, s_score[q]);
            s_sum = sum;
        }
        __syncthreads();
        sc = __fmul_rn(ex, __fdiv_rn(1.0f, s_sum));
    }
    const float sv = mine && bias != nullptr ? __fadd_rn(sc, bias[e]) : sc;
    const int per = n_group > 1 ? experts / n_group : experts;
    if (mine) s_sel[e] = sv;
    if (e == 0) s_groups = n_group > 1 ? 0ull : ~0ull;
    __syncthreads();
    if (n_group > 1) {
        // Group g's best two, in the candidates' order, by thread g.
        if (e < n_group) {
            float v1 = 0.0f, v2 = 0.0f;
            int i1 = -1, i2 = -1;
            for (int f = e * per; f < (e + 1) * per && f < experts; ++f) {
                if (route_better(s_sel[f], f, v1, i1)) {
                    v2 = v1;
                    i2 = i1;
                    v1 = s_sel[f];
                    i1 = f;
                } else if (route_better(s_sel[f], f, v2, i2)) {
                    v2 = s_sel[f];
                    i2 = f;
                }
            }
            s_gs[e] = bias != nullptr && i2 >= 0 ? __fadd_rn(v1, v2) : v1;
        }
        __syncthreads();
        // The topk_group best groups: those fewer than topk_group groups rank before.
        if (e < n_group) {
            int rank = 0;
            for (int h = 0; h < n_group; ++h) rank += route_better(s_gs[h], h, s_gs[e], e) ? 1 : 0;
            if (rank < topk_group) atomicOr(&s_groups, 1ull << e);
        }
        __syncthreads();
    }
    const unsigned long long groups = s_groups;
    const int ge = mine ? e / per : 0;
    const bool cand = mine && ge < 64 && ((groups >> ge) & 1ull);
    if (mine) s_ok[e] = cand ? 1 : 0;
    const int candidates = __syncthreads_count(cand);
    if (cand) {
        int rank = 0;
        for (int f = 0; f < experts; ++f) rank += (s_ok[f] && route_better(s_sel[f], f, sv, e)) ? 1 : 0;
        if (rank < k) {
            got_id[rank] = e;
            got_score[rank] = sc;
        }
    }
    __syncthreads();
    if (e != 0) return;
    const int found = candidates < k ? candidates : k;
    // Ascending ids (insertion sort), their unbiased scores summed in that order.
    for (int a = 1; a < found; ++a) {
        const int id = got_id[a];
        const float s = got_score[a];
        int b = a - 1;
        while (b >= 0 && got_id[b] > id) {
            got_id[b + 1] = got_id[b];
            got_score[b + 1] = got_score[b];
            --b;
        }
        got_id[b + 1] = id;
        got_score[b + 1] = s;
    }
    float sum = 0.0f;
    for (int a = 0; a < found; ++a) sum = __fadd_rn(sum, got_score[a]);
    for (int a = 0; a < k; ++a) {
        float w = a < found ? got_score[a] : 0.0f;
        if (norm && sum > 0.0f) w = __fdiv_rn(w, sum);
        ids[(i64)t * k + a] = a < found ? got_id[a] : -1;
        weights[(i64)t * k + a] = __fmul_rn(w, scaling);
    }
}

__device__ __forceinline__ float tandem_moe_pair_value(float v) { return v; }
__device__ __forceinline__ float tandem_moe_pair_value(u16 v) { return __uint_as_float((u32)v << 16); }

// out[t] = sum_j y[slot(t, j)] * w[t, j] (experts in ascending id order) + shared[t], where slot(t, j) is
// slot[t * k + j] for grouped expert rows (engine::cuda::moe; the combine rows of engine::cuda::ep;
// negative: routed to no expert), else t * k + j. The routed experts of an FP8 model give bf16 outputs
// (docs/model.md §2.4): the grouped and expert-parallel paths keep them in bf16, the per-pair path rounds its
// f32 ones (`round_bf16`); either way the same values add in the same order.
template <typename Y>
__device__ __forceinline__ void tandem_moe_combine_row(const Y* __restrict__ y, const float* __restrict__ w,
                                                       const float* __restrict__ shared, float* __restrict__ out,
                                                       int k, int hidden, const int* __restrict__ slot,
                                                       bool round_bf16) {
    const int t = blockIdx.x;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float a = 0.0f;
        for (int j = 0; j < k; ++j) {
            const i64 p = (i64)t * k + j;
            const i64 at = slot != nullptr ? (i64)slot[p] : p;
            if (at < 0) continue;
            float v = tandem_moe_pair_value(y[at * hidden + i]);
            if (round_bf16) v = tandem_moe_pair_value(tandem_bf16(v));
            a = __fadd_rn(a, __fmul_rn(v, w[p]));
        }
        if (shared != nullptr) a = __fadd_rn(a, shared[(i64)t * hidden + i]);
        out[(i64)t * hidden + i] = a;
    }
}

extern "C" __global__ void tandem_moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                              const float* __restrict__ shared, float* __restrict__ out, int k,
                                              int hidden, const int* __restrict__ slot, int round_bf16) {
    tandem_moe_combine_row(y, w, shared, out, k, hidden, slot, round_bf16 != 0);
}

// The bf16 form, 8 channels a thread (16-byte loads of each pair's row): grid (rows, ceil(hidden / 8 / 128)),
// 128 threads; each channel is the sum above, in the same order.
extern "C" __global__ void tandem_moe_combine_bf16(const u16* __restrict__ y, const float* __restrict__ w,
                                                   const float* __restrict__ shared, float* __restrict__ out, int k,
                                                   int hidden, const int* __restrict__ slot) {
    const int t = blockIdx.x, c0 = 8 * (blockIdx.y * blockDim.x + threadIdx.x);
    if (c0 >= hidden) return;
    if ((hidden & 7) != 0) {
        // Rows not a multiple of 8 channels: one channel at a time (no 16-byte alignment).
        for (int i = c0; i < min(c0 + 8, hidden); ++i) {
            float a = 0.0f;
            for (int j = 0; j < k; ++j) {
                const i64 p = (i64)t * k + j, at = slot != nullptr ? (i64)slot[p] : p;
                if (at >= 0) a = __fadd_rn(a, __fmul_rn(tandem_moe_pair_value(y[at * hidden + i]), w[p]));
            }
            if (shared != nullptr) a = __fadd_rn(a, shared[(i64)t * hidden + i]);
            out[(i64)t * hidden + i] = a;
        }
        return;
    }
    float a[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) a[u] = 0.0f;
    for (int j = 0; j < k; ++j) {
        const i64 p = (i64)t * k + j, at = slot != nullptr ? (i64)slot[p] : p;
        if (at < 0) continue;
        const uint4 v = *(const uint4*)(y + at * hidden + c0);
        const float wp = w[p];
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            a[2 * u] = __fadd_rn(a[2 * u], __fmul_rn(__uint_as_float(words[u] << 16), wp));
            a[2 * u + 1] = __fadd_rn(a[2 * u + 1], __fmul_rn(__uint_as_float(words[u] & 0xffff0000u), wp));
        }
    }
    float* o = out + (i64)t * hidden + c0;
    if (shared != nullptr) {
        const float* sh = shared + (i64)t * hidden + c0;
        const float4 s0 = *(const float4*)sh, s1 = *(const float4*)(sh + 4);
        const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int u = 0; u < 8; ++u) a[u] = __fadd_rn(a[u], sv[u]);
    }
    *(float4*)o = make_float4(a[0], a[1], a[2], a[3]);
    *(float4*)(o + 4) = make_float4(a[4], a[5], a[6], a[7]);
}
