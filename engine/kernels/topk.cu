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
//
// The split form, for batches of few rows (where one CTA per row leaves most SMs idle and a row's passes are
// bound by one SM): four launches over per-row plan records (TOPK_SPLIT_WORDS words each):
//   plan     (a CTA per row)   the threshold digit from the histogram, as above; a row that takes everything,
//                              takes its threshold bucket whole, or whose bucket holds at most TOPK_SPLIT_CAP
//                              keys is left to the split kernels, any other row is finished here;
//   scan     (a CTA per slice of TOPK_SLICE positions)  counts the slice's keys above the bucket and appends
//                              the bucket's positions to the row's candidates;
//   resolve  (a CTA per row)   the two lower digits over the candidates (in shared memory), then each
//                              slice's first output index and how many threshold keys it leaves out (the
//                              row's earliest: the tie rule), the count and the -1 padding;
//   emit     (a CTA per slice) the slice's selected positions from its first output index, ascending.
// Both forms give the same selections: the rule decides every position exactly.
#include "common.cuh"
#include "topk_key.cuh"

#define TOPK_THREADS 1024
#define TOPK_WARPS (TOPK_THREADS / 32)
#define TOPK_BINS TOPK_HIST_BINS
#define TOPK_UNROLL 8  // the emission's vector loads assume 8
#define TOPK_CAND 8192
#define TOPK_COPIES 8  // engine::cuda::topk::SHARED_BYTES counts 8
#define TOPK_NONE 0xffffffffu

// The split form (see the header): per row a plan record of TOPK_SPLIT_WORDS words in global memory.
#define TOPK_SLICE 4096          // positions per slice CTA
#define TOPK_SPLIT_THREADS 256   // threads of a slice CTA: 16 positions each
#define TOPK_MAX_SLICES 64       // engine::cuda::topk::MAX_SPLIT_STRIDE = 64 x 4096
#define TOPK_SPLIT_CAP 16384     // candidates a row may collect for the split form
#define TOPK_M_MODE 0            // 1: the split kernels finish the row; 0: done (the plan kernel did it all)
#define TOPK_M_DIGIT 1           // the threshold's top 11 bits
#define TOPK_M_NEED 2            // keys still needed from that bucket
#define TOPK_M_TAKE_ALL 3        // every non-NaN position is selected
#define TOPK_M_NAN 4             // NaN scores of the row
#define TOPK_M_NCAND 5           // candidates collected (atomic)
#define TOPK_M_EQ 6              // keys in the threshold bucket
#define TOPK_M_PREFIX 7          // the resolved threshold: bits under MASK (the rule of the single form)
#define TOPK_M_MASK 8
#define TOPK_M_ABOVE 16                                   // [slices]: keys of the slice above the bucket
#define TOPK_M_OFF (TOPK_M_ABOVE + TOPK_MAX_SLICES)       // [slices]: the slice's first output index
#define TOPK_M_SKIP (TOPK_M_OFF + TOPK_MAX_SLICES)        // [slices]: threshold keys of the slice left out
#define TOPK_M_CAND (TOPK_M_SKIP + TOPK_MAX_SLICES)       // [TOPK_SPLIT_CAP]: the bucket's positions
#define TOPK_SPLIT_WORDS (TOPK_M_CAND + TOPK_SPLIT_CAP)   // engine::cuda::topk::SPLIT_WORDS


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

