// The sampler of engine::sampling for one logits row, one CTA per row: the same token as
// engine::sampling::sample on the same values, the raw logprobs, and the MTP draft (argmax + probability).
//
// Every step is the CPU's, in the CPU's arithmetic: the edits (min_tokens mask, logit_bias in order,
// repetition, frequency/presence) per touched token with the CPU's roundings (no FMA contraction: __f*_rn),
// z = l / T, log-softmax with the exponentials summed in f64, probabilities as f32, the top-k / top-p /
// min-p cuts over the order "larger log-probability first, equal: lower id", then the Philox4x32-10 +
// Gumbel race in f64. Selections are radix selects over order-preserving keys (no sort of the vocabulary).
// Top-p is the CPU's running f32 sum over that order: a fixed-point threshold search bounds how many of the
// largest probabilities can matter, those few are sorted (values only: equal values add the same) and one
// thread adds them exactly as the CPU does. Every reduction has a fixed order (integer sums and max are
// order-free; f64 sums go through a fixed butterfly), so a result depends on the row's values and the
// parameters only.
//
// Where the CPU's libm and the device's math can differ (exp, log: last bit), the result is the CPU's
// except at an exact boundary (engine::cuda::sample documents the guarantee).
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// The most top logprobs one call returns (one per thread in the final bitonic sort).
#define SAMPLE_MAX_TOP 1024

// Edit flags (engine::cuda::sample::Edits).
#define EDIT_MASK 1u
#define EDIT_SEEN 2u

// Words of `out` (engine::cuda::sample reads them): token, logprob bits, kept candidates, flags, top count,
// then (id, logprob bits) pairs.
#define OUT_TOKEN 0
#define OUT_LOGPROB 1
#define OUT_KEPT 2
#define OUT_FLAGS 3
#define OUT_TOP_COUNT 4
#define OUT_HEADER 8
// The top-p bound was too tight and the scan ran over every candidate (never expected: a diagnostic).
#define FLAG_TOP_P_WIDENED 1u
// No candidate had a positive probability (unreachable for a finite row maximum: a diagnostic).
#define FLAG_NO_CANDIDATE 2u

#define FULL_MASK 0xffffffffu
#define NO_ID 0x7fffffff

typedef unsigned long long u64;

__device__ __forceinline__ float tandem_neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ double tandem_neg_inf_d() { return __longlong_as_double(0xfff0000000000000LL); }

