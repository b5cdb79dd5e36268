// Lightning-indexer decode scores over the paged FP8 key cache (docs/model.md §2.3, §4):
//   I[r, s] = k_scale[s] * sum_h w[r, h] * relu(q[r, h] . k[s])     for s in 0..lengths[r]
// q: e4m3 codes [rows, heads, 128]; w: f32 head weights with every scale folded in; keys: the 8448-byte
// indexer blocks ([64 x 128 e4m3][64 x f32 scale]) found through each row's block table.
//
// Each key block is copied into shared memory with cp.async, two blocks in flight (the next while the
// current one computes). The q . k products run on the tensor cores (mma.sync m16n8k32 e4m3, f32
// accumulate; sm_90 executes it as two f16 HMMA.16816 after an exact e4m3 -> f16 conversion, the FP8 rate
// being wgmma's): a CTA of 4 warps takes one 64-token block at a time, warp w its 16 tokens against all
// heads (8 heads per MMA tile). The
// head sum then runs in the CPU backend's order (h = 0, 1, ...; multiply, then add, no FMA) from shared
// memory, so wherever the dot products are exact the scores equal the CPU's bit for bit.
//
// Work split: a CTA covers BLOCKS_PER_CTA consecutive blocks of one row, so the split depends only on the
// row's own length; no score is combined across CTAs (batch-invariant).
#include "common.cuh"

#define IDX_DIM 128
#define IDX_BLOCK 64
#define IDX_MAX_HEADS 64
#define IDX_WARPS 4
// Blocks of one row per CTA: enough to amortize loading q (8 KB) against 8.4 KB of keys per block.
#define IDX_BLOCKS_PER_CTA 8
// Shared-memory row of one key: 128 bytes + 16 of padding, so the MMA fragment reads (8 rows x 4 words
// per instruction) hit 32 distinct banks.
#define IDX_ROW 144
#define IDX_STAGES 2