// Inclusive scan of `v` over a CTA of WARPS warps; `total` gets the sum. Uses `warps[WARPS]` (free on return).
template <int WARPS = TOPK_WARPS>
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
    for (int w = 0; w < WARPS; ++w) {
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

// Counts the digit at `shift` (`digits` bins) of the candidate keys whose bits under `mask` equal `prefix`
// into `hist` (zeroed here; the caller's barrier publishes it). A CTA-uniform loop: every lane takes part in
// the warp's match.
__device__ __forceinline__ void tandem_count_candidates(const u32* cand, int ncand, u32* hist, u32 mask, u32 prefix,
                                                        int shift, u32 digits) {
    __syncthreads();  // the previous digit search has read `hist`
    for (int b = threadIdx.x; b < TOPK_BINS; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int c0 = 0; c0 < ncand; c0 += blockDim.x) {
        const int c = c0 + threadIdx.x;
        const u32 key = c < ncand ? cand[c] : 0;
        tandem_count(hist, key != 0 && (key & mask) == prefix ? (key >> shift) & (digits - 1) : TOPK_NONE);
    }
}

__device__ __forceinline__ void tandem_topk_plan(u32* meta, u32 d, u32 need, u32 take_all, u32 nan_total,
                                                 u32 eq_total) {
    meta[TOPK_M_DIGIT] = d;
    meta[TOPK_M_NEED] = need;
    meta[TOPK_M_TAKE_ALL] = take_all;
    meta[TOPK_M_NAN] = nan_total;
    meta[TOPK_M_NCAND] = 0;
    meta[TOPK_M_EQ] = eq_total;
    meta[TOPK_M_MODE] = 1;
}

// One tile of an emission pass: the selected positions among this thread's N consecutive keys `kv` (0: not a
// candidate) from position i0, written in ascending order across the CTA (WARPS warps). A key is selected when
// its bits under `mask` are above `prefix` (every key when take_all), or equal to it and not among the first
// `skip` such keys; `a_run` / `e_run` count the keys of each kind in the CTA's earlier tiles and `off` is the
// first output index. Returns the tile's counts (above << 16 | equal: each under 2^16 per tile).
template <int N, int WARPS>
__device__ __forceinline__ u32 tandem_emit_tile(const u32 (&kv)[N], int i0, bool take_all, u32 mask, u32 prefix,
                                                u32 a_run, u32 e_run, u32 skip, u32 off, int* o, int k, u32* warps) {
    u32 fa = 0, fe = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        if (kv[j] == 0) continue;
        const u32 m = kv[j] & mask;
        if (take_all || m > prefix) fa |= 1u << j;
        else if (m == prefix) fe |= 1u << j;
    }
    const u32 mine = ((u32)__popc(fa) << 16) | (u32)__popc(fe);
    u32 tile;
    const u32 before = tandem_cta_scan<WARPS>(mine, warps, tile) - mine;
    u32 a_before = a_run + (before >> 16), e_before = e_run + (before & 0xffffu);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        // The index is below k by construction; the check keeps a broken invariant inside the row.
        if ((fa >> j) & 1u) {
            const u32 at = off + a_before + (e_before > skip ? e_before - skip : 0);
            if (at < (u32)k) o[at] = i0 + j;
            ++a_before;
        } else if ((fe >> j) & 1u) {
            const u32 at = off + a_before + e_before - skip;
            if (e_before >= skip && at < (u32)k) o[at] = i0 + j;
            ++e_before;
        }
    }
    return tile;
}