// The order of f32::total_cmp as an unsigned key (larger key = later in total order).
__device__ __forceinline__ u32 tandem_total_key(float x) {
    const u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Philox4x32-10 (engine::sampling::philox4x32): 32x32 -> 64-bit products as (__umulhi, low word).
__device__ __forceinline__ uint4 tandem_philox(uint4 c, uint2 k) {
    const u32 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k.x += W0;
            k.y += W1;
        }
        const u32 hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const u32 hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// engine::sampling::uniform: 53 bits at counter (token, position, purpose, 0), centred in their interval.
__device__ __forceinline__ double tandem_uniform(u64 seed, u32 position, u32 purpose, u32 token) {
    const uint4 r = tandem_philox(make_uint4(token, position, purpose, 0u), make_uint2((u32)seed, (u32)(seed >> 32)));
    const u64 bits = ((u64)r.x << 21) ^ ((u64)r.y >> 11);
    return ((double)bits + 0.5) * (1.0 / 9007199254740992.0);
}

struct SampleSmem {
    u32 hist[256];
    u64 sums[256];
    u32 base[256];
    u32 tile_total[256];
    union {
        u32 wcount[SAMPLE_WARPS][257];  // radix-sort ranks per warp and digit (padded: conflict-free columns)
        struct {
            u32 key[SAMPLE_MAX_TOP];
            u32 id[SAMPLE_MAX_TOP];
        } top;
    } u;
    double dred[SAMPLE_WARPS];
    float fred[SAMPLE_WARPS];
    int ired[SAMPLE_WARPS];
    u32 ured[SAMPLE_WARPS];
    u32 scan[SAMPLE_WARPS];
    u32 s_prefix, s_need, s_count, s_keep;
    int s_digit, s_cut;
    u64 s_need64;
};

// ---- Block reductions. Every thread gets the same bits: a warp butterfly is symmetric, and every warp
// ---- reduces the 32 partials in the same order. The leading barrier lets a reduction follow another.

struct TandemSum {
    template <class T>
    __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

// fmaxf ignores NaN, as f32::max does.
struct TandemMax {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// A warp butterfly: `v = op(v, the partner lane's v)` for partners 16, 8, 4, 2, 1.
template <class T, class Op>
__device__ __forceinline__ T tandem_warp_reduce(T v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ u32 tandem_warp_sum_u(u32 v) { return tandem_warp_reduce(v, TandemSum()); }

// Each warp reduces its lanes, then every warp reduces the per-warp partials in `red` (one per warp).
template <class T, class Op>
__device__ T tandem_block_reduce(T v, T* red, Op op) {
    v = tandem_warp_reduce(v, op);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    return tandem_warp_reduce(red[threadIdx.x & 31], op);
}

__device__ double tandem_block_sum(double v, SampleSmem& sh) { return tandem_block_reduce(v, sh.dred, TandemSum()); }

__device__ u32 tandem_block_sum_u(u32 v, SampleSmem& sh) { return tandem_block_reduce(v, sh.ured, TandemSum()); }

__device__ float tandem_block_max(float v, SampleSmem& sh) { return tandem_block_reduce(v, sh.fred, TandemMax()); }

// engine::sampling::argmax's order: NaN never wins, then the larger value, equal values: the lower id.
__device__ __forceinline__ void tandem_pick_better(float& v, int& i, float ov, int oi) {
    if (ov == ov && (v != v || ov > v || (ov == v && oi < i))) {
        v = ov;
        i = oi;
    }
}

// A (key, id) pair reduced over the warp by a butterfly, keeping the pair `pick` prefers: every lane gets it.
template <class T, class Pick>
__device__ __forceinline__ void tandem_warp_pick(T& k, int& i, Pick pick) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const T ok = __shfl_xor_sync(FULL_MASK, k, o);
        const int oi = __shfl_xor_sync(FULL_MASK, i, o);
        pick(k, i, ok, oi);
    }
}

// The same over the block, through the per-warp partials `kred` and `ired`; returns the id.
template <class T, class Pick>
__device__ int tandem_block_pick(T& k, int i, T* kred, int* ired, Pick pick) {
    tandem_warp_pick(k, i, pick);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) {
        kred[threadIdx.x >> 5] = k;
        ired[threadIdx.x >> 5] = i;
    }
    __syncthreads();
    k = kred[threadIdx.x & 31];
    i = ired[threadIdx.x & 31];
    tandem_warp_pick(k, i, pick);
    return i;
}

struct TandemPickBetter {
    __device__ __forceinline__ void operator()(float& v, int& i, float ov, int oi) const {
        tandem_pick_better(v, i, ov, oi);
    }
};

// The argmax of `v` over the block: its id (NO_ID when every value is NaN) and value.
__device__ int tandem_block_argmax(float& v, int i, SampleSmem& sh) {
    return tandem_block_pick(v, i, sh.fred, sh.ired, TandemPickBetter());
}

// The race's order: the larger key, equal keys: the lower id.
__device__ __forceinline__ void tandem_pick_race(double& k, int& i, double ok, int oi) {
    if (ok > k || (ok == k && oi < i)) {
        k = ok;
        i = oi;
    }
}

struct TandemPickRace {
    __device__ __forceinline__ void operator()(double& k, int& i, double ok, int oi) const {
        tandem_pick_race(k, i, ok, oi);
    }
};

__device__ int tandem_block_race(double k, int i, SampleSmem& sh) {
    return tandem_block_pick(k, i, sh.dred, sh.ired, TandemPickRace());
}

// Exclusive scan of one value per thread in thread order; `total` gets the sum.
__device__ u32 tandem_block_scan(u32 v, SampleSmem& sh, u32& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) sh.scan[warp] = x;
    __syncthreads();
    u32 w = sh.scan[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, w, o);
        if (lane >= o) w += y;
    }
    total = __shfl_sync(FULL_MASK, w, 31);
    const u32 warps_before = __shfl_sync(FULL_MASK, w, (warp + 31) & 31);
    return (warp > 0 ? warps_before : 0) + x - v;
}