__device__ __forceinline__ void tandem_mma_e4m3(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void tandem_cp_async16(void* smem, const void* gmem) {
    const u32 s = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}

struct IdxStage {
    u8 keys[IDX_BLOCK * IDX_ROW];
    float scales[IDX_BLOCK];
};

// Copies one 8448-byte indexer block into a stage: 528 16-byte pieces over the CTA's 128 threads.
__device__ __forceinline__ void tandem_load_block(IdxStage& st, const u8* blk) {
    for (int c = threadIdx.x; c < IDX_BLOCK * IDX_DIM / 16; c += IDX_WARPS * 32)
        tandem_cp_async16(st.keys + (c >> 3) * IDX_ROW + (c & 7) * 16, blk + c * 16);
    if (threadIdx.x < IDX_BLOCK * 4 / 16)
        tandem_cp_async16(reinterpret_cast<u8*>(st.scales) + threadIdx.x * 16, blk + IDX_BLOCK * IDX_DIM + threadIdx.x * 16);
    asm volatile("cp.async.commit_group;");
}

extern "C" __global__ void __launch_bounds__(IDX_WARPS * 32) tandem_indexer_scores(
    const u8* __restrict__ q,            // [rows, heads, 128] e4m3
    const float* __restrict__ w,         // [rows, heads]
    int heads,                           // multiple of 8, at most 64
    const u8* __restrict__ index_blocks, // this layer's indexer region
    const int* __restrict__ block_table, // [rows, max_blocks]
    int max_blocks,
    int num_blocks,                      // blocks in the region: a table entry outside it is not read
    const int* __restrict__ lengths,     // [rows]
    float* __restrict__ scores,          // [rows, score_stride]
    i64 score_stride) {
    __shared__ __align__(16) IdxStage stages[IDX_STAGES];
    __shared__ float dots[IDX_BLOCK][IDX_MAX_HEADS + 1];
    __shared__ float ws[IDX_MAX_HEADS];
    const int row = blockIdx.y;
    const int len = (int)min((i64)lengths[row], score_stride);
    const int first = blockIdx.x * IDX_BLOCKS_PER_CTA;
    if (first * IDX_BLOCK >= len) return;
    const int last = min(first + IDX_BLOCKS_PER_CTA, (len + IDX_BLOCK - 1) / IDX_BLOCK);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int tiles = heads >> 3;
    const int* table = block_table + (i64)row * max_blocks;
    const i64 block_bytes = IDX_BLOCK * (IDX_DIM + 4);

    // A table entry outside the region (a caller's bug) reads block 0 instead and its scores become NaN,
    // which the top-k never selects and counts.
    auto block_at = [&](int lb) -> const u8* {
        const int phys = table[lb];
        return index_blocks + (i64)((phys >= 0 && phys < num_blocks) ? phys : 0) * block_bytes;
    };
    tandem_load_block(stages[0], block_at(first));

    // q as B fragments (k = dim, n = head; q is [head][dim], i.e. column-major B), kept in registers.
    u32 bq[8][4][2];
    const u8* qr = q + (i64)row * heads * IDX_DIM;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            const bool live = nt < tiles;
            const u8* p = qr + (nt * 8 + g) * IDX_DIM + ks * 32 + t4 * 4;
            bq[nt][ks][0] = live ? *reinterpret_cast<const u32*>(p) : 0u;
            bq[nt][ks][1] = live ? *reinterpret_cast<const u32*>(p + 16) : 0u;
        }
    }
    for (int h = threadIdx.x; h < heads; h += blockDim.x) ws[h] = w[(i64)row * heads + h];

    for (int lb = first; lb < last; ++lb) {
        IdxStage& st = stages[(lb - first) & 1];
        if (lb + 1 < last) {
            // The other stage was last read by block lb - 1's MMAs and scale reads, which the barrier
            // before its epilogue has seen finish.
            tandem_load_block(stages[(lb + 1 - first) & 1], block_at(lb + 1));
            asm volatile("cp.async.wait_group 1;");
        } else {
            asm volatile("cp.async.wait_group 0;");
        }
        __syncthreads();  // block lb's bytes are visible to every thread; `dots` is free again
        // Read out of the stage before the barrier below: after it, the next iteration refills this stage.
        const float kscale = threadIdx.x < IDX_BLOCK ? st.scales[threadIdx.x] : 0.0f;

        const u8* k0 = st.keys + (warp * 16 + g) * IDX_ROW + t4 * 4;  // token warp*16+g
        const u8* k1 = k0 + 8 * IDX_ROW;                                 // token warp*16+g+8
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            const u32 a[4] = {
                *reinterpret_cast<const u32*>(k0 + ks * 32),
                *reinterpret_cast<const u32*>(k1 + ks * 32),
                *reinterpret_cast<const u32*>(k0 + ks * 32 + 16),
                *reinterpret_cast<const u32*>(k1 + ks * 32 + 16),
            };
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
                if (nt < tiles) tandem_mma_e4m3(acc[nt], a, bq[nt][ks][0], bq[nt][ks][1]);
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            if (nt >= tiles) continue;
            const int h = nt * 8 + t4 * 2;
            dots[warp * 16 + g][h] = acc[nt][0];
            dots[warp * 16 + g][h + 1] = acc[nt][1];
            dots[warp * 16 + g + 8][h] = acc[nt][2];
            dots[warp * 16 + g + 8][h + 1] = acc[nt][3];
        }
        __syncthreads();
        if (threadIdx.x < IDX_BLOCK) {
            const int s = lb * IDX_BLOCK + threadIdx.x;
            if (s < len) {
                float sum = 0.0f;
                for (int h = 0; h < heads; ++h) sum = __fadd_rn(sum, __fmul_rn(fmaxf(dots[threadIdx.x][h], 0.0f), ws[h]));
                const bool valid = table[lb] >= 0 && table[lb] < num_blocks;
                scores[(i64)row * score_stride + s] = valid ? __fmul_rn(sum, kscale) : __int_as_float(0x7fc00000);
            }
        }
    }
}