// The whole rule for one row (the CTA's blockIdx.x). PLAN (the split form's first step, see below): a row
// whose threshold bucket fits TOPK_SPLIT_CAP candidates (or that takes everything, or its bucket whole) only
// gets its plan written to `meta` and is finished by the split kernels; every other row is done here.
template <bool PLAN>
__device__ __forceinline__ void tandem_topk_body(
    const float* __restrict__ scores,  // row r at scores + r * row_stride
    i64 row_stride,
    const int* __restrict__ lengths,   // positions 0..lengths[r] of row r are candidates
    int k,
    int* __restrict__ out,             // [rows, k]: ascending positions, then -1
    int* __restrict__ counts,          // [rows]: positions selected
    int* __restrict__ nan_counts,      // [rows]: NaN scores left out
    const u32* __restrict__ pre_hist,  // null, or [rows][TOPK_HIST_WORDS]: pass A's counts, from the scorer
    u32* __restrict__ meta_all) {      // PLAN: [rows][TOPK_SPLIT_WORDS]
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

    u32* const meta = PLAN ? meta_all + (i64)row * TOPK_SPLIT_WORDS : nullptr;
    if (n <= k) {
        for (int i = tid; i < k; i += TOPK_THREADS) o[i] = i < n ? i : -1;
        if (tid == 0) {
            counts[row] = n;
            nan_counts[row] = 0;
            if (PLAN) meta[TOPK_M_MODE] = 0;
        }
        return;
    }
    const u32* pre = pre_hist ? pre_hist + (i64)row * TOPK_HIST_WORDS : nullptr;
    // With the scorer's counts only the first histogram is used, and it is overwritten below.
    for (int b = tid; b < (pre ? 0 : TOPK_COPIES * TOPK_BINS); b += TOPK_THREADS) hist[b] = 0;
    if (tid == 0) n_cand = 0;
    __syncthreads();

    // Pass A: the top 11 bits of every key, and the NaNs (or the scorer's counts of them). A few bins take
    // most keys (scores cluster in a few binades, ReLU zeros in one), so warps count into TOPK_COPIES
    // histograms to spread the atomics.
    u32* const my_hist = hist + ((tid >> 5) % TOPK_COPIES) * TOPK_BINS;
    u32 nan_here = 0;
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
    if (PLAN && take_all) {
        if (tid == 0) tandem_topk_plan(meta, 0, 0, 1, nan_total, 0);
        return;
    }

    // The selected keys: bits under `mask` above `prefix`, or equal to it and not among the first
    // `first_taken` such keys in position order.
    u32 prefix = 0, mask = 0, first_taken = 0, need = (u32)k;
    if (!take_all) {
        u32 d = tandem_find_digit(hist, TOPK_BINS, need, warps, result);
        prefix = d << 21;
        mask = 0xffe00000u;
        u32 eq_total = hist[d];
        if (PLAN && (eq_total == need || eq_total <= TOPK_SPLIT_CAP)) {
            if (tid == 0) tandem_topk_plan(meta, d, need, 0, nan_total, eq_total);
            return;
        }
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
            if (in_smem) {
                tandem_count_candidates(cand, ncand, hist, mask, prefix, shift, digits);
            } else {
                __syncthreads();  // the previous digit search has read `hist`
                for (int b = tid; b < TOPK_BINS; b += TOPK_THREADS) hist[b] = 0;
                __syncthreads();
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
        const u32 tile = tandem_emit_tile<TOPK_UNROLL, TOPK_WARPS>(kv, i0, take_all, mask, prefix, a_run, e_run,
                                                                    first_taken, 0, o, k, warps);
        a_run += tile >> 16;
        e_run += tile & 0xffffu;
    }
    const u32 total = take_all ? (u32)n - nan_total : (u32)k;
    for (int i = (int)total + tid; i < k; i += TOPK_THREADS) o[i] = -1;
    if (tid == 0) {
        counts[row] = (int)total;
        nan_counts[row] = (int)nan_total;
        if (PLAN) meta[TOPK_M_MODE] = 0;
    }
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS) tandem_topk_rule(
    const float* __restrict__ scores, i64 row_stride, const int* __restrict__ lengths, int k, int* __restrict__ out,
    int* __restrict__ counts, int* __restrict__ nan_counts, const u32* __restrict__ pre_hist) {
    tandem_topk_body<false>(scores, row_stride, lengths, k, out, counts, nan_counts, pre_hist, nullptr);
}

// ----- The split form -----
// Step 1 (one CTA a row): the threshold bucket from the histogram; rows the split form cannot take (a bucket
// over TOPK_SPLIT_CAP keys) are finished here by the single form's passes.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) tandem_topk_split_plan(
    const float* __restrict__ scores, i64 row_stride, const int* __restrict__ lengths, int k, int* __restrict__ out,
    int* __restrict__ counts, int* __restrict__ nan_counts, const u32* __restrict__ pre_hist, u32* __restrict__ meta) {
    tandem_topk_body<true>(scores, row_stride, lengths, k, out, counts, nan_counts, pre_hist, meta);
}

// The keys of a slice CTA's thread: 16 positions i0 + 0..15 (`none` past the row's end). Four 16-byte loads
// where the row is aligned and the positions inside it, else unconditional scalar loads clamped into the row.
__device__ __forceinline__ void tandem_slice_keys(const float* sc, int n, int i0, bool aligned, u32 (&kv)[16],
                                                  u32 none) {
    float v[16];
    if (aligned && i0 + 16 <= n) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float4 x = *reinterpret_cast<const float4*>(sc + i0 + 4 * q);
            v[4 * q] = x.x, v[4 * q + 1] = x.y, v[4 * q + 2] = x.z, v[4 * q + 3] = x.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = sc[min(i0 + j, n - 1)];
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) kv[j] = i0 + j < n ? tandem_topk_key(v[j]) : none;
}