// Called by one whole warp: of 256 bins (digit d holds the count or mass of the keys with that digit),
// the digit where the running total from digit 255 downward first reaches `need`, and `above` = the total
// of the digits above it. -1 when the bins hold less than `need`.
template <class V>
__device__ int tandem_find_digit(const V* bins, V need, V& above) {
    const int lane = threadIdx.x & 31;
    V own = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) own += bins[lane * 8 + j];
    V incl = own;  // sum over this lane and the lanes above it
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const V y = __shfl_down_sync(FULL_MASK, incl, o);
        if (lane + o < 32) incl += y;
    }
    const V higher = incl - own;
    const u32 hit = __ballot_sync(FULL_MASK, higher < need && need <= incl);
    if (hit == 0) {
        above = 0;
        return -1;
    }
    const int src = __ffs(hit) - 1;
    int b = -1;
    V a = higher;
    if (lane == src) {
        for (int j = 7; j >= 0; --j) {
            const V c = bins[lane * 8 + j];
            if (a + c >= need) {
                b = lane * 8 + j;
                break;
            }
            a += c;
        }
    }
    above = __shfl_sync(FULL_MASK, a, src);
    return __shfl_sync(FULL_MASK, b, src);
}

// The first `m` (1 <= m <= n) elements of 0..n in the order "larger key first, equal keys: lower id
// first": afterwards they are exactly the ids with key > T, or key == T and id <= cut.
template <class KeyOf>
__device__ void tandem_select_top(const KeyOf& key_of, int n, u32 m, SampleSmem& sh, u32& T, int& cut) {
    const int tid = threadIdx.x;
    u32 prefix = 0, mask = 0, need = m;
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();
        for (int i = tid; i < 256; i += SAMPLE_THREADS) sh.hist[i] = 0;
        __syncthreads();
        for (int i = tid; i < n; i += SAMPLE_THREADS) {
            const u32 k = key_of(i);
            if ((k & mask) == prefix) atomicAdd(&sh.hist[(k >> shift) & 0xffu], 1u);
        }
        __syncthreads();
        if (tid < 32) {
            u32 above;
            const int b = tandem_find_digit<u32>(sh.hist, need, above);
            if (tid == 0) {
                sh.s_prefix = prefix | ((u32)b << shift);
                sh.s_need = need - above;
            }
        }
        __syncthreads();
        prefix = sh.s_prefix;
        need = sh.s_need;
        mask |= 0xffu << shift;
    }
    // Of the keys equal to T, the `need` lowest ids: each thread owns a contiguous run of ids.
    const int chunk = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int lo = min(n, tid * chunk), hi = min(n, lo + chunk);
    u32 eq = 0;
    for (int i = lo; i < hi; ++i) eq += key_of(i) == prefix ? 1u : 0u;
    u32 total;
    const u32 before = tandem_block_scan(eq, sh, total);
    if (before < need && need <= before + eq) {
        u32 j = before;
        for (int i = lo; i < hi; ++i) {
            if (key_of(i) == prefix && ++j == need) {
                sh.s_cut = i;
                break;
            }
        }
    }
    __syncthreads();
    T = prefix;
    cut = sh.s_cut;
}

