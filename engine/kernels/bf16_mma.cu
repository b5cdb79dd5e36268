// Products with bf16 weights on the tensor cores: y[b][m, c] = x[b][m / a_div] . w[b][c] for f32 activations,
// bf16 weights ([n, k], k contiguous) and f32 or bf16 output. It serves the checkpoint's bf16 linears (lm_head,
// the MTP head, eh_proj) and the absorbed MLA projections W_UK / W_UV, one head per batch entry
// (docs/model.md §2.1, "bf16 weights on the tensor cores").
//
// f32 activations on bf16 tensor cores: each activation is split into two bf16 values, hi = bf16(x) and
// lo = bf16(x - hi) (x - hi is exact in f32), so hi + lo carries 16 significant bits and differs from x by at
// most 2^-17 |x|. Products of bf16 values are exact in f32, so y is the f32 dot product of w and hi + lo up to
// the tensor cores' f32 accumulation. An m16 MMA tile holds 8 rows of x: rows 0-7 are their hi parts, rows
// 8-15 their lo parts, so a thread's accumulators c0/c1 (row g) and c2/c3 (row g + 8) are the hi and lo sums
// of the same output, added once at the end (hi + lo, in that order).
//
// Exactness: an output's value is the sequence of m16n8k16 steps over k in ascending order (k blocks of
// BMMA_K, then their four k16 steps), each taking the accumulator and the same 16 products whatever the other
// rows are; rows past the batch are zero-filled and only add zeros to their own accumulators. No split
// depends on the rows: a row's bits are the same in any batch and any row tile (tested).
//
// A CTA of 8 warps computes BMMA_ROWS rows x BMMA_N columns: warp w owns columns 16 w .. 16 w + 15 for all the
// CTA's rows (decode batches of a few rows keep every warp busy). Weights and activations stream through
// BMMA_STAGES cp.async stages; each stage's activations are split once by the whole CTA into a bf16 MMA
// layout (double-buffered; each thread splits the chunks it loaded), then read with ldmatrix as the weights
// are: one barrier per stage.
#include "common.cuh"

#define BMMA_THREADS 256
// (BMMA_ROWS and BMMA_STAGES can be overridden for timing experiments: bench/gpu/bf16_bench.py BF16_DEFINES.)
#ifndef BMMA_ROWS
#define BMMA_ROWS 32  // rows of x per CTA: 4 m16 tiles of 8 rows (hi) + 8 rows (lo)
#endif
#define BMMA_N 128    // output columns per CTA: 8 warps x 2 n8 tiles
#define BMMA_K 64     // channels per stage
#ifndef BMMA_STAGES
#define BMMA_STAGES 3
#endif
// Row pitches of the ldmatrix operands with 16 bytes of padding (144 bytes): the 8 row addresses of an
// ldmatrix fall on distinct banks. The staged activations are read row by row (no padding needed).
#define BMMA_W_PITCH (BMMA_K + 8)  // bf16
#define BMMA_X_PITCH BMMA_K        // f32
#define BMMA_A_PITCH (BMMA_K + 8)  // bf16
#define BMMA_W_BYTES (BMMA_N * BMMA_W_PITCH * 2)
#define BMMA_X_BYTES (BMMA_ROWS * BMMA_X_PITCH * 4)
#define BMMA_A_BYTES (2 * BMMA_ROWS * BMMA_A_PITCH * 2)
// Dynamic shared memory of a launch (engine::cuda::bf16_mma::SHARED_BYTES).
#define BMMA_SHARED_BYTES (BMMA_STAGES * (BMMA_W_BYTES + BMMA_X_BYTES) + 2 * BMMA_A_BYTES)

__device__ __forceinline__ u32 bmma_smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, zero-filled where `bytes` is 0 (a chunk past the matrix).
__device__ __forceinline__ void bmma_cp16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bmma_ldsm4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void bmma_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 -> bf16x2 (RNE), `a` in the low half.
__device__ __forceinline__ u32 bmma_bf16x2(float a, float b) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// The rest x - hi of an activation, 0 where hi is not finite (an infinite x, or one that rounds to infinity in
// bf16: hi alone carries it; a NaN x stays NaN through hi).
__device__ __forceinline__ float bmma_rest(float x, float h) { return isfinite(h) ? __fsub_rn(x, h) : 0.0f; }

// The hi and lo bf16 pairs of two activations.
__device__ __forceinline__ void bmma_split(float a, float b, u32& hi, u32& lo) {
    hi = bmma_bf16x2(a, b);
    lo = bmma_bf16x2(bmma_rest(a, __uint_as_float(hi << 16)), bmma_rest(b, __uint_as_float(hi & 0xffff0000u)));
}