// Step 2 (one CTA a slice of TOPK_SLICE positions): counts the slice's keys above the threshold bucket (all
// of its non-NaN keys when the row takes everything; the bucket too when it is taken whole) and appends the
// positions in the bucket to the row's candidates (in any order: only their set is used).
extern "C" __global__ void __launch_bounds__(TOPK_SPLIT_THREADS) tandem_topk_split_scan(
    const float* __restrict__ scores, i64 row_stride, const int* __restrict__ lengths, u32* __restrict__ meta_all) {
    __shared__ u32 warps[TOPK_SPLIT_THREADS / 32];
    const int row = blockIdx.y, slice = blockIdx.x, tid = threadIdx.x;
    u32* const meta = meta_all + (i64)row * TOPK_SPLIT_WORDS;
    const int n = max(0, (int)min((i64)lengths[row], row_stride));
    const int start = slice * TOPK_SLICE;
    if (meta[TOPK_M_MODE] != 1 || start >= n) return;
    const bool take_all = meta[TOPK_M_TAKE_ALL] != 0;
    const u32 d = meta[TOPK_M_DIGIT];
    const bool whole = !take_all && meta[TOPK_M_EQ] == meta[TOPK_M_NEED];
    const bool collect = !take_all && !whole;
    const float* sc = scores + (i64)row * row_stride;
    const int i0 = start + tid * 16;
    u32 kv[16];
    tandem_slice_keys(sc, n, i0, (reinterpret_cast<unsigned long long>(sc) & 15) == 0, kv, 0);
    u32 above = 0, ballots[16], count = 0;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const u32 dj = kv[j] >> 21;
        above += kv[j] != 0 && (take_all || dj > d || (whole && dj == d)) ? 1 : 0;
        ballots[j] = __ballot_sync(0xffffffffu, collect && kv[j] != 0 && dj == d);
        count += (u32)__popc(ballots[j]);
    }
    u32 at = 0;
    if ((tid & 31) == 0 && count) at = atomicAdd(&meta[TOPK_M_NCAND], count);
    at = __shfl_sync(0xffffffffu, at, 0);
    const u32 lt = (1u << (tid & 31)) - 1u;
    // Bucket-ordered slots: lane l's key j goes after the warp's keys of earlier j and earlier lanes.
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const u32 c = at + __popc(ballots[j] & lt);
        if (((ballots[j] >> (tid & 31)) & 1u) && c < TOPK_SPLIT_CAP) meta[TOPK_M_CAND + c] = (u32)(i0 + j);
        at += (u32)__popc(ballots[j]);
    }
    u32 total;
    tandem_cta_scan<TOPK_SPLIT_THREADS / 32>(above, warps, total);
    if (tid == 0) meta[TOPK_M_ABOVE + slice] = total;
}

