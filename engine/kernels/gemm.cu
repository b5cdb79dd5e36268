// FP8 block-scaled GEMM on Hopper (docs/model.md §2.1):
//   y[m, c] = sum over K blocks kb of (qa[m, kb] . w[c, kb]) * sa[m, kb] * ws[c / 128, kb]
// qa: e4m3 activations [rows, kpad] with one f32 scale per row per 128 channels, kept transposed
// (sa_t [kpad / 128, scale_ld], tandem_act_quant with a scale stride); w: e4m3 weights [n, kpad] with 128 x 128
// block scales ws [ceil(n / 128), scale_cols]; kpad a multiple of 128 with zero codes past K. y: f32 or bf16
// [rows, n]. The three operands arrive as TMA tensor maps (engine::cuda::gemm::TensorMap).
//
// Persistent clusters of two CTAs, at most one CTA per SM. A cluster walks its units u = cluster,
// cluster + clusters, ...; a unit is a cluster tile (one TM-row block of output rows, TM 128 or 64 below, and
// two adjacent BN-column tiles, one per CTA; BN 128, or 64 where 128-wide tiles would leave SMs idle), or one
// chain of one (below). Each CTA has a producer warpgroup and a consumer warpgroup per 64 rows (three with
// 128-row tiles). The producer: one thread issues, per K block of 128, TMA loads of its half of the shared A
// tile [TM/2 x 128] multicast into both CTAs (the pair reads A
// from L2 once), of its own B tile [BN x 128] (both straight into the 128-byte-swizzled layout wgmma
// reads) and of the block's row scales, STAGES blocks in flight through full/empty mbarriers (a stage
// is free when the consumers of both CTAs are done with it; the scales come as a box of GEMM_SA_BOX from the
// tile's first row rounded down to a multiple of 4). The other two
// are consumers of 64 rows each: per K block four m64nBNk32 wgmma k-steps into a fresh accumulator, a wait,
// the stage freed, then the promotion final = fma(acc, sa[row] * ws, final) (DeepGEMM's per-block
// promotion: the tensor core's own FP8 accumulation is short, the 128-block scales are applied exactly in
// f32). A finished tile of a plain product on 128-row tiles leaves through shared memory: each consumer
// warpgroup writes its 64 rows there (128-byte swizzled boxes of 64 rows x 128 bytes) and one of its threads
// stores them with TMA, asynchronously, while the warpgroup starts its next tile (`tma_store`; the buffer costs
// 0-2 stages: 4-8 remain). Other launches (64-row tiles, split chains, grouped rows, outputs TMA
// cannot address) store from registers; both ways store the same values. The stores of a finished tile
// overlap the producer's loads of the next. Rows past `rows` and columns past `n` are zero-filled by TMA and
// never stored. A consumer warpgroup copies its unit's
// weight-block scales into shared memory when the unit starts (a global load per K block would put its
// latency into the promotion of every block).
//
// Small products (at most 64 rows: decode) take 64-row tiles (TM = 64, engine::cuda::gemm::Plan::bm): the
// A tile [64 x 128] (32 rows from each CTA of the pair), one consumer warpgroup running the same wgmma per
// 64 rows, and the shared memory the 128-row tile's other half took as more stages in flight (9 or 13).
//
// Chains: K is cut into `chains` fixed ranges of K blocks (a function of the weight shape alone,
// engine::cuda::gemm::chains, never of M or the device), each promoted in K order into its own f32 sum,
// and the chains are added left to right: y = ((c0 + c1) + c2) + ... A launch runs them one of two ways with the same bits:
// inside each tile one after another (a running total beside the current chain), or, for products too
// small to fill the GPU (`part` given), as separate units that write their chain sums to `part`, which
// tandem_gemm_fp8_combine adds in chain order. That is a split-K whose split never depends on M.
//
// Grouped products (the routed experts, engine::cuda::moe): `w` stacks G weight matrices [G * n, kpad] with their
// scales [G * ceil(n / 128), scale_cols], and the rows of `qa` are grouped by matrix (a group's rows
// contiguous, in no particular order). `row_tiles` lists the row tiles: tile t covers rows [m0, end) of group g
// (at most TM, engine::cuda::moe::tile_rows; the TMA box reads TM rows from m0, of the next group too, which
// are computed and never stored), so no group pads its rows. Unused tile slots have g = -1 and are skipped. The host sizes the
// launch for the most tiles any routing can give; the device writes the list (graph-friendly). Grouped
// launches are never split. `out_rows` (grouped launches, or null) stores grouped row r at row out_rows[r]
// instead: expert parallelism's down projection writes each pair's output into its combine row.
//
// Batch invariance: an output element is the same sequence of operations in every configuration: the
// same four k-steps per K block (a wgmma element depends on neither the tile's N nor its M), the same
// chains, the same order. TM, BN, the grid, the tile order and the split change only which CTA computes
// what, so y[m] does not depend on M or on the other rows (bench/gpu/gemm_bench.py and the GPU tests check
// TM 64 against 128, BN 64 against 128, split against unsplit, and rows of small M against the same rows of
// a large one, bit for bit).
#include "common.cuh"
#include "wgmma.cuh"
#include "sync.cuh"