// How many of the largest probabilities it takes for their sum (fixed point, 2^-62: exact and order-free)
// to reach `target`: the count of p >= θ for the largest θ with sum(p >= θ) >= target. 0xffffffff when
// the whole row falls short.
__device__ u32 tandem_mass_count(const float* prob, int n, double target, SampleSmem& sh) {
    const int tid = threadIdx.x;
    const double scale = 4611686018427387904.0;  // 2^62: p <= 1 and the row's sum stay below 2^63
    u64 need = (u64)(target * scale);
    u32 prefix = 0, mask = 0, count = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        __syncthreads();
        for (int i = tid; i < 256; i += SAMPLE_THREADS) {
            sh.hist[i] = 0;
            sh.sums[i] = 0;
        }
        __syncthreads();
        for (int i = tid; i < n; i += SAMPLE_THREADS) {
            const float q = prob[i];
            const u32 k = __float_as_uint(q);  // q >= +0: the bits order as the values
            if ((k & mask) == prefix && k != 0) {
                const u32 d = (k >> shift) & 0xffu;
                atomicAdd(&sh.hist[d], 1u);
                atomicAdd(&sh.sums[d], __double2ull_rz((double)q * scale));
            }
        }
        __syncthreads();
        if (tid < 32) {
            u64 above;
            const int b = tandem_find_digit<u64>(sh.sums, need, above);
            u32 c = 0;  // elements in the digits above b
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int d = tid * 8 + j;
                if (d > b) c += sh.hist[d];
            }
            c = tandem_warp_sum_u(c);
            if (tid == 0) {
                sh.s_digit = b;
                sh.s_need64 = need - above;
                sh.s_count = c + (b >= 0 && shift == 0 ? sh.hist[b] : 0u);
            }
        }
        __syncthreads();
        const int b = sh.s_digit;
        if (b < 0) return 0xffffffffu;
        need = sh.s_need64;
        count += sh.s_count;
        prefix |= (u32)b << shift;
        mask |= 0xffu << shift;
    }
    return count;
}

// Sorts the `n` keys in `a` into descending order (LSD radix, 8-bit digits, stable ranks from
// __match_any_sync); `b` is scratch. Returns the buffer holding the result. A digit that every key shares
// is skipped.
__device__ u32* tandem_sort_desc(u32* a, u32* b, int n, SampleSmem& sh) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 lanes_below = (1u << lane) - 1u;
    if (n <= 1) return a;
    for (int i = tid; i < SAMPLE_WARPS * 257; i += SAMPLE_THREADS) (&sh.u.wcount[0][0])[i] = 0;
    for (int shift = 0; shift < 32; shift += 8) {
        __syncthreads();
        for (int i = tid; i < 256; i += SAMPLE_THREADS) sh.hist[i] = 0;
        __syncthreads();
        // Ascending order of the inverted key is descending order of the key.
        for (int i = tid; i < n; i += SAMPLE_THREADS) atomicAdd(&sh.hist[(~a[i] >> shift) & 0xffu], 1u);
        __syncthreads();
        if (sh.hist[(~a[0] >> shift) & 0xffu] == (u32)n) continue;
        if (tid < 32) {
            u32 own[8], s = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                own[j] = sh.hist[tid * 8 + j];
                s += own[j];
            }
            u32 incl = s;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 y = __shfl_up_sync(FULL_MASK, incl, o);
                if (tid >= o) incl += y;
            }
            u32 at = incl - s;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                sh.base[tid * 8 + j] = at;
                at += own[j];
            }
        }
        __syncthreads();
        for (int tile = 0; tile < n; tile += SAMPLE_THREADS) {
            const int i = tile + tid;
            const bool valid = i < n;
            const u32 key = valid ? a[i] : 0u;
            const u32 d = valid ? (~key >> shift) & 0xffu : 256u;
            const u32 peers = __match_any_sync(FULL_MASK, d);
            const u32 rank = __popc(peers & lanes_below);
            if (valid && rank == 0) sh.u.wcount[warp][d] = __popc(peers);
            __syncthreads();
            // Per digit, exclusive scan over the warps in warp order (warp w scans digits 8w..8w+7).
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int dd = warp * 8 + j;
                const u32 c = sh.u.wcount[lane][dd];
                u32 x = c;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const u32 y = __shfl_up_sync(FULL_MASK, x, o);
                    if (lane >= o) x += y;
                }
                sh.u.wcount[lane][dd] = x - c;
                if (lane == 31) sh.tile_total[dd] = x;
            }
            __syncthreads();
            if (valid) b[sh.base[d] + sh.u.wcount[warp][d] + rank] = key;
            __syncthreads();
            for (int k = tid; k < SAMPLE_WARPS * 257; k += SAMPLE_THREADS) (&sh.u.wcount[0][0])[k] = 0;
            if (tid < 256) sh.base[tid] += sh.tile_total[tid];
            __syncthreads();
        }
        u32* t = a;
        a = b;
        b = t;
    }
    __syncthreads();
    return a;
}

