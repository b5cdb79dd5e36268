// Lightning-indexer scores over the paged FP8 key cache (docs/model.md §2.3, §4), decode and prefill alike:
//   I[r, s] = k_scale[s] * head_sum_h(w[r, h] * relu(q[r, h] . k[s]))      for s in 0..lengths[r]
// q: e4m3 codes [rows, heads, 128]; w: f32 head weights with every scale folded in; keys: the 8448-byte
// indexer blocks ([64 x 128 e4m3][64 x f32 scale]) found through a block table.
//
// Rows come in groups: up to IDX_MAX_Q consecutive rows that share one block table (a decode token and its
// MTP draft, or up to four prompt tokens of one prefill chunk), so a key block read from memory serves every
// query of the group. A CTA is one warpgroup; it owns IDX_BLOCKS_PER_CTA (8; 16 in a large launch for a
// group of several queries, or for single queries over tables of at least 1024 blocks) consecutive key
// blocks of one group. One thread streams them into shared memory as TMA boxes, two blocks in flight (one
// for groups of 4): the layer's region is a tensor map of 128-byte rows (a block is 66 of them: 64 keys,
// then 2 rows of scales), so a block is one box of 66 rows, stored in the 128-byte-swizzled K-major layout
// wgmma reads and counted on its stage's mbarrier. (The keys came in by 16-byte cp.async before, 5 per
// thread and block: their addresses, the swizzle and the waits were a third of the kernel's instructions.)
// Each query's q tile (64 heads x 128, zero heads past `heads`) is written once by the CTA's threads into
// the same swizzled layout. Per key block, four wgmma k-steps of m64n128k32 e4m3 for a pair of queries (their q tiles
// adjacent) or m64n64k32 for a single one (f32 accumulators: 64 tokens x 64 heads) give every q . k
// product; the epilogue applies ReLU and the head weights in registers and sums the heads in the fixed order
// of docs/model.md §2.3 (four interleaved partial sums, then a two-level butterfly), which the CPU backend's
// `engine::cpu::indexer::head_sum` repeats.
//
// Batch invariance: a query's products are per-element dot products of its q row and the key over the
// same four k-steps whichever group or batch it is in (pairs of queries share one m64n128 instruction, a
// single query takes m64n64: the tests check both give the same bits); which CTA scores a key (the split
// depends on the group's lengths, the table width and the launch's size) changes no score, since no score
// is combined across CTAs.
//
// Given a histogram buffer, the epilogue also counts each score's first radix digit (the top 11 bits of its
// order-preserving key, topk_key.cuh) for the top-k rule, which then skips its own first pass over the row:
// that pass is bound by shared-memory atomics, here it hides under the key blocks' memory time.
#include "common.cuh"
#include "wgmma.cuh"
#include "sync.cuh"
#include "topk_key.cuh"

#define IDX_DIM 128
#define IDX_BLOCK 64
#define IDX_HEADS 64
#define IDX_MAX_Q 4
#define IDX_BLOCKS_PER_CTA 8         // a CTA of a single query; the grid is sized by it
#define IDX_BLOCKS_PER_CTA_GROUP 16  // a CTA of a group of 2..4 queries (its q tiles staged once for more keys)
#define IDX_GROUP_SPAN_MIN_CTAS 1024 // ... in a launch of at least this many CTAs
#ifndef IDX_SINGLE_SPAN_MIN_BLOCKS
#define IDX_SINGLE_SPAN_MIN_BLOCKS 1024  // ... and for single queries where the table is this long (64K positions)
#endif
#ifndef IDX_STAGES
#define IDX_STAGES 3          // key stages of a launch whose groups have at most 3 rows
#endif
#ifndef IDX_STAGES_GROUP4
#define IDX_STAGES_GROUP4 2   // ... and of a launch with groups of 4: three CTAs an SM instead of two
#endif
// IDX_NO_COMPUTE=1 (timing only, bench/RESULTS.md): the key blocks are loaded but valid ones get no products,
// scores or counts, to measure the load pipeline alone. Never set in a build the engine uses.
#define IDX_THREADS 128
#define IDX_TILE (IDX_BLOCK * IDX_DIM)          // 8 KB: one block's keys or one query's q tile
#define IDX_BLOCK_ROWS (IDX_BLOCK + 2)          // a block as 128-byte rows of the tensor map: keys, then scales
#define IDX_BLOCK_BYTES (IDX_BLOCK_ROWS * 128)  // 8448
#define IDX_STAGE_BYTES 9216                    // a stage: one block, 1024-byte aligned for the swizzle
// A query's first-digit counts in shared memory: TOPK_HIST_WORDS (2048 digits + NaN) 16-bit counts, two a word.
#define IDX_HIST_WORDS ((TOPK_HIST_WORDS + 1) / 2)