#define GEMM_BM 128
#define GEMM_BK 128
#define GEMM_THREADS 384
// 64-row tiles (engine::cuda::gemm::Plan::bm): one consumer warpgroup, more stages.
#define GEMM_THREADS_SMALL 256
// K blocks whose weight scales a consumer warpgroup keeps in shared memory (engine::cuda::gemm::MAX_K_BLOCKS).
#define GEMM_MAX_KB 256
#define GEMM_SA_BOX (GEMM_BM + 4)  // row scales per TMA box (engine::cuda::gemm::SCALE_BOX)
#ifndef GEMM_GROUP_M
#define GEMM_GROUP_M 8
#endif
// 128-row tiles keep their output tile in shared memory for the TMA store (see the header): the stages that
// fit beside it, f32 and bf16 out (engine::cuda::gemm::stages).
#ifndef GEMM_STAGES_128_F32
#define GEMM_STAGES_128_F32 4
#endif
#ifndef GEMM_STAGES_128_BF16
#define GEMM_STAGES_128_BF16 5
#endif
#ifndef GEMM_STAGES_64_F32
#define GEMM_STAGES_64_F32 7
#endif
#ifndef GEMM_STAGES_64_BF16
#define GEMM_STAGES_64_BF16 8
#endif
// 64-row tiles: as many stages as fit 227 KB (engine::cuda::gemm::stages).
#ifndef GEMM_STAGES_M64_128
#define GEMM_STAGES_M64_128 9
#endif
#ifndef GEMM_STAGES_M64_64
#define GEMM_STAGES_M64_64 13
#endif

// Keeps the compiler from moving accesses of an accumulator across this point (CUTLASS's
// warpgroup_fence_operand): the wait has no register operands.
template <int N>
__device__ __forceinline__ void gemm_fence_operand(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int BN>
__device__ __forceinline__ void gemm_mma(float (&d)[BN / 2], unsigned long long a, unsigned long long b, int acc);
template <>
__device__ __forceinline__ void gemm_mma<128>(float (&d)[64], unsigned long long a, unsigned long long b, int acc) {
    tandem_wgmma_64x128x32(d, a, b, acc);
}
template <>
__device__ __forceinline__ void gemm_mma<64>(float (&d)[32], unsigned long long a, unsigned long long b, int acc) {
    tandem_wgmma_64x64x32(d, a, b, acc);
}

template <bool BF16>
__device__ __forceinline__ void gemm_store(void* y, int rows, int n, int r, int c, float v0, float v1) {
    if (r < 0 || r >= rows || c >= n) return;
    const i64 at = (i64)r * n + c;
    if (BF16) {
        u16* o = (u16*)y + at;
        if (c + 1 < n && (n & 1) == 0) {
            *(u32*)o = (u32)tandem_bf16(v0) | ((u32)tandem_bf16(v1) << 16);
        } else {
            o[0] = tandem_bf16(v0);
            if (c + 1 < n) o[1] = tandem_bf16(v1);
        }
    } else {
        float* o = (float*)y + at;
        if (c + 1 < n && (n & 1) == 0) {
            *(float2*)o = make_float2(v0, v1);
        } else {
            o[0] = v0;
            if (c + 1 < n) o[1] = v1;
        }
    }
}

// The same 2-D box into this offset of both CTAs of the cluster, counted on each one's `bar`.
__device__ __forceinline__ void gemm_tma_2d_pair(u32 dst, const TandemTensorMap* map, int x, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
        "{%2, %3}], [%4], %5;" ::"r"(dst),
        "l"((unsigned long long)map), "r"(x), "r"(y), "r"(bar), "h"((u16)3)
        : "memory");
}

