// The routed experts' rows for the grouped FP8 GEMM (gemm.cu, "Grouped products"; engine::cuda::moe).
// Each (token, slot) pair p routed to expert e = ids[p] gets a row of the grouped layout: the rows of one
// expert are contiguous, experts in id order, and no expert's rows are padded. The order of the rows inside
// an expert's range is whatever the atomics give: a row's products do not depend on where it sits (a GEMM
// row is computed alone, gemm.cu's batch invariance), so nothing downstream depends on it.
#include "common.cuh"

// One CTA: counts the pairs per expert, and writes each expert's first row (cursor, which
// tandem_moe_scatter advances) and the GEMM's row tiles: expert e's rows [off, off + count) in tiles of
// `tile_rows` (the GEMM's tile height, 64 or 128), {m0, e, off + count} each, experts in id order; the slots
// up to `tile_slots` get expert -1. Pairs
// with an id outside [0, experts) get no row; the rows they leave at the end of `src_row` read token 0
// (quantized, never used). Dynamic shared memory: 3 * experts ints.
extern "C" __global__ void tandem_moe_plan(const int* __restrict__ ids, int pairs, int experts,
                                           int* __restrict__ cursor, int* __restrict__ src_row,
                                           int* __restrict__ tiles, int tile_slots, int tile_rows) {
    extern __shared__ int counts[];  // [experts] counts, then [experts] first rows, then [experts] first tiles
    int* first = counts + experts;
    int* first_tile = first + experts;
    __shared__ int used_rows, used_tiles;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = ids[p];
        if (e >= 0 && e < experts) atomicAdd(&counts[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int row = 0, tile = 0;
        for (int e = 0; e < experts; ++e) {
            first[e] = row;
            first_tile[e] = tile;
            row += counts[e];
            tile += (counts[e] + tile_rows - 1) / tile_rows;
        }
        used_rows = row;
        used_tiles = tile;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        cursor[e] = first[e];
        const int end = first[e] + counts[e];
        int t = first_tile[e];
        for (int m0 = first[e]; m0 < end; m0 += tile_rows, ++t) {
            tiles[3 * t + 0] = m0;
            tiles[3 * t + 1] = e;
            tiles[3 * t + 2] = end;
        }
    }
    for (int t = used_tiles + threadIdx.x; t < tile_slots; t += blockDim.x) {
        tiles[3 * t + 0] = 0;
        tiles[3 * t + 1] = -1;
        tiles[3 * t + 2] = 0;
    }
    for (int r = used_rows + threadIdx.x; r < pairs; r += blockDim.x) src_row[r] = 0;
}

// Every pair takes the next row of its expert: slot_of_pair[p] = its row (-1: no expert), src_row[row] = its
// token (p / k), pair_of_row[row] = p.
extern "C" __global__ void tandem_moe_scatter(const int* __restrict__ ids, int pairs, int k, int experts,
                                              int* __restrict__ cursor, int* __restrict__ slot_of_pair,
                                              int* __restrict__ src_row, int* __restrict__ pair_of_row) {
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += gridDim.x * blockDim.x) {
        const int e = ids[p];
        if (e < 0 || e >= experts) {
            slot_of_pair[p] = -1;
            continue;
        }
        const int row = atomicAdd(&cursor[e], 1);
        slot_of_pair[p] = row;
        src_row[row] = p / k;
        pair_of_row[row] = p;
    }
}

// ids[p] = map[ids[p]]: routed experts that share their weights (a synthetic model standing for one rank of
// expert parallelism) run as the matrix they share (engine::cuda::weights::DMoe::expert_map).
// Ids outside [0, experts) are left as they are (the grouping gives them no row).
extern "C" __global__ void tandem_moe_map_ids(int* __restrict__ ids, int n, const int* __restrict__ map,
                                              int experts) {
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < n; p += gridDim.x * blockDim.x) {
        const int e = ids[p];
        if (e >= 0 && e < experts) ids[p] = map[e];
    }
}

// Under expert parallelism, the pairs of a padded pass's padding rows (rows at or past `*real`, read from
// device memory so that a CUDA graph takes each step's count) route to no expert: id -1. They are then
// neither counted, dispatched, computed nor combined.
extern "C" __global__ void tandem_moe_drop_padding(int* __restrict__ ids, int n, int k, const int* __restrict__ real) {
    const int own = min(max(*real, 0), n / k) * k;
    for (int p = own + blockIdx.x * blockDim.x + threadIdx.x; p < n; p += gridDim.x * blockDim.x) ids[p] = -1;
}