// Dynamic shared memory (from a 1024-byte aligned base): `nst` stages, `max_q` q tiles, the stages'
// mbarriers, then the CTA's table entries, the queries' lengths and head weights, and their first-digit
// counts. engine::cuda::indexer::shared_bytes must match.
__device__ __forceinline__ u32 tandem_idx_stage(u32 base, int stage) { return base + stage * IDX_STAGE_BYTES; }
__device__ __forceinline__ u32 tandem_idx_q(u32 base, int nst, int j) { return base + nst * IDX_STAGE_BYTES + j * IDX_TILE; }

// Where a stage holds the scale of key `tok` (0..63): byte 8192 + 4 tok of the block, i.e. row 64 + tok / 32
// of the box, whose 16-byte chunks the 128-byte swizzle permuted by the row's index mod 8 (0 or 1).
__device__ __forceinline__ int tandem_idx_scale_at(int tok) {
    const int r = tok >> 5;
    return IDX_TILE + r * 128 + ((((tok & 31) >> 2) ^ r) << 4) + (tok & 3) * 4;
}

// One query's scores of one key block from its accumulators. d[4n + 0/1]: token tok, heads 8n + 2 t4 + 0/1;
// d[4n + 2/3]: token tok + 8, the same heads. ReLU and the head weights, each lane's partial sum in
// ascending head order (a fused multiply-add a term), then (P0 + P1) + (P2 + P3) across the token's four
// lanes (IEEE addition commutes exactly, so every lane gets the same bits), times the key's scale.
__device__ __forceinline__ void tandem_idx_epilogue(const float (&d)[32], const float* wj, int row, int len, int lb,
                                                    bool valid, int tok, int t4, float ks0, float ks1, float* scores,
                                                    i64 score_stride, u32* shist) {
    float p0 = 0.0f, p1 = 0.0f;
    const float2* w2 = reinterpret_cast<const float2*>(wj);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const float2 wv = w2[4 * n + t4];  // heads 8n + 2 t4 and 8n + 2 t4 + 1
        p0 = __fmaf_rn(fmaxf(d[4 * n + 0], 0.0f), wv.x, p0);
        p0 = __fmaf_rn(fmaxf(d[4 * n + 1], 0.0f), wv.y, p0);
        p1 = __fmaf_rn(fmaxf(d[4 * n + 2], 0.0f), wv.x, p1);
        p1 = __fmaf_rn(fmaxf(d[4 * n + 3], 0.0f), wv.y, p1);
    }
    p0 = __fadd_rn(p0, __shfl_xor_sync(0xffffffffu, p0, 1));
    p1 = __fadd_rn(p1, __shfl_xor_sync(0xffffffffu, p1, 1));
    p0 = __fadd_rn(p0, __shfl_xor_sync(0xffffffffu, p0, 2));
    p1 = __fadd_rn(p1, __shfl_xor_sync(0xffffffffu, p1, 2));
    const int s = lb * IDX_BLOCK + tok + 8 * t4;
    const bool writes = t4 < 2 && s < len;
    const float v = valid ? __fmul_rn(t4 == 0 ? p0 : p1, t4 == 0 ? ks0 : ks1) : __int_as_float(0x7fc00000);
    if (writes) scores[(i64)row * score_stride + s] = v;
    if (shist) {
        // The top-k's first radix digit of this score (or its NaN), counted in the CTA's histogram of this
        // query: one shared-memory atomic per score, two 16-bit counts per word (a CTA counts at most 1024
        // scores of a query). Integer sums: the order of arrival does not matter. (Aggregating a warp's equal
        // digits with match.any first was 9% slower at s_q = 2: the match's latency sits on every score.)
        const u32 key = tandem_topk_key(v);
        const u32 d = !writes ? 0xffffffffu : key == 0 ? TOPK_HIST_NAN : key >> 21;
        if (d != 0xffffffffu) atomicAdd(&shist[d >> 1], 1u << ((d & 1) * 16));
    }
}