// A TMA store of the 2-D box at shared address `src` to (x: innermost, in elements; y: row) of `map`, in this
// thread's bulk async-group (out-of-bounds parts of the box are not written).
__device__ __forceinline__ void gemm_tma_store_2d(const TandemTensorMap* map, int x, int y, u32 src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                     (unsigned long long)map),
                 "r"(x), "r"(y), "r"(src)
                 : "memory");
}

// A grouped product's row tile (see the header): rows [m0, end) of weight matrix g; g < 0 for an unused slot.
struct GemmRowTile {
    int m0, g, end;
};

// The output tile of cluster tile `t` for the CTA of cluster rank `rank`: tiles in groups of GEMM_GROUP_M row
// tiles, row tile fastest inside a group; the two CTAs of a cluster take adjacent column tiles. `mt` is the
// row tile's index.
__device__ __forceinline__ void gemm_tile(int t, int rank, int m_tiles, int n_pairs, int bn, int& mt, int& n0) {
    const int per_group = GEMM_GROUP_M * n_pairs;
    const int first_m = (t / per_group) * GEMM_GROUP_M;
    const int gm = min(m_tiles - first_m, GEMM_GROUP_M), in_group = t % per_group;
    mt = first_m + in_group % gm;
    n0 = (2 * (in_group / gm) + rank) * bn;
}

// Row tile `mt` of a launch: its first row, its weight matrix and the end of its rows.
template <int TM>
__device__ __forceinline__ GemmRowTile gemm_row_tile(const GemmRowTile* __restrict__ tiles, int mt, int rows) {
    if (tiles != nullptr) return tiles[mt];
    return GemmRowTile{mt * TM, 0, min(rows, mt * TM + TM)};
}


// First K block of chain c of `chains` over `kblocks` blocks.
__device__ __forceinline__ int gemm_chain_begin(int c, int chains, int kblocks) { return c * kblocks / chains; }

// Unit u of a launch whose cluster tiles are cut into `per_tile` units (1, or `chains` when split): its row
// tile (rows, matrix; matrix -1 for an unused slot of a grouped launch, which both sides skip), its column
// tile n0, its chain c and the K blocks [kb0, kb1) it covers. Producer and consumers walk the same units.
template <int TM>
__device__ __forceinline__ GemmRowTile gemm_unit(int u, int per_tile, int chains, int kblocks, int rank,
                                                 int m_tiles, int n_pairs, int bn,
                                                 const GemmRowTile* __restrict__ row_tiles, int rows, int& n0,
                                                 int& c, int& kb0, int& kb1) {
    int mt;
    gemm_tile(u / per_tile, rank, m_tiles, n_pairs, bn, mt, n0);
    c = u % per_tile;
    kb0 = per_tile > 1 ? gemm_chain_begin(c, chains, kblocks) : 0;
    kb1 = per_tile > 1 ? gemm_chain_begin(c + 1, chains, kblocks) : kblocks;
    return gemm_row_tile<TM>(row_tiles, mt, rows);
}