// The CPU's top-p cut over the first `ks` candidates in rank order (all with p > 0): their probabilities,
// sorted, summed in f32 one at a time until the sum reaches top_p. Returns how many were needed, or 0 when
// the sum of all `ks` stays below top_p.
template <class KeyOf>
__device__ u32 tandem_top_p_cut(const KeyOf& lp_key, const float* prob, int n, u32 ks, float top_p, u32* sort_a,
                                u32* sort_b, SampleSmem& sh) {
    const int tid = threadIdx.x;
    u32 T = 0;
    int cut = NO_ID;
    if (ks < (u32)n) tandem_select_top(lp_key, n, ks, sh, T, cut);
    __syncthreads();
    if (tid == 0) sh.s_count = 0;
    __syncthreads();
    for (int i = tid; i < n; i += SAMPLE_THREADS) {
        const u32 k = lp_key(i);
        if (ks >= (u32)n || k > T || (k == T && i <= cut)) sort_a[atomicAdd(&sh.s_count, 1u)] = __float_as_uint(prob[i]);
    }
    __syncthreads();
    const int m = (int)sh.s_count;  // == ks
    const u32* sorted = tandem_sort_desc(sort_a, sort_b, m, sh);
    if (tid == 0) {
        float cum = 0.0f;
        u32 keep = 0;
        for (int i = 0; i < m && keep == 0; i += 8) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = i + j < m ? __uint_as_float(sorted[i + j]) : 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (keep == 0 && i + j < m) {
                    cum = __fadd_rn(cum, v[j]);
                    if (cum >= top_p) keep = (u32)(i + j + 1);
                }
            }
        }
        sh.s_keep = keep;
    }
    __syncthreads();
    return sh.s_keep;
}