// Step 3 (one CTA a row): the threshold inside the bucket from the candidates (the single form's two lower
// digits), then each slice's first output index and how many threshold keys it leaves out (the earliest
// positions of the row's threshold keys are the ones left out: the tie rule), the count and the -1 padding.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) tandem_topk_split_resolve(
    const float* __restrict__ scores, i64 row_stride, const int* __restrict__ lengths, int k, int* __restrict__ out,
    int* __restrict__ counts, int* __restrict__ nan_counts, u32* __restrict__ meta_all) {
    extern __shared__ __align__(16) u32 dyn[];
    u32* const hist = dyn;                        // TOPK_BINS
    u32* const ckey = dyn + TOPK_BINS;            // TOPK_SPLIT_CAP
    u32* const cpos = ckey + TOPK_SPLIT_CAP;      // TOPK_SPLIT_CAP
    __shared__ u32 warps[TOPK_WARPS], result[2], gt[TOPK_MAX_SLICES], eqs[TOPK_MAX_SLICES];
    const int row = blockIdx.x, tid = threadIdx.x;
    u32* const meta = meta_all + (i64)row * TOPK_SPLIT_WORDS;
    if (meta[TOPK_M_MODE] != 1) return;
    const int n = max(0, (int)min((i64)lengths[row], row_stride));
    const int slices = (n + TOPK_SLICE - 1) / TOPK_SLICE;
    const float* sc = scores + (i64)row * row_stride;
    const bool take_all = meta[TOPK_M_TAKE_ALL] != 0;
    const u32 d = meta[TOPK_M_DIGIT], nan_total = meta[TOPK_M_NAN];
    u32 need = meta[TOPK_M_NEED], eq_total = meta[TOPK_M_EQ];
    for (int i = tid; i < TOPK_MAX_SLICES; i += TOPK_THREADS) gt[i] = eqs[i] = 0;
    u32 prefix = 0, mask = 0, first_taken = 0;
    if (!take_all) {
        prefix = d << 21;
        mask = 0xffe00000u;
        if (eq_total != need) {
            // Bounded: a histogram that disagrees with the scores (a caller's bug) stays inside the arrays.
            const int ncand = (int)min(meta[TOPK_M_NCAND], (u32)TOPK_SPLIT_CAP);
            for (int c = tid; c < ncand; c += TOPK_THREADS) {
                const u32 p = min(meta[TOPK_M_CAND + c], (u32)(n - 1));
                cpos[c] = p;
                ckey[c] = tandem_topk_key(sc[p]);
            }
            for (int pass = 1; pass < 3 && eq_total != need; ++pass) {
                const int shift = pass == 1 ? 10 : 0;
                const u32 digits = pass == 1 ? 2048u : 1024u;
                tandem_count_candidates(ckey, ncand, hist, mask, prefix, shift, digits);
                __syncthreads();
                const u32 dd = tandem_find_digit(hist, digits, need, warps, result);
                prefix |= dd << shift;
                mask |= (digits - 1) << shift;
                eq_total = hist[dd];
            }
            first_taken = eq_total - need;
            __syncthreads();  // gt/eqs zeroed
            // The bucket's keys above the threshold and at it, by slice.
            for (int c = tid; c < ncand; c += TOPK_THREADS) {
                const u32 m = ckey[c] & mask;
                if (m > prefix) atomicAdd(&gt[cpos[c] / TOPK_SLICE], 1u);
                else if (m == prefix) atomicAdd(&eqs[cpos[c] / TOPK_SLICE], 1u);
            }
        }
    }
    __syncthreads();
    if (tid < 32) {
        // Warp 0 scans the slices (two a lane): threshold keys before each slice, then positions taken
        // before it. All loads issue before the scans.
        const int s0 = 2 * tid, s1 = s0 + 1;
        const u32 e0 = s0 < slices ? eqs[s0] : 0u, e1 = s1 < slices ? eqs[s1] : 0u;
        const u32 a0 = s0 < slices ? meta[TOPK_M_ABOVE + s0] + gt[s0] : 0u;
        const u32 a1 = s1 < slices ? meta[TOPK_M_ABOVE + s1] + gt[s1] : 0u;
        auto scan = [&](u32 v) {  // exclusive prefix over the warp
            u32 x = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 y = __shfl_up_sync(0xffffffffu, x, o);
                if (tid >= o) x += y;
            }
            return x - v;
        };
        const u32 eb0 = scan(e0 + e1), eb1 = eb0 + e0;
        const u32 k0 = first_taken > eb0 ? min(first_taken - eb0, e0) : 0u;
        const u32 k1 = first_taken > eb1 ? min(first_taken - eb1, e1) : 0u;
        const u32 t0 = a0 + e0 - k0, t1 = a1 + e1 - k1;
        const u32 off0 = scan(t0 + t1), off1 = off0 + t0;
        if (s0 < slices) meta[TOPK_M_OFF + s0] = off0, meta[TOPK_M_SKIP + s0] = k0;
        if (s1 < slices) meta[TOPK_M_OFF + s1] = off1, meta[TOPK_M_SKIP + s1] = k1;
        const u32 total = __shfl_sync(0xffffffffu, off1 + t1, 31);
        if (tid == 0) {
            meta[TOPK_M_PREFIX] = prefix;
            meta[TOPK_M_MASK] = mask;
            result[0] = min(total, (u32)k);
            counts[row] = (int)min(total, (u32)k);
            nan_counts[row] = (int)nan_total;
        }
    }
    __syncthreads();
    int* o = out + (i64)row * k;
    for (int i = (int)result[0] + tid; i < k; i += TOPK_THREADS) o[i] = -1;
}

// Step 4 (one CTA a slice): the slice's selected positions, ascending, from its first output index: keys
// above the threshold, and those at it past the slice's first `skip`.
extern "C" __global__ void __launch_bounds__(TOPK_SPLIT_THREADS) tandem_topk_split_emit(
    const float* __restrict__ scores, i64 row_stride, const int* __restrict__ lengths, int k, int* __restrict__ out,
    const u32* __restrict__ meta_all) {
    __shared__ u32 warps[TOPK_SPLIT_THREADS / 32];
    const int row = blockIdx.y, slice = blockIdx.x, tid = threadIdx.x;
    const u32* const meta = meta_all + (i64)row * TOPK_SPLIT_WORDS;
    const int n = max(0, (int)min((i64)lengths[row], row_stride));
    const int start = slice * TOPK_SLICE;
    if (meta[TOPK_M_MODE] != 1 || start >= n) return;
    const bool take_all = meta[TOPK_M_TAKE_ALL] != 0;
    const u32 prefix = meta[TOPK_M_PREFIX], mask = meta[TOPK_M_MASK];
    const u32 off = meta[TOPK_M_OFF + slice], skip = meta[TOPK_M_SKIP + slice];
    const float* sc = scores + (i64)row * row_stride;
    const int i0 = start + tid * 16;
    u32 kv[16];
    tandem_slice_keys(sc, n, i0, (reinterpret_cast<unsigned long long>(sc) & 15) == 0, kv, 0);
    tandem_emit_tile<16, TOPK_SPLIT_THREADS / 32>(kv, i0, take_all, mask, prefix, 0, 0, skip, off,
                                                  out + (i64)row * k, k, warps);
}