template <int TM, int BN, int STAGES, bool BF16, bool CHAINED>
__device__ __forceinline__ void gemm_fp8_body(const TandemTensorMap* ta, const TandemTensorMap* tb,
                                              const TandemTensorMap* tsa, const TandemTensorMap* ty,
                                              const float* __restrict__ ws, int scale_cols, void* __restrict__ y,
                                              float* __restrict__ part, int chains, int rows, int n, int kpad,
                                              const GemmRowTile* __restrict__ row_tiles, int tile_slots,
                                              const int* __restrict__ out_rows, int tma_store) {
    extern __shared__ __align__(1024) u8 smem_raw[];
    // TM rows of a tile (128, or 64 for small products: see the header); a consumer warpgroup per 64 of
    // them. A stage's `empty` barrier counts every consumer thread of this CTA and lane 0 of each consumer
    // warp of the peer.
    constexpr int CONSUMERS = TM / 64;
    static_assert(TM == 128 || TM == 64, "tile rows");
    constexpr u32 EMPTY_ARRIVALS = CONSUMERS * (128 + 4);
    constexpr u32 A_BYTES = TM * GEMM_BK;
    constexpr u32 B_BYTES = BN * GEMM_BK;
    constexpr u32 STAGE = A_BYTES + B_BYTES;
    // The K block's row scales: a TMA box of GEMM_SA_BOX floats from the row tile's first row rounded down to
    // a multiple of 4 (the box's start must be 16-byte aligned, and a grouped tile starts at any row), in a
    // stage slot of SA_SLOT bytes (a multiple of 128); the tile's scales start `m0 & 3` floats in.
    constexpr u32 SA_BYTES = GEMM_SA_BOX * 4, SA_SLOT = (SA_BYTES + 127) / 128 * 128;
    // 128-row tiles: the output tile for the TMA store, per consumer warpgroup BOXES boxes of 64 rows x one
    // 128-byte row (32 f32 or 64 bf16 columns) in the 128-byte swizzle.
    constexpr int OUT_ESZ = BF16 ? 2 : 4, BOX_COLS = 128 / OUT_ESZ, BOXES = BN / BOX_COLS;
    constexpr u32 BOX_BYTES = 64 * 128, OUT_BYTES = TM == 128 ? CONSUMERS * BOXES * BOX_BYTES : 0;
    const u32 base = ((u32)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    const u32 outs = base + STAGES * STAGE;    // [CONSUMERS][BOXES][64 x 128 bytes], 1024-byte aligned
    const u32 scales = outs + OUT_BYTES;       // [STAGES][SA_SLOT / 4] f32: the A tile's row scales of the K block
    const u32 full = scales + STAGES * SA_SLOT, empty = full + STAGES * 8;
    // [CONSUMERS][GEMM_MAX_KB] f32: each consumer warpgroup's copy of its unit's weight-block scales.
    const u32 wscales = (empty + STAGES * 8 + 15u) & ~15u;
    const float* scales_f = (const float*)(smem_raw + (scales - (u32)__cvta_generic_to_shared(smem_raw)));
    const int rank = (int)tandem_cluster_rank(), peer = rank ^ 1;

    const int m_tiles = row_tiles != nullptr ? tile_slots : (rows + TM - 1) / TM, n_tiles = (n + BN - 1) / BN;
    const int n_blocks = (n + 127) / 128;
    const int n_pairs = (n_tiles + 1) / 2, tiles = m_tiles * n_pairs;
    const int cluster = blockIdx.x / 2, clusters = gridDim.x / 2;
    const int kblocks = kpad / GEMM_BK;
    // A unit of work is a cluster tile, or with `part` one chain of a cluster tile.
    const int per_tile = part != nullptr ? chains : 1, units = tiles * per_tile;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            tandem_mbar_init(full + 8 * s, 1);
            tandem_mbar_init(empty + 8 * s, EMPTY_ARRIVALS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    // The peer multicasts into this CTA's stages and arrives on its barriers: both must be initialized.
    tandem_cluster_sync();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            asm volatile("prefetch.tensormap [%0];" ::"l"((unsigned long long)ta) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"((unsigned long long)tb) : "memory");
            asm volatile("prefetch.tensormap [%0];" ::"l"((unsigned long long)tsa) : "memory");
            // Stage s of round `round` (a counter, not it % STAGES: STAGES need not be a power of two).
            int s = 0;
            u32 round = 0;
            for (int u = cluster; u < units; u += clusters) {
                int n0, c, kb0, kb1;
                const GemmRowTile rt =
                    gemm_unit<TM>(u, per_tile, chains, kblocks, rank, m_tiles, n_pairs, BN, row_tiles, rows, n0, c, kb0, kb1);
                if (rt.g < 0) continue;
                const int m0 = rt.m0, nb = rt.g * n + n0;
                for (int kb = kb0; kb < kb1; ++kb) {
                    // Both CTAs' consumers are done with the stage (this CTA's multicast writes the peer's too).
                    if (round > 0) tandem_mbar_wait(empty + 8 * s, (round - 1) & 1);
                    const u32 a = base + s * STAGE, bar = full + 8 * s;
                    tandem_mbar_expect_tx(bar, STAGE + SA_BYTES);
                    // This CTA's half of the A tile into both CTAs.
                    gemm_tma_2d_pair(a + rank * (A_BYTES / 2), ta, kb * GEMM_BK, m0 + rank * (TM / 2), bar);
                    tandem_tma_2d(a + A_BYTES, tb, kb * GEMM_BK, nb, bar);
                    tandem_tma_2d(scales + s * SA_SLOT, tsa, m0 & ~3, kb, bar);
                    if (++s == STAGES) s = 0, ++round;
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int cw = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const int row = cw * 64 + warp * 16 + lane / 4;  // this thread's rows in the tile: row, row + 8
        float* wsm = (float*)(smem_raw + (wscales - (u32)__cvta_generic_to_shared(smem_raw))) + cw * GEMM_MAX_KB;
        // The stage and its full barrier's phase parity, counted (no division per K block); the peer's
        // empty barriers, mapped once.
        int s = 0;
        u32 phase = 0;
        const u32 peer_empty = tandem_peer(empty, peer);
        // Without in-tile chains (CHAINED false: one chain, or split launches whose units are single chains)
        // there is no running total, and the 64 registers it took stay free for the loop's addresses.
        if (!CHAINED && chains > 1 && part == nullptr) __trap();
        for (int u = cluster; u < units; u += clusters) {
            int n0, c, kb0, kb1;
            const GemmRowTile rt =
                gemm_unit<TM>(u, per_tile, chains, kblocks, rank, m_tiles, n_pairs, BN, row_tiles, rows, n0, c, kb0, kb1);
            if (rt.g < 0) continue;
            const int m0 = rt.m0, row_end = rt.end;
            // The unit's weight-block scales, copied into shared memory once (a global load per K block
            // would put its latency in every K block's promotion: measured, 13% of the consumers' stalls at
            // M = 1); a column tile past `n` (the odd tile of a pair) reads none. The warpgroup's first
            // barrier waits for its reads of the previous unit's copy.
            const float* wsp = ws + ((i64)rt.g * n_blocks + n0 / 128) * scale_cols;
            const bool has_n = n0 < n;
            asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
            for (int i = threadIdx.x % 128; i < kb1 - kb0; i += 128) wsm[i] = has_n ? wsp[kb0 + i] : 0.0f;
            asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
            // fin: the current chain; tot: the chains before it, summed left to right.
            float fin[BN / 2], tot[CHAINED ? BN / 2 : 1], acc[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) fin[i] = 0.0f;
            int next_chain = 1, next_begin = per_tile > 1 ? kb1 : gemm_chain_begin(1, chains, kblocks);
            for (int kb = kb0; kb < kb1; ++kb) {
                if constexpr (CHAINED) {
                    if (kb == next_begin) {
                    // A chain ends: add it to the ones before (the first one is taken as it is).
#pragma unroll
                    for (int i = 0; i < BN / 2; ++i) {
                        tot[i] = next_chain == 1 ? fin[i] : tot[i] + fin[i];
                        fin[i] = 0.0f;
                    }
                    ++next_chain;
                    next_begin = gemm_chain_begin(next_chain, chains, kblocks);
                    }
                }
                const float w = wsm[kb - kb0];
                tandem_mbar_wait(full + 8 * s, phase);
                const float* sas = scales_f + s * (SA_SLOT / 4) + (m0 & 3);
                const float f_lo = sas[row] * w, f_hi = sas[row + 8] * w;
                // A k-step's descriptors are the first one's plus its 32 bytes (2 in the address field, which
                // no shared address brings near its top).
                const unsigned long long da = tandem_desc_sw128(base + s * STAGE + cw * (64 * GEMM_BK));
                const unsigned long long db = tandem_desc_sw128(base + s * STAGE + A_BYTES);
                tandem_wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < GEMM_BK / 32; ++ks) gemm_mma<BN>(acc, da + 2 * ks, db + 2 * ks, ks);
                tandem_wgmma_commit();
                tandem_wgmma_wait<0>();
                gemm_fence_operand(acc);  // the promotion's reads of acc stay after the wait
                // Every thread arrives (its reads of the scales are ordered before the producer's next write,
                // in a way compute-sanitizer's racecheck follows); lane 0 of each warp also frees the stage
                // on the peer, whose A half this CTA's multicast writes.
                tandem_mbar_arrive(empty + 8 * s);
                __syncwarp();
                // CTA-scope release: the stage was read by wgmma only, whose wait completed; a cluster-scope
                // release costs a MEMBAR per K block (measured: half the speed).
                if (lane == 0) tandem_mbar_arrive_remote_cta(peer_empty + 8 * s);
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    fin[4 * j + 0] = fmaf(acc[4 * j + 0], f_lo, fin[4 * j + 0]);
                    fin[4 * j + 1] = fmaf(acc[4 * j + 1], f_lo, fin[4 * j + 1]);
                    fin[4 * j + 2] = fmaf(acc[4 * j + 2], f_hi, fin[4 * j + 2]);
                    fin[4 * j + 3] = fmaf(acc[4 * j + 3], f_hi, fin[4 * j + 3]);
                }
                if (++s == STAGES) s = 0, phase ^= 1;
            }
            // The stores overlap the producer's loads of the next unit. In-tile chains end with their sum.
            if constexpr (CHAINED) {
                if (per_tile == 1 && chains > 1) {
#pragma unroll
                    for (int i = 0; i < BN / 2; ++i) fin[i] = tot[i] + fin[i];
                }
            }
            const int r = m0 + row;
            if (TM == 128 && tma_store != 0 && per_tile == 1 && row_tiles == nullptr && out_rows == nullptr) {
                // A plain product's tile through shared memory: each warpgroup writes its 64 rows into its
                // boxes (the 128-byte swizzle: a warp's stores of a column block hit eight different bank
                // groups), and one thread stores them with TMA, asynchronously: full 128-byte lines instead
                // of eight rows' 16 bytes per warp store, and the warpgroup goes on with its next tile.
                // (Timing only, the register stores cost kv_b (4 K blocks) half its time at M = 4096.)
                const u32 wout = outs + cw * (BOXES * BOX_BYTES);
                const int t = threadIdx.x % 128, rl = warp * 16 + lane / 4;  // rows rl and rl + 8 of the warpgroup's 64
                // The TMA engine is done reading the previous tile's boxes (its issuing thread waited).
                if (t == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const int col = 8 * j + 2 * (lane % 4), byte = (col % BOX_COLS) * OUT_ESZ;
                    const u32 at = wout + (col / BOX_COLS) * BOX_BYTES + rl * 128 + ((((byte >> 4) ^ (rl & 7))) << 4) +
                                   (byte & 15);
                    if (BF16) {
                        const u32 lo = tandem_bf16x2(fin[4 * j + 0], fin[4 * j + 1]);
                        const u32 hi = tandem_bf16x2(fin[4 * j + 2], fin[4 * j + 3]);
                        asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(lo) : "memory");
                        asm volatile("st.shared.b32 [%0], %1;" ::"r"(at + 8 * 128), "r"(hi) : "memory");
                    } else {
                        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(fin[4 * j + 0]),
                                     "f"(fin[4 * j + 1])
                                     : "memory");
                        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at + 8 * 128), "f"(fin[4 * j + 2]),
                                     "f"(fin[4 * j + 3])
                                     : "memory");
                    }
                }
                // The generic-proxy writes, seen by the TMA engine (async proxy) once the warpgroup has synced.
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
                if (t == 0 && n0 < n && m0 + cw * 64 < rows) {
#pragma unroll
                    for (int b = 0; b < BOXES; ++b) gemm_tma_store_2d(ty, n0 + b * BOX_COLS, m0 + cw * 64, wout + b * BOX_BYTES);
                    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                }
            } else if (per_tile > 1) {
                // One chain of a split launch: its sum goes to part[c] (tandem_gemm_fp8_combine adds them).
                float* pc = part + (i64)c * rows * n;
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const int col = n0 + 8 * j + 2 * (lane % 4);
                    gemm_store<false>(pc, rows, n, r < row_end ? r : -1, col, fin[4 * j + 0], fin[4 * j + 1]);
                    gemm_store<false>(pc, rows, n, r + 8 < row_end ? r + 8 : -1, col, fin[4 * j + 2], fin[4 * j + 3]);
                }
            } else {
                // With `out_rows`, row r is stored at row out_rows[r] (expert parallelism's combine buffer).
                const int lim = out_rows != nullptr ? 0x7fffffff : row_end;
                const int ra = r < row_end ? (out_rows != nullptr ? out_rows[r] : r) : -1;
                const int rb = r + 8 < row_end ? (out_rows != nullptr ? out_rows[r + 8] : r + 8) : -1;
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const int col = n0 + 8 * j + 2 * (lane % 4);
                    gemm_store<BF16>(y, lim, n, ra, col, fin[4 * j + 0], fin[4 * j + 1]);
                    gemm_store<BF16>(y, lim, n, rb, col, fin[4 * j + 2], fin[4 * j + 3]);
                }
            }
        }
    }
    // A consumer warpgroup's last TMA stores have read its boxes before the CTA (and its shared memory) ends.
    if (wg > 0 && threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    // The peer may still arrive on this CTA's barriers: neither CTA leaves before both are done.
    __syncwarp();
    tandem_cluster_sync();
}

