// The indexer's top-k rule (docs/model.md §2.6) over rows of scores, identical to engine::cpu::topk::select:
// larger score first (IEEE, -0.0 == +0.0), equal scores -> the later position, NaN never selected, a row
// of at most k positions selects all of them without reading the scores, the selection written in
// ascending position and padded with -1.
//
// One CTA per row, so a row's result depends on nothing else in the batch. (The indexer scorer can count
// pass A's digits as it writes the scores; the kernel then starts from its counts.) Each score becomes an
// order-preserving 32-bit key (0 for NaN: no score maps to it). A radix select over 11 + 11 + 10 bits finds
// the k-th largest key T and how many keys equal to T are taken (`need`):
//   pass A (global) counts the top 11 bits of every key (warp-aggregated shared-memory atomics) and NaNs;
//   pass B (global) copies the keys in the threshold bucket into shared memory where they fit, and the
//           remaining two digits are counted there (else over the row again, filtered by prefix);
// the select stops as soon as the threshold bucket is taken whole. Keys above T are selected, and of the
// keys equal to T the latest `need` positions: the bucket is cut by position, which is the tie rule at no
// extra cost. The emission pass walks the row in CTA-wide tiles (each thread TOPK_UNROLL consecutive
// positions); a CTA scan of the threads' counts gives every selected position its output index, so the
// output comes out ascending. Every pass over the row issues TOPK_UNROLL loads per thread before using any.
#include "common.cuh"
#include "topk_key.cuh"

#define TOPK_THREADS 1024
#define TOPK_WARPS (TOPK_THREADS / 32)
#define TOPK_BINS TOPK_HIST_BINS
#define TOPK_UNROLL 8  // the emission's vector loads assume 8
#define TOPK_CAND 8192
#define TOPK_COPIES 8  // engine::cuda::topk::SHARED_BYTES counts 8
#define TOPK_NONE 0xffffffffu


// The keys of positions base + j * TOPK_THREADS + tid (j < TOPK_UNROLL) of a row of n >= 1 scores, `none`
// past its end. The loads are unconditional (clamped into the row) and all issued before any is used: a
// load behind a branch on the previous one's value would wait out the memory latency each time.
__device__ __forceinline__ void tandem_load_keys(const float* sc, int n, int base, u32 (&kv)[TOPK_UNROLL], u32 none) {
    float v[TOPK_UNROLL];
#pragma unroll
    for (int j = 0; j < TOPK_UNROLL; ++j) v[j] = sc[min(base + j * TOPK_THREADS + (int)threadIdx.x, n - 1)];
#pragma unroll
    for (int j = 0; j < TOPK_UNROLL; ++j)
        kv[j] = base + j * TOPK_THREADS + (int)threadIdx.x < n ? tandem_topk_key(v[j]) : none;
}

// Counts `d` (TOPK_NONE: nothing) into `hist`, one atomic per distinct digit of the warp.
__device__ __forceinline__ void tandem_count(u32* hist, u32 d) {
    const u32 peers = __match_any_sync(0xffffffffu, d);
    if (d != TOPK_NONE && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[d], (u32)__popc(peers));
}

// Inclusive scan of `v` over the CTA; `total` gets the sum. Uses `warps[TOPK_WARPS]` (free on return).
__device__ __forceinline__ u32 tandem_cta_scan(u32 v, u32* warps, u32& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 x = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) warps[warp] = x;
    __syncthreads();
    u32 before = 0, t = 0;
#pragma unroll
    for (int w = 0; w < TOPK_WARPS; ++w) {
        const u32 c = warps[w];
        before += w < warp ? c : 0;
        t += c;
    }
    __syncthreads();
    total = t;
    return before + x;
}

