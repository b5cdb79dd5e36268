// The indexer's top-k rule (docs/model.md §2.6) over rows of scores, identical to engine::cpu::topk::select:
// larger score first (IEEE, -0.0 == +0.0), equal scores -> the later position, NaN never selected, a row
// of at most k positions selects all of them without reading the scores, the selection written in
// ascending position and padded with -1.
//
// One CTA per row, so a row's result depends on nothing else in the batch. Each score becomes an
// order-preserving 32-bit key; a 4-pass, 8-bit radix select finds the k-th largest key T and how many
// keys equal to T are needed (r). Keys > T are selected, and of the keys == T the r with the latest
// positions: the threshold bucket is cut by position, which is the tie rule at no extra cost. Each thread
// then owns a contiguous chunk of positions; block scans of its counts give every thread its output
// offset, so the output comes out in ascending position.
#include "common.cuh"

#define TOPK_THREADS 1024
#define TOPK_WARPS (TOPK_THREADS / 32)

// Order-preserving key of a score, or false for NaN. -0.0 maps to +0.0's key.
__device__ __forceinline__ bool tandem_score_key(float s, u32& key) {
    u32 b = __float_as_uint(s);
    if ((b & 0x7fffffffu) > 0x7f800000u) return false;  // NaN
    if (b == 0x80000000u) b = 0;                       // -0.0 == +0.0
    key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return true;
}

// Exclusive scan of one value per thread across the CTA; `total` gets the sum. Uses `sums[TOPK_WARPS]`.
__device__ __forceinline__ u32 tandem_block_scan(u32 v, u32* sums, u32& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        u32 w = lane < TOPK_WARPS ? sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        sums[lane] = w;
    }
    __syncthreads();
    const u32 before = (warp > 0 ? sums[warp - 1] : 0) + x - v;
    total = sums[TOPK_WARPS - 1];
    __syncthreads();  // `sums` may be reused by the next scan
    return before;
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS) tandem_topk_rule(
    const float* __restrict__ scores,  // row r at scores + r * row_stride
    i64 row_stride,
    const int* __restrict__ lengths,   // positions 0..lengths[r] of row r are candidates
    int k,
    int* __restrict__ out,             // [rows, k]: ascending positions, then -1
    int* __restrict__ counts,          // [rows]: positions selected
    int* __restrict__ nan_counts) {    // [rows]: NaN scores left out
    __shared__ u32 hist[256];
    __shared__ u32 sums[TOPK_WARPS];
    __shared__ u32 s_prefix, s_need;
    const int row = blockIdx.x, tid = threadIdx.x;
    const int n = max(0, (int)min((i64)lengths[row], row_stride));
    const float* sc = scores + (i64)row * row_stride;
    int* o = out + (i64)row * k;

    if (n <= k) {
        for (int i = tid; i < k; i += TOPK_THREADS) o[i] = i < n ? i : -1;
        if (tid == 0) {
            counts[row] = n;
            nan_counts[row] = 0;
        }
        return;
    }

    u32 nan_here = 0, nan_total;
    for (int i = tid; i < n; i += TOPK_THREADS) {
        u32 key;
        nan_here += tandem_score_key(sc[i], key) ? 0 : 1;
    }
    tandem_block_scan(nan_here, sums, nan_total);
    const u32 valid = (u32)n - nan_total;
    const bool take_all = valid <= (u32)k;

    // Radix select: after the passes, `prefix` is the k-th largest key and `need` how many keys equal to
    // it are selected.
    u32 prefix = 0, mask = 0, need = (u32)k;
    if (!take_all) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += TOPK_THREADS) hist[i] = 0;
            __syncthreads();
            for (int i = tid; i < n; i += TOPK_THREADS) {
                u32 key;
                if (tandem_score_key(sc[i], key) && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xff], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                u32 above = 0;
                int b = 255;
                for (; b > 0; --b) {
                    if (above + hist[b] >= need) break;
                    above += hist[b];
                }
                s_need = need - above;
                s_prefix = prefix | ((u32)b << shift);
            }
            __syncthreads();
            need = s_need;
            prefix = s_prefix;
            mask |= 0xffu << shift;
        }
    }

    // Emit in ascending position: each thread owns positions [lo, hi).
    const int chunk = (n + TOPK_THREADS - 1) / TOPK_THREADS;
    const int lo = min(n, tid * chunk), hi = min(n, lo + chunk);
    u32 sel = 0, eq = 0;
    for (int i = lo; i < hi; ++i) {
        u32 key;
        if (!tandem_score_key(sc[i], key)) continue;
        if (take_all || key > prefix) ++sel;
        else if (key == prefix) ++eq;
    }
    u32 eq_total, sel_total;
    const u32 eq_before = tandem_block_scan(eq, sums, eq_total);
    const u32 sel_before = tandem_block_scan(sel, sums, sel_total);
    // Of the keys equal to the threshold, the last `need` in position order are selected.
    const u32 first_taken = take_all ? 0 : eq_total - need;
    u32 at = sel_before + (eq_before > first_taken ? eq_before - first_taken : 0);
    u32 e = eq_before;
    for (int i = lo; i < hi; ++i) {
        u32 key;
        if (!tandem_score_key(sc[i], key)) continue;
        if (take_all || key > prefix) {
            o[at++] = i;
        } else if (key == prefix) {
            if (e >= first_taken) o[at++] = i;
            ++e;
        }
    }
    const u32 total = take_all ? valid : (u32)k;
    for (int i = (int)total + tid; i < k; i += TOPK_THREADS) o[i] = -1;
    if (tid == 0) {
        counts[row] = (int)total;
        nan_counts[row] = (int)nan_total;
    }
}