// A split launch's chains summed left to right, as an unsplit launch sums them: y = ((p0 + p1) + p2) + ...
template <bool BF16>
__device__ __forceinline__ void gemm_combine_body(const float* __restrict__ part, int chains, i64 count,
                                                  void* __restrict__ y) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (i64)gridDim.x * blockDim.x) {
        float v = part[i];
        for (int c = 1; c < chains; ++c) v = v + part[(i64)c * count + i];
        if (BF16) {
            ((u16*)y)[i] = tandem_bf16(v);
        } else {
            ((float*)y)[i] = v;
        }
    }
}
extern "C" __global__ void tandem_gemm_fp8_combine_f32(const float* __restrict__ part, int chains, i64 count,
                                                       void* __restrict__ y) {
    gemm_combine_body<false>(part, chains, count, y);
}
extern "C" __global__ void tandem_gemm_fp8_combine_bf16(const float* __restrict__ part, int chains, i64 count,
                                                        void* __restrict__ y) {
    gemm_combine_body<true>(part, chains, count, y);
}

// The entry points: tile rows 128 or 64 (`_m64_`), output tile width 128 or 64, f32 or bf16 out; 128-row tiles
// without in-tile chains (one chain, or a split launch) and with them (`_chains`: the consumers also keep the
// running total of the chains before, 64 registers a thread the plain kernels spend on the K loop's
// addresses instead of recomputing them every K block). Launch: a grid
// of an even number of CTAs (clusters of two), at most one per SM (persistent: each cluster walks units u =
// cluster, cluster + clusters, ...), 384 threads (256 with 64-row tiles), dynamic shared memory
// engine::cuda::gemm::smem_bytes.
#define GEMM_PARAMS                                                                                               \
    const __grid_constant__ TandemTensorMap ta, const __grid_constant__ TandemTensorMap tb,                      \
        const __grid_constant__ TandemTensorMap tsa, const __grid_constant__ TandemTensorMap ty,                  \
        const float *__restrict__ ws, int scale_cols, void *__restrict__ y, float *__restrict__ part, int chains, \
        int rows, int n, int kpad, const GemmRowTile *__restrict__ row_tiles, int tile_slots,                   \
        const int *__restrict__ out_rows, int tma_store