// ---- Expert parallelism (engine::cuda::ep): one rank's tokens go out as a dispatch record of `cap` rows
// (FP8 codes [cap][kpad], their scales [kpad / 128][cap], the route's expert ids [cap][k]; rows past the
// rank's own are id -1), every rank gathers every record, computes the pairs of its own experts and sends
// each pair's bf16 output back to the pair's rank (the down projection stores it at the pair's row of the
// combine buffer: gemm.cu's out_rows), which adds a token's pairs in slot order.

// The id block of this rank's record (rows [rows, cap) get -1), and for each own pair p the row of the
// combine buffer its output comes back in: owner * cap * k + p (owner = id / per_rank).
// With load balancing (`table`, engine::eplb::Placement::table: per expert its copies c and their slots, `width`
// ints) the record carries the slot of copy (row + rank) % c of the pair's expert instead (row = p / k: an
// expert appears once a row, so its pairs spread evenly over its copies), `per_rank` slots a rank: a pure
// function of the pair's place.
extern "C" __global__ void tandem_ep_pack_ids(const int* __restrict__ ids, int rows, int cap, int k, int per_rank,
                                              const int* __restrict__ table, int width, int rank,
                                              int* __restrict__ out_ids, int* __restrict__ at) {
    const int n = cap * k, own = rows * k;
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < n; p += gridDim.x * blockDim.x) {
        int e = p < own ? ids[p] : -1;
        if (e >= 0 && table != nullptr) {
            const int* t = table + (i64)e * width;
            e = t[1 + (p / k + rank) % t[0]];
        }
        out_ids[p] = e;
        if (p < own) at[p] = e >= 0 ? (e / per_rank) * n + p : -1;
    }
}

// counts[e] += the pairs of `ids` routed to expert e (e in [0, experts)): the per-expert load that
// expert-parallel load balancing reads (engine::cuda::balance). Integer sums: the order does not matter.
extern "C" __global__ void tandem_eplb_count(const int* __restrict__ ids, int n, int experts, int* __restrict__ counts) {
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < n; p += gridDim.x * blockDim.x) {
        const int e = ids[p];
        if (e >= 0 && e < experts) atomicAdd(counts + e, 1);
    }
}

// Each gathered pair's matrix on this rank: the pair's expert minus `lo` where it is one of this rank's
// `per_rank` experts (through `map` where experts share matrices), else -1 (no row here).
extern "C" __global__ void tandem_ep_local_ids(const u8* __restrict__ recv, i64 record, i64 ids_off, int ranks,
                                               int slots, int lo, int per_rank, const int* __restrict__ map,
                                               int* __restrict__ lids) {
    const int n = ranks * slots;
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < n; p += gridDim.x * blockDim.x) {
        const int q = p / slots, j = p - q * slots;
        const int e = ((const int*)(recv + q * record + ids_off))[j];
        const int l = e - lo;
        lids[p] = (e >= lo && l < per_rank) ? (map != nullptr ? map[l] : l) : -1;
    }
}

// Grouped row r takes the FP8 codes and scales of its gathered token (src_row[r] = rank * cap + row): the
// rows a plain grouping quantizes from that token, copied. One CTA per row; rows past the grouping's used
// rows (*used: the last expert's cursor once scattered) are left alone. 16-byte copies: kpad % 128 == 0.
extern "C" __global__ void tandem_ep_gather(const u8* __restrict__ recv, i64 record, i64 scales_off, int cap,
                                            int kpad, const int* __restrict__ src_row, const int* __restrict__ used,
                                            u8* __restrict__ qa, float* __restrict__ sa, int ld) {
    const int r = blockIdx.x;
    if (r >= *used) return;
    const int src = src_row[r], q = src / cap, t = src - q * cap;
    const u8* rec = recv + q * record;
    const uint4* from = (const uint4*)(rec + (i64)t * kpad);
    uint4* to = (uint4*)(qa + (i64)r * kpad);
    for (int i = threadIdx.x; i < kpad / 16; i += blockDim.x) to[i] = from[i];
    const float* sc = (const float*)(rec + scales_off);
    for (int b = threadIdx.x; b < kpad / 128; b += blockDim.x) sa[(i64)b * ld + r] = sc[(i64)b * cap + t];
}