// One row's sample (each CTA of tandem_sample_rows).
__device__ __forceinline__ void tandem_sample_body(
    const float* __restrict__ row,    // [n] raw logits
    int n,
    const u32* __restrict__ edits,    // [n_edits][4]: token, flags, output count, end of its biases
    int n_edits,
    const float* __restrict__ bias,   // logit_bias values, grouped by token in request order
    float rep,                        // repetition penalty (EDIT_SEEN tokens)
    float frequency,                  // frequency and presence penalties (tokens with a count)
    float presence,
    int greedy,
    float temperature,
    int top_k,                        // <= 0: off
    float top_p,                      // off unless in (0, 1)
    float min_p,                      // off unless > 0
    u64 seed,
    u32 position,
    u32 purpose,
    int top_n,                        // < 0: no logprobs
    float* z,                         // [n] scratch: processed logits, then z = l / T
    float* prob,                      // [n] scratch: probabilities of the sampling distribution
    u32* sort_a,                      // [n] scratch
    u32* sort_b,                      // [n] scratch
    const u32* prev,                  // null, or the token an earlier launch sampled: one more output token
    u32* token_out,                   // null, or where the token also goes (a compact token array)
    u32* out) {                       // [OUT_HEADER + 2 * top_n]
    __shared__ SampleSmem sh;
    __shared__ int s_prev_found;
    const int tid = threadIdx.x;
    const float neg_inf = tandem_neg_inf();
    // `prev` joins the history as the last output token (the host counted it in min_tokens and the
    // position): seen for the repetition penalty, counted once more for frequency and presence, with the
    // CPU's conditions for each.
    const u32 pt = prev != nullptr ? *prev : 0xffffffffu;
    const bool seen_on = rep > 0.0f && rep != 1.0f;
    const bool count_on = frequency != 0.0f || presence != 0.0f;
    if (tid == 0) s_prev_found = 0;

    // processed_logits: the row, then each touched token's edits in the CPU's order.
    for (int i = tid; i < n; i += SAMPLE_THREADS) z[i] = row[i];
    __syncthreads();
    for (int e = tid; e < n_edits; e += SAMPLE_THREADS) {
        const u32 t = edits[4 * e], end = edits[4 * e + 3];
        u32 flags = edits[4 * e + 1], count = edits[4 * e + 2];
        if (t == pt) {
            s_prev_found = 1;
            if (seen_on) flags |= EDIT_SEEN;
            if (count_on) count += 1;
        }
        const u32 begin = e > 0 ? edits[4 * e - 1] : 0u;
        float v = row[t];
        if (flags & EDIT_MASK) v = neg_inf;
        for (u32 j = begin; j < end; ++j) v = __fadd_rn(v, bias[j]);
        if (flags & EDIT_SEEN) v = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
        if (count > 0) v = __fsub_rn(v, __fadd_rn(__fmul_rn(frequency, __uint2float_rn(count)), presence));
        z[t] = v;
    }
    __syncthreads();
    if (tid == 0 && !s_prev_found && pt < (u32)n && (seen_on || count_on)) {
        // `prev` touched by nothing else: its edits alone.
        float v = row[pt];
        if (seen_on) v = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
        if (count_on) v = __fsub_rn(v, __fadd_rn(__fmul_rn(frequency, 1.0f), presence));
        z[pt] = v;
    }
    __syncthreads();

    u32 token = 0, kept = 1, flags = 0;
    if (greedy) {
        float bv = __int_as_float(0x7fffffff);
        int bi = NO_ID;
        for (int i = tid; i < n; i += SAMPLE_THREADS) tandem_pick_better(bv, bi, z[i], i);
        bi = tandem_block_argmax(bv, bi, sh);
        token = bi == NO_ID ? 0u : (u32)bi;
    } else {
        float mx = neg_inf;
        for (int i = tid; i < n; i += SAMPLE_THREADS) {
            const float l = z[i];
            const float v = l != l ? neg_inf : __fdiv_rn(l, temperature);
            z[i] = v;
            mx = fmaxf(mx, v);
        }
        mx = tandem_block_max(mx, sh);
        if (mx == neg_inf) {
            // Every token masked: the CPU's fallback, the first of equal log-probabilities.
            token = 0;
        } else {
            double s = 0.0;
            for (int i = tid; i < n; i += SAMPLE_THREADS) s += exp((double)__fsub_rn(z[i], mx));
            s = tandem_block_sum(s, sh);
            const float lse = __fadd_rn(mx, (float)log(s));
            auto lp_key = [&](int i) { return tandem_total_key(__fsub_rn(z[i], lse)); };
            u32 npos = 0;
            float pmax = 0.0f;
            for (int i = tid; i < n; i += SAMPLE_THREADS) {
                const float q = (float)exp((double)__fsub_rn(z[i], lse));
                prob[i] = q;
                npos += q > 0.0f ? 1u : 0u;
                pmax = fmaxf(pmax, q);
            }
            npos = tandem_block_sum_u(npos, sh);
            pmax = tandem_block_max(pmax, sh);

            u32 keep = (u32)n;
            if (top_k > 0) keep = min(keep, (u32)top_k);
            if (top_p > 0.0f && top_p < 1.0f) {
                // The CPU's running f32 sum of k terms is within (k + 1) * 2^-24 (relative) of the exact
                // sum, and its probabilities within 2 ulp of ours: candidates beyond the point where our
                // exact mass reaches top_p with that margin cannot be needed.
                const u32 kmax = min(keep, npos);
                const double g = (double)(kmax + 4) * (1.0 / 16777216.0);
                const double target = (double)top_p * (1.0 + 3.0 * g) * (1.0 + 1e-5) + 1e-9;
                u32 ks = min(kmax, tandem_mass_count(prob, n, target, sh));
                for (;;) {
                    const u32 cut_keep = tandem_top_p_cut(lp_key, prob, n, ks, top_p, sort_a, sort_b, sh);
                    if (cut_keep > 0) {
                        keep = cut_keep;
                        break;
                    }
                    if (ks >= kmax) break;  // the sum never reaches top_p: no cut
                    ks = kmax;
                    flags |= FLAG_TOP_P_WIDENED;
                }
            }
            if (min_p > 0.0f) {
                const float floor = __fmul_rn(min_p, pmax);
                u32 c = 0;
                for (int i = tid; i < n; i += SAMPLE_THREADS) c += prob[i] >= floor ? 1u : 0u;
                c = tandem_block_sum_u(c, sh);
                keep = max(1u, min(keep, c));
            }

            // The race over the first `keep` in rank order with p > 0.
            u32 T = 0;
            int cut = NO_ID;
            const bool all = keep >= (u32)n;
            if (!all) tandem_select_top(lp_key, n, keep, sh, T, cut);
            double bk = tandem_neg_inf_d();
            int bi = NO_ID;
            u32 count = 0;
            for (int i = tid; i < n; i += SAMPLE_THREADS) {
                if (!all) {
                    const u32 k = lp_key(i);
                    if (k < T || (k == T && i > cut)) continue;
                }
                if (!(prob[i] > 0.0f)) continue;
                ++count;
                const double u = tandem_uniform(seed, position, purpose, (u32)i);
                tandem_pick_race(bk, bi, (double)z[i] - log(-log(u)), i);
            }
            bi = tandem_block_race(bk, bi, sh);
            count = tandem_block_sum_u(count, sh);
            kept = count;
            if (count == 0) flags |= FLAG_NO_CANDIDATE;
            token = count > 0 ? (u32)bi : 0u;
        }
    }

    // Logprobs of the raw distribution (logprobs_of).
    float logprob = 0.0f;
    u32 top_count = 0;
    if (top_n >= 0) {
        float mv = neg_inf;
        int mi = NO_ID;
        for (int i = tid; i < n; i += SAMPLE_THREADS) tandem_pick_better(mv, mi, row[i], i);
        mi = tandem_block_argmax(mv, mi, sh);
        const float m = mi == NO_ID ? neg_inf : mv;  // the largest non-NaN value
        const u32 want = min((u32)top_n, min((u32)n, (u32)SAMPLE_MAX_TOP));
        if (m == neg_inf) {
            // log_softmax is -inf everywhere: the top are the lowest ids.
            logprob = neg_inf;
            for (u32 i = tid; i < want; i += SAMPLE_THREADS) {
                out[OUT_HEADER + 2 * i] = i;
                out[OUT_HEADER + 2 * i + 1] = __float_as_uint(neg_inf);
            }
            top_count = want;
        } else {
            double s = 0.0;
            for (int i = tid; i < n; i += SAMPLE_THREADS) s += exp((double)__fsub_rn(row[i], m));
            s = tandem_block_sum(s, sh);
            const float lse = __fadd_rn(m, (float)log(s));  // NaN when the row holds a NaN, as on the CPU
            logprob = __fsub_rn(row[token], lse);
            if (want > 0) {
                auto raw_key = [&](int i) { return tandem_total_key(__fsub_rn(row[i], lse)); };
                u32 T = 0;
                int cut = NO_ID;
                if (want < (u32)n) tandem_select_top(raw_key, n, want, sh, T, cut);
                __syncthreads();
                if (tid == 0) sh.s_count = 0;
                sh.u.top.key[tid] = 0u;
                sh.u.top.id[tid] = 0xffffffffu;
                __syncthreads();
                for (int i = tid; i < n; i += SAMPLE_THREADS) {
                    const u32 k = raw_key(i);
                    if (want >= (u32)n || k > T || (k == T && i <= cut)) {
                        const u32 at = atomicAdd(&sh.s_count, 1u);
                        sh.u.top.key[at] = k;
                        sh.u.top.id[at] = (u32)i;
                    }
                }
                // Bitonic sort of the (at most 1024) members: larger key first, equal: lower id.
                for (int k = 2; k <= SAMPLE_MAX_TOP; k <<= 1) {
                    for (int j = k >> 1; j > 0; j >>= 1) {
                        __syncthreads();
                        const int p = tid ^ j;
                        if (p > tid) {
                            const u32 ka = sh.u.top.key[tid], kb = sh.u.top.key[p];
                            const u32 ia = sh.u.top.id[tid], ib = sh.u.top.id[p];
                            const bool a_first = ka > kb || (ka == kb && ia < ib);
                            if (((tid & k) == 0) != a_first) {
                                sh.u.top.key[tid] = kb;
                                sh.u.top.key[p] = ka;
                                sh.u.top.id[tid] = ib;
                                sh.u.top.id[p] = ia;
                            }
                        }
                    }
                }
                __syncthreads();
                if ((u32)tid < want) {
                    const u32 id = sh.u.top.id[tid];
                    out[OUT_HEADER + 2 * tid] = id;
                    out[OUT_HEADER + 2 * tid + 1] = __float_as_uint(__fsub_rn(row[id], lse));
                }
                top_count = want;
            }
        }
    }
    if (tid == 0) {
        if (token_out != nullptr) *token_out = token;
        out[OUT_TOKEN] = token;
        out[OUT_LOGPROB] = __float_as_uint(logprob);
        out[OUT_KEPT] = kept;
        out[OUT_FLAGS] = flags;
        out[OUT_TOP_COUNT] = top_count;
    }
}