extern "C" __global__ void __launch_bounds__(BMMA_THREADS, 2) tandem_gemm_bf16_mma(
    const float* __restrict__ x, i64 x_row, i64 x_batch, int a_div, const u16* __restrict__ w, i64 w_batch,
    void* __restrict__ y, i64 y_row, i64 y_batch, int y_bf16, const float* __restrict__ tail, i64 tail_row,
    i64 tail_batch, int tail_n, int rows, int n, int k, const int* __restrict__ rows_dev) {
    extern __shared__ __align__(128) u8 bmma_shared[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const i64 m0 = (i64)blockIdx.x * BMMA_ROWS;
    // A row count in device memory (a CUDA graph's launch over a variable number of rows, at most `rows`):
    // the CTAs past it leave at once; a row's result is the same whatever the count (rows are independent).
    if (rows_dev != nullptr) rows = min(rows, *rows_dev);
    if (m0 >= rows) return;
    const int n0 = blockIdx.y * BMMA_N, b = blockIdx.z;
    x += b * x_batch;
    w += b * w_batch;
    u8* const stages = bmma_shared;
    u8* const abuf = bmma_shared + BMMA_STAGES * (BMMA_W_BYTES + BMMA_X_BYTES);
    const int kt_n = (k + BMMA_K - 1) / BMMA_K;
    // Tiles of the CTA holding rows (uniform): 1 for a decode batch of up to 8 rows.
    const int tiles = (int)min((i64)(BMMA_ROWS / 8), (rows - m0 + 7) / 8);

    // Extra bf16 columns n .. n + tail_n of y copied from `tail` (the absorbed query's rope part), once per row.
    if (tail_n > 0 && blockIdx.y == 0) {
        u16* yb = (u16*)y + b * y_batch;
        for (int i = tid; i < BMMA_ROWS * tail_n; i += BMMA_THREADS) {
            const i64 m = m0 + i / tail_n;
            if (m < rows) yb[m * y_row + n + i % tail_n] = tandem_bf16(tail[b * tail_batch + m * tail_row + i % tail_n]);
        }
    }

    // Stage `slot` <- k block `kt`: weights [BMMA_N][BMMA_K] and activations [BMMA_ROWS][BMMA_K] (k is a
    // multiple of 8, so a 16-byte chunk is wholly inside or outside the matrices). A thread's chunks keep
    // their row and channel offset in every stage: their sources, destinations and row checks are set once.
#define BMMA_W_CHUNKS (BMMA_N * (BMMA_K / 8) / BMMA_THREADS)
#define BMMA_X_CHUNKS (BMMA_ROWS * (BMMA_K / 4) / BMMA_THREADS)
    const int wc = tid % (BMMA_K / 8), xc = tid % (BMMA_K / 4);
    const u16* w_src[BMMA_W_CHUNKS];
    const float* x_src[BMMA_X_CHUNKS];
    u32 w_dst[BMMA_W_CHUNKS], x_dst[BMMA_X_CHUNKS];
#pragma unroll
    for (int j = 0; j < BMMA_W_CHUNKS; ++j) {
        const int r = tid / (BMMA_K / 8) + j * (BMMA_THREADS / (BMMA_K / 8));
        w_src[j] = n0 + r < n ? w + (i64)(n0 + r) * k + 8 * wc : nullptr;
        w_dst[j] = bmma_smem(stages) + (r * BMMA_W_PITCH + 8 * wc) * 2;
    }
#pragma unroll
    for (int j = 0; j < BMMA_X_CHUNKS; ++j) {
        const int r = tid / (BMMA_K / 4) + j * (BMMA_THREADS / (BMMA_K / 4));
        x_src[j] = m0 + r < rows ? x + ((m0 + r) / a_div) * x_row + 4 * xc : nullptr;
        x_dst[j] = bmma_smem(stages) + BMMA_W_BYTES + (r * BMMA_X_PITCH + 4 * xc) * 4;
    }
    auto load = [&](int slot, int kt) {
        const int k0 = kt * BMMA_K;
        const u32 at = slot * (BMMA_W_BYTES + BMMA_X_BYTES);
        const bool w_in = k0 + 8 * wc < k, x_in = k0 + 4 * xc < k;
#pragma unroll
        for (int j = 0; j < BMMA_W_CHUNKS; ++j) {
            const bool ok = w_in && w_src[j] != nullptr;
            bmma_cp16(w_dst[j] + at, ok ? w_src[j] + k0 : w, ok ? 16 : 0);
        }
#pragma unroll
        for (int j = 0; j < BMMA_X_CHUNKS; ++j) {
            const bool ok = x_in && x_src[j] != nullptr;
            bmma_cp16(x_dst[j] + at, ok ? x_src[j] + k0 : x, ok ? 16 : 0);
        }
    };

    float acc[BMMA_ROWS / 8][2][4];
#pragma unroll
    for (int t = 0; t < BMMA_ROWS / 8; ++t)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[t][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < BMMA_STAGES - 1; ++s) {
        if (s < kt_n) load(s, s);
        asm volatile("cp.async.commit_group;");
    }
    // ldmatrix row addresses: weights, matrix q = lane / 8 is (n8 tile q / 2, k half q % 2) of the warp's
    // 16 columns; activations, matrix q is (row half q % 2, k half q / 2) of an m16 tile.
    const int q = lane >> 3, r8 = lane & 7;
    const u32 w_lane = ((16 * warp + 8 * (q >> 1) + r8) * BMMA_W_PITCH + 8 * (q & 1)) * 2;
    const u32 a_lane = ((8 * (q & 1) + r8) * BMMA_A_PITCH + 8 * (q >> 1)) * 2;
    for (int kt = 0; kt < kt_n; ++kt) {
        asm volatile("cp.async.wait_group %0;" ::"n"(BMMA_STAGES - 2) : "memory");
        const u8* ws = stages + (kt % BMMA_STAGES) * (BMMA_W_BYTES + BMMA_X_BYTES);
        const float* xs = (const float*)(ws + BMMA_W_BYTES);
        u8* ab = abuf + (kt & 1) * BMMA_A_BYTES;
        // Each thread splits the activation chunks it loaded (its own cp.async writes are visible to it after
        // the wait): real row r = 8 t + i goes to MMA rows 16 t + i (hi) and 16 t + 8 + i (lo). Split buffer
        // kt & 1 was last read by stage kt - 2, which every thread finished before the previous barrier.
#pragma unroll
        for (int j = 0; j < BMMA_X_CHUNKS; ++j) {
            const int r = tid / (BMMA_K / 4) + j * (BMMA_THREADS / (BMMA_K / 4));
            if (r >= tiles * 8) break;  // rows ascend with j
            const float4 v = *(const float4*)(xs + r * BMMA_X_PITCH + 4 * xc);
            uint2 hi, lo;
            bmma_split(v.x, v.y, hi.x, lo.x);
            bmma_split(v.z, v.w, hi.y, lo.y);
            const int mr = 16 * (r >> 3) + (r & 7);
            *(uint2*)(ab + (mr * BMMA_A_PITCH + 4 * xc) * 2) = hi;
            *(uint2*)(ab + ((mr + 8) * BMMA_A_PITCH + 4 * xc) * 2) = lo;
        }
        // Stage kt landed and is split for every thread; every thread finished stage kt - 1, whose slot the
        // next load takes.
        __syncthreads();
        if (kt + BMMA_STAGES - 1 < kt_n) load((kt + BMMA_STAGES - 1) % BMMA_STAGES, kt + BMMA_STAGES - 1);
        asm volatile("cp.async.commit_group;");
        const u32 w_base = bmma_smem(ws) + w_lane, a_base = bmma_smem(ab) + a_lane;
#pragma unroll
        for (int kk = 0; kk < BMMA_K / 16; ++kk) {
            u32 bf[4];
            bmma_ldsm4(bf, w_base + kk * 32);
#pragma unroll
            for (int t = 0; t < BMMA_ROWS / 8; ++t) {
                if (t >= tiles) break;  // uniform
                u32 af[4];
                bmma_ldsm4(af, a_base + t * 16 * BMMA_A_PITCH * 2 + kk * 32);
                bmma_mma(acc[t][0], af, bf[0], bf[1]);
                bmma_mma(acc[t][1], af, bf[2], bf[3]);
            }
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");

    const int g = lane >> 2, t4 = lane & 3;
    float* yf = (float*)y + b * y_batch;
    // Even strides from an aligned y: a thread's two neighbouring columns are one store (8 bytes of f32 or 4 of
    // bf16, rounded as tandem_bf16 rounds one value).
    const bool pairs = ((y_row | y_batch) & 1) == 0 && ((unsigned long long)y & 7) == 0;
    const bool pairs_bf16 = ((y_row | y_batch) & 1) == 0 && ((unsigned long long)y & 3) == 0;
    u16* yb = (u16*)y + b * y_batch;
#pragma unroll
    for (int t = 0; t < BMMA_ROWS / 8; ++t) {
        if (t >= tiles) break;
        const i64 m = m0 + 8 * t + g;
        if (m >= rows) continue;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int col = n0 + 16 * warp + 8 * j + 2 * t4;
            const float v0 = __fadd_rn(acc[t][j][0], acc[t][j][2]), v1 = __fadd_rn(acc[t][j][1], acc[t][j][3]);
            if (y_bf16 && pairs_bf16 && col + 1 < n) {
                *(u32*)(yb + m * y_row + col) = bmma_bf16x2(v0, v1);
            } else if (y_bf16) {
                if (col < n) yb[m * y_row + col] = tandem_bf16(v0);
                if (col + 1 < n) yb[m * y_row + col + 1] = tandem_bf16(v1);
            } else if (pairs && col + 1 < n) {
                *(float2*)(yf + m * y_row + col) = make_float2(v0, v1);
            } else {
                if (col < n) yf[m * y_row + col] = v0;
                if (col + 1 < n) yf[m * y_row + col + 1] = v1;
            }
        }
    }
}