extern "C" __global__ void __launch_bounds__(IDX_THREADS) tandem_indexer_scores(
    const __grid_constant__ TandemTensorMap keys,  // this layer's indexer region as [num_blocks x 66, 128] u8 rows
    const u8* __restrict__ q,            // [rows, heads, 128] e4m3
    const float* __restrict__ w,         // [rows, heads]
    int heads,                           // at most 64
    const int* __restrict__ block_table, // [rows, max_blocks]
    int max_blocks,
    int num_blocks,                      // blocks in the region: a table entry outside it is not read
    const int* __restrict__ lengths,     // [rows]
    const int* __restrict__ groups,      // [grid.y][2]: first row, rows (1..max_q) sharing the last row's table
    int max_q,                           // the largest group of the launch (sizes the shared memory)
    float* __restrict__ scores,          // [rows, score_stride]
    i64 score_stride,
    u32* __restrict__ hist) {            // null, or [rows][TOPK_HIST_WORDS] zeroed: the top-k's first pass
    extern __shared__ __align__(1024) u8 smem_raw[];
    const u32 raw = (u32)__cvta_generic_to_shared(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;
    u8* const gbase = smem_raw + (base - raw);
    // Groups of 4 keep two stages: with three, 79 KB of shared memory leaves room for two CTAs an SM, and
    // prefill (whose keys sit in the L2) ran 12-14% slower than with three CTAs of two stages.
    const int nst = max_q >= 4 ? IDX_STAGES_GROUP4 : IDX_STAGES;
    const u32 bars = base + nst * IDX_STAGE_BYTES + max_q * IDX_TILE;                          // [nst] u64
    int* const sphys = reinterpret_cast<int*>(gbase + (bars - base) + nst * 8);                // [16]: -1 = invalid
    int* const slen = sphys + IDX_BLOCKS_PER_CTA_GROUP;                                        // [IDX_MAX_Q]
    float* const wsm = reinterpret_cast<float*>(slen + IDX_MAX_Q);                             // [max_q][64]
    u32* const shist = reinterpret_cast<u32*>(wsm + max_q * IDX_HEADS);  // [max_q][IDX_HIST_WORDS] if hist

    const int row0 = groups[2 * blockIdx.y], nq = groups[2 * blockIdx.y + 1];
    // A group of several queries takes twice the key blocks per CTA where the launch has work for more than
    // a few waves (measured on the H100: MTP pairs 6-12% faster from 1024 CTAs up, prefill groups of four
    // 15-20%; below, fewer CTAs leave SMs idle and it is slower), and so does a single query over tables of
    // 64K positions or more (H200: 64 x 128K 7% faster; at 32K it was 2% slower). The grid is sized for 8,
    // so surplus CTAs leave at once. Which CTA scores a key changes no score (nothing is combined across
    // CTAs).
    const bool large = gridDim.x * gridDim.y >= IDX_GROUP_SPAN_MIN_CTAS;
    const int span = large && (nq >= 2 || max_blocks >= IDX_SINGLE_SPAN_MIN_BLOCKS) ? IDX_BLOCKS_PER_CTA_GROUP
                                                                                 : IDX_BLOCKS_PER_CTA;
    const int first = blockIdx.x * span;
    const int* table = block_table + (i64)(row0 + nq - 1) * max_blocks;
    // The CTA's table entries are read before the group's lengths are known (the table holds max_blocks
    // entries a row), so the two loads are in flight together: a CTA's start is on the stream's critical path.
    const int phys = threadIdx.x < span && first + (int)threadIdx.x < max_blocks ? table[first + threadIdx.x] : -1;
    int glen = 0;
    for (int j = 0; j < nq; ++j) glen = max(glen, (int)min((i64)lengths[row0 + j], score_stride));
    const int last = min(min(first + span, (glen + IDX_BLOCK - 1) / IDX_BLOCK), max_blocks);
    if (first >= last) return;
    const int nblk = last - first;

    // The CTA's table entries, checked: an entry outside the region (a caller's bug) reads block 0 instead
    // (the region holds at least one block) and its scores become NaN, which the top-k counts and, past k
    // positions, never selects.
    if (threadIdx.x < nblk) sphys[threadIdx.x] = phys >= 0 && phys < num_blocks ? phys : -1;
    if (threadIdx.x < nq) slen[threadIdx.x] = (int)min((i64)lengths[row0 + threadIdx.x], score_stride);
    if (threadIdx.x == 0) {
        asm volatile("prefetch.tensormap [%0];" ::"l"((unsigned long long)&keys) : "memory");
        for (int s = 0; s < nst; ++s) tandem_mbar_init(bars + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Block i of the CTA into stage i % nst: one box of 66 rows, 8448 bytes counted on its mbarrier.
    auto load = [&](int i, int stage) {
        const u32 bar = bars + 8 * stage;
        tandem_mbar_expect_tx(bar, IDX_BLOCK_BYTES);
        tandem_tma_2d(tandem_idx_stage(base, stage), &keys, 0, max(sphys[i], 0) * IDX_BLOCK_ROWS, bar);
    };
    if (threadIdx.x == 0)
        for (int i = 0; i < nst - 1 && i < nblk; ++i) load(i, i);

    // The group's q tiles (zero heads past `heads`) and head weights.
    for (int j = 0; j < nq; ++j) {
        const u8* qr = q + (i64)(row0 + j) * heads * IDX_DIM;
        u8* qt = gbase + (tandem_idx_q(base, nst, j) - base);
        for (int c = threadIdx.x; c < IDX_TILE / 16; c += IDX_THREADS) {
            const int h = c >> 3;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (h < heads) v = *reinterpret_cast<const uint4*>(qr + h * IDX_DIM + (c & 7) * 16);
            *reinterpret_cast<uint4*>(qt + tandem_sw128(h, c & 7)) = v;
        }
        for (int h = threadIdx.x; h < IDX_HEADS; h += IDX_THREADS)
            wsm[j * IDX_HEADS + h] = h < heads ? w[(i64)(row0 + j) * heads + h] : 0.0f;
        if (hist)
            for (int b = threadIdx.x; b < IDX_HIST_WORDS; b += IDX_THREADS) shist[j * IDX_HIST_WORDS + b] = 0;
    }
    // The q stores are generic-proxy writes; wgmma reads through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int tok = warp * 16 + g;  // this thread's tokens: tok and tok + 8
    const int sc0 = tandem_idx_scale_at(tok), sc1 = tandem_idx_scale_at(tok + 8);
    int stage = 0;
    u32 parity = 0;
    for (int it = 0; it < nblk; ++it) {
        // Every thread is done with iteration it - 1 (and at it = 0 the q tiles are in place), so its
        // stage may be refilled: block it + nst - 1 goes there.
        __syncthreads();
        if (threadIdx.x == 0 && it + nst - 1 < nblk) load(it + nst - 1, stage == 0 ? nst - 1 : stage - 1);
        tandem_mbar_wait(bars + 8 * stage, parity);
        const int lb = first + it;
        const bool valid = sphys[it] >= 0;
        const u8* st = gbase + (tandem_idx_stage(base, stage) - base);
        const float ks0 = *reinterpret_cast<const float*>(st + sc0), ks1 = *reinterpret_cast<const float*>(st + sc1);
        // The k-steps' descriptors as the first one plus the step's 32 bytes (the address field is bits 0-13 of
        // address >> 4, and no shared address comes near its top): 4 uniform instructions fewer per wgmma.
        const unsigned long long da = tandem_desc_sw128(tandem_idx_stage(base, stage));
        // Queries two at a time: one m64n128 chain over both q tiles (adjacent in shared memory, so they form
        // one 128-row B operand), or one m64n64 chain for the last odd query. A score's products come from
        // the same per-element dot product either way (tested: any grouping gives the same bits).
#if defined(IDX_NO_COMPUTE) && IDX_NO_COMPUTE
        if (!valid)  // timing only: the loads without the products
#endif
        for (int j = 0; j < nq; j += 2) {
            const unsigned long long db = tandem_desc_sw128(tandem_idx_q(base, nst, j));
            if (j + 1 < nq) {
                // No initial values: the first wgmma of a chain does not read its accumulators (scale-d 0),
                // and writing them here would make ptxas serialize the chain.
                float d[64];
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                for (int ks = 0; ks < IDX_DIM / 32; ++ks)
                    tandem_wgmma_64x128x32(d, da + 2 * ks, db + 2 * ks, ks);
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                float d0[32], d1[32];
#pragma unroll
                for (int i = 0; i < 32; ++i) d0[i] = d[i], d1[i] = d[32 + i];
                tandem_idx_epilogue(d0, wsm + j * IDX_HEADS, row0 + j, slen[j], lb, valid, tok, t4, ks0, ks1, scores,
                                    score_stride, hist ? shist + j * IDX_HIST_WORDS : nullptr);
                tandem_idx_epilogue(d1, wsm + (j + 1) * IDX_HEADS, row0 + j + 1, slen[j + 1], lb, valid, tok, t4, ks0,
                                    ks1, scores, score_stride, hist ? shist + (j + 1) * IDX_HIST_WORDS : nullptr);
            } else {
                float d0[32];
                asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                for (int ks = 0; ks < IDX_DIM / 32; ++ks)
                    tandem_wgmma_64x64x32(d0, da + 2 * ks, db + 2 * ks, ks);
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
                tandem_idx_epilogue(d0, wsm + j * IDX_HEADS, row0 + j, slen[j], lb, valid, tok, t4, ks0, ks1, scores,
                                    score_stride, hist ? shist + j * IDX_HIST_WORDS : nullptr);
            }
        }
        if (++stage == nst) stage = 0, parity ^= 1;
    }
    if (hist) {
        // The CTA's counts into the rows' histograms: one atomic per digit present, so a hot digit takes one
        // atomic per CTA rather than one per warp and key block.
        __syncthreads();
        for (int j = 0; j < nq; ++j) {
            u32* h = hist + (i64)(row0 + j) * TOPK_HIST_WORDS;
            const u32* sh = shist + j * IDX_HIST_WORDS;
            for (int b = threadIdx.x; b < IDX_HIST_WORDS; b += IDX_THREADS) {
                const u32 v = sh[b];
                if (v & 0xffffu) atomicAdd(&h[2 * b], v & 0xffffu);
                if (v >> 16) atomicAdd(&h[2 * b + 1], v >> 16);
            }
        }
    }
}