// tandem_sample_body's arguments for one row of tandem_sample_rows (engine::cuda::sample::RowArgs: pointers and
// the seed first, then the 4-byte values; 144 bytes). n = 0: no row (a CUDA graph's padding), nothing written.
struct SampleRowArgs {
    const float* row;
    const u32* edits;
    const float* bias;
    float* z;
    float* prob;
    u32* sort_a;
    u32* sort_b;
    u32* out;
    const u32* prev;
    u32* token_out;
    u64 seed;
    int n, n_edits;
    float rep, frequency, presence;
    int greedy;
    float temperature;
    int top_k;
    float top_p, min_p;
    u32 position, purpose;
    int top_n;
    int expect;  // >= 0 (with prev): sample only where *prev == expect, otherwise write nothing
};

// Rows' samples, one CTA per row (args[b]): each row's result is its CTA's alone, whatever the other rows.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) tandem_sample_rows(const SampleRowArgs* __restrict__ args) {
    const SampleRowArgs a = args[blockIdx.x];
    if (a.n <= 0) return;
    if (a.prev != nullptr && a.expect >= 0 && *a.prev != (u32)a.expect) return;
    tandem_sample_body(a.row, a.n, a.edits, a.n_edits, a.bias, a.rep, a.frequency, a.presence, a.greedy,
                       a.temperature, a.top_k, a.top_p, a.min_p, a.seed, a.position, a.purpose, a.top_n, a.z, a.prob,
                       a.sort_a, a.sort_b, a.prev, a.token_out, a.out);
}

