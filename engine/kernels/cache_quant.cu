// Quantize-on-write of the paged FP8 caches (docs/model.md, cache formats), bit-identical to
// engine::cache::format::{encode_latent_fp8, encode_index_key_fp8}.
//
// Each token goes to cache slot `slots[t]` = block_id * 64 + offset (-1: skip the token; a slot at or past
// `num_slots`, the pool's capacity, is a caller bug and is skipped too rather than written out of bounds). The pointers are
// one layer's region of the pool: blocks are contiguous inside a layer, so a latent entry lives at
// `latent + slot * entry_bytes` and an indexer key inside block `slot / 64` (values, then one f32 scale per
// token after all 64 tokens' values).
#include "common.cuh"

#define TANDEM_BLOCK 64
#define TANDEM_TILE 128

// One CTA per token, one warp per 128-wide tile of the latent (rank / 128 warps). Lane l of warp w
// quantizes values w*128 + 4l .. +4 with the tile's ue8m0 scale; warp 0 also writes the bf16 k_pe.
extern "C" __global__ void tandem_quantize_latent_fp8(
    const float* __restrict__ c,     // [n, rank]
    const float* __restrict__ k_pe,  // [n, rope]
    const i64* __restrict__ slots,   // [n]
    u8* __restrict__ latent,         // this layer's latent region
    int n, int rank, int rope, i64 num_slots) {
    const int t = blockIdx.x;
    if (t >= n) return;
    const i64 slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tiles = rank / TANDEM_TILE;
    const i64 entry_bytes = (i64)rank + 4 * tiles + 2 * rope;
    u8* out = latent + slot * entry_bytes;

    const float4 v = reinterpret_cast<const float4*>(c + (i64)t * rank + warp * TANDEM_TILE)[lane];
    const float amax = tandem_warp_amax(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    const float s = tandem_ue8m0_scale(amax);
    reinterpret_cast<u32*>(out + warp * TANDEM_TILE)[lane] = tandem_e4m3x4(v, 1.0f / s);
    if (lane == 0) reinterpret_cast<float*>(out + rank)[warp] = s;

    if (warp == 0) {
        u16* rope_out = reinterpret_cast<u16*>(out + rank + 4 * tiles);
        for (int i = lane; i < rope; i += 32) rope_out[i] = tandem_bf16(k_pe[(i64)t * rope + i]);
    }
}

// One warp per token; the key is one 128-wide group with one ue8m0 scale (dim == 128).
extern "C" __global__ void tandem_quantize_index_keys_fp8(
    const float* __restrict__ keys,  // [n, 128]
    const i64* __restrict__ slots,   // [n]
    u8* __restrict__ index_blocks,   // this layer's indexer region
    int n, i64 num_slots) {
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= n) return;
    const i64 slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;
    const i64 block = slot / TANDEM_BLOCK;
    const int offset = (int)(slot % TANDEM_BLOCK);
    u8* base = index_blocks + block * (TANDEM_BLOCK * (TANDEM_TILE + 4));

    const float4 v = reinterpret_cast<const float4*>(keys + (i64)t * TANDEM_TILE)[lane];
    const float amax = tandem_warp_amax(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    const float s = tandem_ue8m0_scale(amax);
    reinterpret_cast<u32*>(base + offset * TANDEM_TILE)[lane] = tandem_e4m3x4(v, 1.0f / s);
    if (lane == 0) reinterpret_cast<float*>(base + TANDEM_BLOCK * TANDEM_TILE)[offset] = s;
}