// The threshold digit of `hist` (`digits` bins): the digit d where the count of keys in higher digits is
// below `need` and reaches it with d's. Every thread gets d and the new need (need minus the keys above).
__device__ __forceinline__ u32 tandem_find_digit(const u32* hist, u32 digits, u32& need, u32* warps, u32* result) {
    // Thread t holds digits from the top: digits - 1 - 2t and digits - 2 - 2t.
    // Digit 0 and the need unchanged unless a thread finds the digit (always, when the counts hold `need`
    // keys; a histogram that does not is a caller's bug, and stays inside the arrays).
    if (threadIdx.x == 0) {
        result[0] = 0;
        result[1] = need;
    }
    const int d0 = (int)digits - 1 - 2 * (int)threadIdx.x, d1 = d0 - 1;
    const u32 h0 = d0 >= 0 ? hist[d0] : 0, h1 = d1 >= 0 ? hist[d1] : 0;
    u32 total;
    const u32 above = tandem_cta_scan(h0 + h1, warps, total) - (h0 + h1);
    if (above < need && above + h0 >= need) {
        result[0] = (u32)d0;
        result[1] = need - above;
    } else if (above + h0 < need && above + h0 + h1 >= need) {
        result[0] = (u32)d1;
        result[1] = need - above - h0;
    }
    __syncthreads();
    need = result[1];
    const u32 d = result[0];
    __syncthreads();  // `result` may be rewritten
    return d;
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS) tandem_topk_rule(
    const float* __restrict__ scores,  // row r at scores + r * row_stride
    i64 row_stride,
    const int* __restrict__ lengths,   // positions 0..lengths[r] of row r are candidates
    int k,
    int* __restrict__ out,             // [rows, k]: ascending positions, then -1
    int* __restrict__ counts,          // [rows]: positions selected
    int* __restrict__ nan_counts,      // [rows]: NaN scores left out
    const u32* __restrict__ pre_hist) {// null, or [rows][TOPK_HIST_WORDS]: pass A's counts, from the scorer
    // Dynamic shared memory: TOPK_COPIES histograms (pass A spreads its atomics over them; the first is the
    // histogram of every later step), then the candidates.
    extern __shared__ __align__(16) u32 dyn[];
    u32* const hist = dyn;
    u32* const cand = dyn + TOPK_COPIES * TOPK_BINS;
    __shared__ u32 warps[TOPK_WARPS];
    __shared__ u32 result[2];
    __shared__ u32 n_cand;
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
    for (int b = tid; b < TOPK_COPIES * TOPK_BINS; b += TOPK_THREADS) hist[b] = 0;
    if (tid == 0) n_cand = 0;
    __syncthreads();

    // Pass A: the top 11 bits of every key, and the NaNs (or the scorer's counts of them). A few bins take
    // most keys (scores cluster in a few binades, ReLU zeros in one), so warps count into TOPK_COPIES
    // histograms to spread the atomics.
    u32* const my_hist = hist + ((tid >> 5) % TOPK_COPIES) * TOPK_BINS;
    u32 nan_here = 0;
    const u32* pre = pre_hist ? pre_hist + (i64)row * TOPK_HIST_WORDS : nullptr;
    if (pre) {
        for (int b = tid; b < TOPK_BINS; b += TOPK_THREADS) hist[b] = pre[b];
        nan_here = tid == 0 ? pre[TOPK_HIST_NAN] : 0;
    }
    for (int base = 0; base < (pre ? 0 : n); base += TOPK_THREADS * TOPK_UNROLL) {
        u32 kv[TOPK_UNROLL];
        tandem_load_keys(sc, n, base, kv, TOPK_NONE);
#pragma unroll
        for (int j = 0; j < TOPK_UNROLL; ++j) {
            nan_here += kv[j] == 0 ? 1 : 0;
            tandem_count(my_hist, kv[j] == 0 || kv[j] == TOPK_NONE ? TOPK_NONE : kv[j] >> 21);
        }
    }
    __syncthreads();
    for (int b = tid; b < (pre ? 0 : TOPK_BINS); b += TOPK_THREADS) {
        u32 sum = hist[b];
#pragma unroll
        for (int c = 1; c < TOPK_COPIES; ++c) sum += hist[c * TOPK_BINS + b];
        hist[b] = sum;
    }
    u32 nan_total;
    tandem_cta_scan(nan_here, warps, nan_total);  // its barriers also publish `hist`
    const bool take_all = (u32)n - nan_total <= (u32)k;

    // The selected keys: bits under `mask` above `prefix`, or equal to it and not among the first
    // `first_taken` such keys in position order.
    u32 prefix = 0, mask = 0, first_taken = 0, need = (u32)k;
    if (!take_all) {
        u32 d = tandem_find_digit(hist, TOPK_BINS, need, warps, result);
        prefix = d << 21;
        mask = 0xffe00000u;
        u32 eq_total = hist[d];
        // Pass B: the threshold bucket's keys into shared memory, where they fit.
        const bool in_smem = eq_total != need && eq_total <= TOPK_CAND;
        const int ncand = (int)eq_total;  // the keys pass B collects (every later pass scans them all)
        if (in_smem) {
            for (int base = 0; base < n; base += TOPK_THREADS * TOPK_UNROLL) {
                u32 kv[TOPK_UNROLL];
                tandem_load_keys(sc, n, base, kv, 0);
                // One atomic per warp and batch: a single counter taking one per warp and key would
                // serialize the CTA on it.
                u32 ballots[TOPK_UNROLL], count = 0;
#pragma unroll
                for (int j = 0; j < TOPK_UNROLL; ++j) {
                    ballots[j] = __ballot_sync(0xffffffffu, kv[j] != 0 && (kv[j] & mask) == prefix);
                    count += (u32)__popc(ballots[j]);
                }
                u32 at = 0;
                if ((tid & 31) == 0 && count) at = atomicAdd(&n_cand, count);
                at = __shfl_sync(0xffffffffu, at, 0);
                const u32 lt = (1u << (tid & 31)) - 1u;
#pragma unroll
                for (int j = 0; j < TOPK_UNROLL; ++j) {
                    // Bounded: a histogram that disagrees with the scores (a caller's bug) must not write
                    // past the candidates.
                    const u32 c = at + __popc(ballots[j] & lt);
                    if (((ballots[j] >> (tid & 31)) & 1u) && c < TOPK_CAND) cand[c] = kv[j];
                    at += (u32)__popc(ballots[j]);
                }
            }
        }
        // The two lower digits, over the candidates or over the row.
        for (int pass = 1; pass < 3 && eq_total != need; ++pass) {
            const int shift = pass == 1 ? 10 : 0;
            const u32 digits = pass == 1 ? 2048u : 1024u;
            __syncthreads();  // the previous digit search has read `hist`
            for (int b = tid; b < TOPK_BINS; b += TOPK_THREADS) hist[b] = 0;
            __syncthreads();
            if (in_smem) {
                // A CTA-uniform loop: every lane takes part in the warp's match.
                for (int c0 = 0; c0 < ncand; c0 += TOPK_THREADS) {
                    const int c = c0 + tid;
                    const u32 key = c < ncand ? cand[c] : 0;
                    tandem_count(hist, key != 0 && (key & mask) == prefix ? (key >> shift) & (digits - 1) : TOPK_NONE);
                }
            } else {
                for (int base = 0; base < n; base += TOPK_THREADS * TOPK_UNROLL) {
                    u32 kv[TOPK_UNROLL];
                    tandem_load_keys(sc, n, base, kv, 0);
#pragma unroll
                    for (int j = 0; j < TOPK_UNROLL; ++j)
                        tandem_count(hist, kv[j] != 0 && (kv[j] & mask) == prefix ? (kv[j] >> shift) & (digits - 1) : TOPK_NONE);
                }
            }
            __syncthreads();
            d = tandem_find_digit(hist, digits, need, warps, result);
            prefix |= d << shift;
            mask |= (digits - 1) << shift;
            eq_total = hist[d];
        }
        first_taken = eq_total - need;  // keys of the bucket skipped: the earliest positions
    }

    // Emission in ascending position: tiles where each thread owns TOPK_UNROLL consecutive positions.
    u32 a_run = 0, e_run = 0;
    const bool aligned = (reinterpret_cast<unsigned long long>(sc) & 15) == 0;
    for (int base = 0; base < n; base += TOPK_THREADS * TOPK_UNROLL) {
        const int i0 = base + tid * TOPK_UNROLL;
        // Each thread's 8 consecutive scores: two 16-byte loads where the row is aligned (a warp then reads
        // 1 KiB contiguous), else unconditional scalar loads clamped into the row.
        float v[TOPK_UNROLL];
        if (aligned && i0 + TOPK_UNROLL <= n) {
            const float4 x0 = *reinterpret_cast<const float4*>(sc + i0);
            const float4 x1 = *reinterpret_cast<const float4*>(sc + i0 + 4);
            v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w, v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
        } else {
#pragma unroll
            for (int j = 0; j < TOPK_UNROLL; ++j) v[j] = sc[min(i0 + j, n - 1)];
        }
        u32 kv[TOPK_UNROLL];
#pragma unroll
        for (int j = 0; j < TOPK_UNROLL; ++j) kv[j] = i0 + j < n ? tandem_topk_key(v[j]) : 0;
        u32 fa = 0, fe = 0;
#pragma unroll
        for (int j = 0; j < TOPK_UNROLL; ++j) {
            if (kv[j] == 0) continue;
            const u32 m = kv[j] & mask;
            if (take_all || m > prefix) fa |= 1u << j;
            else if (m == prefix) fe |= 1u << j;
        }
        // Per tile at most TOPK_THREADS * TOPK_UNROLL < 2^16 of each: (above << 16 | equal) in one scan.
        const u32 mine = ((u32)__popc(fa) << 16) | (u32)__popc(fe);
        u32 tile;
        const u32 before = tandem_cta_scan(mine, warps, tile) - mine;
        u32 a_before = a_run + (before >> 16), e_before = e_run + (before & 0xffffu);
#pragma unroll
        for (int j = 0; j < TOPK_UNROLL; ++j) {
            // The index is below k by construction; the check keeps a broken invariant inside the row.
            if ((fa >> j) & 1u) {
                const u32 at = a_before + (e_before > first_taken ? e_before - first_taken : 0);
                if (at < (u32)k) o[at] = i0 + j;
                ++a_before;
            } else if ((fe >> j) & 1u) {
                const u32 at = a_before + e_before - first_taken;
                if (e_before >= first_taken && at < (u32)k) o[at] = i0 + j;
                ++e_before;
            }
        }
        a_run += tile >> 16;
        e_run += tile & 0xffffu;
    }
    const u32 total = take_all ? (u32)n - nan_total : (u32)k;
    for (int i = (int)total + tid; i < k; i += TOPK_THREADS) o[i] = -1;
    if (tid == 0) {
        counts[row] = (int)total;
        nan_counts[row] = (int)nan_total;
    }
}