// The MTP drafts (CpuBackend::draft) of several rows, one CTA per row (rows[b] holds n values; only the first
// *count rows where count is not null): argmax of
// the row (NaN never, equal: lower id; 0 when every value is NaN) and its softmax probability. out[2b]: token,
// out[2b + 1]: probability bits. A row's result is its CTA's alone.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) tandem_draft_rows(const float* const* __restrict__ rows,
                                                                               int n, u32* out,
                                                                               const int* __restrict__ count) {
    __shared__ SampleSmem sh;
    const int tid = threadIdx.x;
    // `count` (null: every CTA): the rows in device memory (a CUDA graph's launch); the CTAs past it write nothing.
    if (count != nullptr && (int)blockIdx.x >= *count) return;
    const float* __restrict__ row = rows[blockIdx.x];
    out += 2 * blockIdx.x;
    const float neg_inf = tandem_neg_inf();
    float mv = __int_as_float(0x7fffffff);
    int mi = NO_ID;
    for (int i = tid; i < n; i += SAMPLE_THREADS) tandem_pick_better(mv, mi, row[i], i);
    mi = tandem_block_argmax(mv, mi, sh);
    const u32 token = mi == NO_ID ? 0u : (u32)mi;
    const float m = mi == NO_ID ? neg_inf : mv;
    float p = 0.0f;
    if (m != neg_inf) {
        double s = 0.0;
        for (int i = tid; i < n; i += SAMPLE_THREADS) s += exp((double)__fsub_rn(row[i], m));
        s = tandem_block_sum(s, sh);
        const float lse = __fadd_rn(m, (float)log(s));
        p = (float)exp((double)__fsub_rn(row[token], lse));
    }
    if (tid == 0) {
        out[0] = token;
        out[1] = __float_as_uint(p);
    }
}