// One entry point: its name, tile rows and width, stages, output type, in-tile chains, threads.
#define GEMM_ENTRY(NAME, TM, BN, STAGES, BF16, CHAINED, THREADS)                                                  \
    extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS, 1) NAME(GEMM_PARAMS) {        \
        gemm_fp8_body<TM, BN, STAGES, BF16, CHAINED>(&ta, &tb, &tsa, &ty, ws, scale_cols, y, part, chains, rows, n, kpad, \
                                            row_tiles, tile_slots, out_rows, tma_store);                        \
    }

GEMM_ENTRY(tandem_gemm_fp8_n128_f32, 128, 128, GEMM_STAGES_128_F32, false, false, GEMM_THREADS)
GEMM_ENTRY(tandem_gemm_fp8_n128_bf16, 128, 128, GEMM_STAGES_128_BF16, true, false, GEMM_THREADS)
GEMM_ENTRY(tandem_gemm_fp8_n64_f32, 128, 64, GEMM_STAGES_64_F32, false, false, GEMM_THREADS)
GEMM_ENTRY(tandem_gemm_fp8_n64_bf16, 128, 64, GEMM_STAGES_64_BF16, true, false, GEMM_THREADS)
GEMM_ENTRY(tandem_gemm_fp8_n128_f32_chains, 128, 128, GEMM_STAGES_128_F32, false, true, GEMM_THREADS)
GEMM_ENTRY(tandem_gemm_fp8_n128_bf16_chains, 128, 128, GEMM_STAGES_128_BF16, true, true, GEMM_THREADS)
GEMM_ENTRY(tandem_gemm_fp8_n64_f32_chains, 128, 64, GEMM_STAGES_64_F32, false, true, GEMM_THREADS)
GEMM_ENTRY(tandem_gemm_fp8_n64_bf16_chains, 128, 64, GEMM_STAGES_64_BF16, true, true, GEMM_THREADS)
GEMM_ENTRY(tandem_gemm_fp8_m64_n128_f32, 64, 128, GEMM_STAGES_M64_128, false, true, GEMM_THREADS_SMALL)
GEMM_ENTRY(tandem_gemm_fp8_m64_n128_bf16, 64, 128, GEMM_STAGES_M64_128, true, true, GEMM_THREADS_SMALL)
GEMM_ENTRY(tandem_gemm_fp8_m64_n64_f32, 64, 64, GEMM_STAGES_M64_64, false, true, GEMM_THREADS_SMALL)
GEMM_ENTRY(tandem_gemm_fp8_m64_n64_bf16, 64, 64, GEMM_STAGES_M64_64, true, true, GEMM_THREADS_SMALL)
