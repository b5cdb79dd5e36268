// Sparse MLA decode over the FP8 latent cache (docs/model.md §2.2, SPEC §4): for each query (a decode token
// or its MTP draft) and head h,
//   o[h] = sum_t softmax_t(scale * (q[h, :512] . c_t + q[h, 512:] . k_pe_t)) c_t        over its selected t
// with q the absorbed query (576 bf16: W_UK^T q_nope, then q_pe) and c_t, k_pe_t a token's 656-byte cache
// entry: 512 e4m3 codes in 4 tiles of 128 with one power-of-two f32 scale each, then 64 bf16.
//
// One CTA = 64 heads of one query and one split of its selection (SMLA_TILE tokens a tile, `split_tiles`
// tiles a split), three warpgroups:
//   - WG2, the producer, gathers a tile's entries through the block table with 16-byte loads, dequantizes
//     them to bf16 and stores them into one of two K/V buffers (an interleaved layout: 8 dims x 64 tokens
//     per 1024-byte column chunk), then arrives on the buffer's `full` mbarrier;
//   - WG0 computes S = Q K^T (m64n64k16 x 36, both operands in shared memory), the online softmax in
//     registers, writes P (bf16) to shared memory for WG1, and O[:, 0:256] += P V with P from registers;
//   - WG1 computes O[:, 256:512] += P V with P from shared memory.
// Both consumers arrive on the buffer's `empty` mbarrier when their wgmma are done with it; WG0 and WG1 hand
// P and its rescale factors over through two named barriers, each a full `bar.sync` of both (measured as fast
// as an arrive on one side, and racecheck follows it). With 128 heads (two head blocks) the two CTAs of a query
// form a cluster (`tandem_sparse_mla_decode_pair`): each producer dequantizes half of every tile into both CTAs'
// buffers, which halves the gathering per CTA and lets a producer thread keep two tiles in flight (see
// smla_decode).
//
// Exact dequantization: an e4m3 code moved into bf16's bit positions is its value times 2^-120 (normal and
// subnormal codes alike); one bf16 multiply by scale * 2^64 then gives value * scale * 2^-56 exactly. k_pe
// is multiplied by 2^-56 the same way, so S comes out 2^-56 times the exact-input dot product and the
// softmax scale takes the 2^56 back (a power of two: no rounding). The producer never writes a NaN: the
// cache quantizer saturates, and a token that is not selected (-1, past the query's causal length, or a
// table entry outside the pool) is stored as zeros and masked out of the softmax.
//
// Batch invariance: a query's splits depend only on its own selection length and `split_tiles` (a model
// constant); within a split the tiles are reduced in order by one CTA; the combine kernel adds splits in
// index order. Nothing depends on the batch size or on other queries.
//
// The staged form (`tandem_sparse_mla_prefill`, prefill chunks): the chunk's context is first converted
// once per layer into bf16 rows of 576 (`tandem_sparse_mla_stage`: the exact values the gathering producer
// stores, c * scale * 2^-56 and k_pe * 2^-56, zeros for an empty slot), and the producer copies each selected
// row's 1152 bytes into the K/V buffer with 16-byte cp.async instead of gathering and dequantizing 656-byte
// entries. In prefill every query of a chunk reads from the same context, so the conversion is paid once per
// context token instead of once per (query, selected token). The staged buffer holds the same values in
// FlashMLA's layout instead of the interleaved one: 9 tiles of 64 tokens x 64 dims, 128-byte-swizzled K-major
// (token rows of 128 bytes), read K-major by Q K^T and MN-major by P V. Eight lanes then copy one token's
// 128-byte piece into one shared-memory row (whole L2 lines, no bank conflicts); in the interleaved layout a
// token's 16-byte chunks all fall on the same four banks, so whole-line copies conflicted eight ways and
// conflict-free ones split every line into 16-byte L2 requests (measured: 220-255 against 543 TFLOPS). The
// wgmma instructions, their operand values and their order are the decode kernel's, so a query's output has
// the same bits in either form (tested). One CTA per 64 heads loads its tiles itself (no cluster), as
// FlashMLA's sparse prefill does.
#include "common.cuh"
#include "wgmma.cuh"
#include "sync.cuh"

#define SMLA_DQK 576
#define SMLA_STAGE_TOKENS 4  // tokens of a tile each staged producer thread copies
#define SMLA_DV 512
#define SMLA_HEADS 64
#define SMLA_TILE 64
#define SMLA_ENTRY 656
#define SMLA_THREADS 384
#define SMLA_Q_BYTES (SMLA_HEADS * SMLA_DQK * 2)  // 9 swizzled tiles of 64 heads x 64 dims
#define SMLA_K_BYTES (SMLA_TILE * SMLA_DQK * 2)   // 72 column chunks of 64 tokens x 8 dims
#define SMLA_P_BYTES (SMLA_HEADS * SMLA_TILE * 2)  // one swizzled tile of 64 heads x 64 tokens
#define SMLA_OFF_K SMLA_Q_BYTES
#define SMLA_OFF_P (SMLA_OFF_K + 2 * SMLA_K_BYTES)
#define SMLA_OFF_VALID (SMLA_OFF_P + SMLA_P_BYTES)   // u32 [2][64]: the tokens' selected flags
#define SMLA_OFF_SCALE (SMLA_OFF_VALID + 512)        // f32 [64]: O rescale of the current tile
#define SMLA_OFF_NORM (SMLA_OFF_SCALE + 256)         // f32 [64]: final 2^56 / l
#define SMLA_OFF_BAR (SMLA_OFF_NORM + 256)           // u64 full[2], empty[2], full_remote[2]
// engine::cuda::sparse_mla::SHARED_BYTES: the layout above plus slack to align the base to 1024 bytes.
#define SMLA_SHARED_BYTES (SMLA_OFF_BAR + 48 + 1024)
// Bytes a pair's peer producer sends per tile: 32 tokens x (64 + 8 column chunks of 16 bytes) + 32 flags.
#define SMLA_REMOTE_BYTES (32 * 72 * 16 + 32 * 4)

#define SMLA_BAR_P_READY 1
#define SMLA_BAR_P_FREE 2
#define SMLA_BAR_NORM 3

__device__ __forceinline__ void smla_bar_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }

// 16 bytes into the peer's shared memory, counted on the peer's mbarrier when they land.
__device__ __forceinline__ void smla_st_async(u32 peer_addr, uint4 v, u32 peer_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 ::"r"(peer_addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(peer_bar)
                 : "memory");
}
__device__ __forceinline__ void smla_st_async_b32(u32 peer_addr, u32 v, u32 peer_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 ::"r"(peer_addr), "r"(v), "r"(peer_bar)
                 : "memory");
}

// A consumer warpgroup is done with a K/V buffer (its wgmma waited on): every thread arrives on this CTA's
// `empty`, and in a pair each warp's lane 0 (after `__syncwarp`) on the peer's too, since the peer's producer
// writes into this CTA's buffer. `empty` counts 256 arrivals alone, 256 + 8 in a pair. Each thread's own
// arrival orders its reads of the buffer and its selected flags before the producer's next write, which
// compute-sanitizer's racecheck can follow (it does not follow one arrival standing for a warp or a
// warpgroup; measured: no difference in speed).
#define SMLA_EMPTY_ARRIVALS(PAIR) ((PAIR) ? 256 + 8 : 256)
template <bool PAIR>
__device__ __forceinline__ void smla_release(u32 bar, int t, u32 peer) {
    tandem_mbar_arrive(bar);
    if (PAIR) {
        __syncwarp();
        // CTA-scope release, as CUTLASS's consumer release: this warp's reads of the buffer are done (their
        // values used); a cluster-scope release costs a MEMBAR per tile (measured: 5-6% of the kernel).
        if ((t & 31) == 0) tandem_mbar_arrive_remote_cta(tandem_peer(bar, peer));
        __syncwarp();
    }
}

__device__ __forceinline__ u32 smla_bf16x2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// Two e4m3 codes (bytes `sel` of w, see prmt) -> two bf16 whose values are the codes' times 2^-120, times f.
__device__ __forceinline__ u32 smla_e4m3x2(u32 w, u32 sel, u32 f) {
    u32 t;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(t) : "r"(w), "r"(sel));
    return smla_bf16x2_mul((t & 0x80008000u) | ((t >> 4) & 0x07f007f0u), f);
}

// 16 codes -> 16 bf16 (two 16-byte chunks).
__device__ __forceinline__ void smla_dequant16(uint4 raw, u32 f, uint4& lo, uint4& hi) {
    lo.x = smla_e4m3x2(raw.x, 0x1404u, f);
    lo.y = smla_e4m3x2(raw.x, 0x3424u, f);
    lo.z = smla_e4m3x2(raw.y, 0x1404u, f);
    lo.w = smla_e4m3x2(raw.y, 0x3424u, f);
    hi.x = smla_e4m3x2(raw.z, 0x1404u, f);
    hi.y = smla_e4m3x2(raw.z, 0x3424u, f);
    hi.z = smla_e4m3x2(raw.w, 0x1404u, f);
    hi.w = smla_e4m3x2(raw.w, 0x3424u, f);
}

// Two f32 rounded to bf16 (round to nearest even), lo in the low half.
__device__ __forceinline__ u32 smla_pack_bf16(float lo, float hi) {
    return (u32)tandem_bf16(lo) | ((u32)tandem_bf16(hi) << 16);
}
// The same bits from one F2FP instruction (tandem_bf16x2) in the staged form: its softmax converts 32 values
// a thread per tile on warpgroup 0's critical chain, and the packed form made it 6-7% faster (H200). The
// gathering forms keep the two conversions: with the packed form their decode took about 2% longer (b = 64,
// 32K, three rounds each; bench/RESULTS.md).
template <bool PACKED>
__device__ __forceinline__ u32 smla_pack_bf16_as(float lo, float hi) {
    return PACKED ? tandem_bf16x2(lo, hi) : smla_pack_bf16(lo, hi);
}
__device__ __forceinline__ float smla_bf16_val(u32 bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ int smla_selected(const int* sel_len, int query, int topk) {
    return sel_len ? max(0, min(sel_len[query], topk)) : topk;
}

// One producer thread's share of 32 tokens of a tile: for its token, 16 codes of each 64-dim group, the
// four tile scales and 16 k_pe values (four threads cover a token). Zeros for a token that is not selected.
struct SmlaRound {
    uint4 nope[8], rope[2];
    float4 sc;
    bool ok;

    __device__ __forceinline__ void load(const u8* latent, int pos, int phys, bool usable, int num_blocks, int cg) {
        ok = usable && phys >= 0 && phys < num_blocks;
        const u8* e = latent + ((i64)(ok ? phys : 0) * 64 + (ok ? pos & 63 : 0)) * SMLA_ENTRY;
#pragma unroll
        for (int g = 0; g < 8; ++g)
            nope[g] = ok ? *reinterpret_cast<const uint4*>(e + 64 * g + 16 * cg) : make_uint4(0, 0, 0, 0);
        sc = ok ? *reinterpret_cast<const float4*>(e + 512) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < 2; ++i)
            rope[i] = ok ? *reinterpret_cast<const uint4*>(e + 528 + 32 * cg + 16 * i) : make_uint4(0, 0, 0, 0);
    }

    // Dequantized into the K/V buffer `kb` at token `slot`: dims 64 g + 16 cg .. + 15 are column chunks
    // 8 g + 2 cg and + 1, k_pe dims 16 cg .. + 15 chunks 64 + 2 cg and + 1. With PAIR, the same 16-byte
    // chunks also go to the peer CTA's buffer at `peer_kb` (st.async, counted on `peer_bar`).
    template <bool PAIR>
    __device__ __forceinline__ void store(u8* kb, int slot, int cg, u32 peer_kb, u32 peer_bar) const {
        const float s4[4] = {sc.x, sc.y, sc.z, sc.w};
#pragma unroll
        for (int g = 0; g < 8; ++g) {
            // scale * 2^64 as bf16 (exact: a power of two), in both halves.
            const u32 fb = tandem_bf16(s4[g >> 1] * 18446744073709551616.0f);
            uint4 lo, hi;
            smla_dequant16(nope[g], fb | (fb << 16), lo, hi);
            const int c8 = 8 * g + 2 * cg;
            *reinterpret_cast<uint4*>(kb + c8 * 1024 + slot * 16) = lo;
            *reinterpret_cast<uint4*>(kb + (c8 + 1) * 1024 + slot * 16) = hi;
            if (PAIR) {
                smla_st_async(peer_kb + c8 * 1024 + slot * 16, lo, peer_bar);
                smla_st_async(peer_kb + (c8 + 1) * 1024 + slot * 16, hi, peer_bar);
            }
        }
        const u32 two_m56 = 0x23802380u;  // bf16 2^-56, twice
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            uint4 v = rope[i];
            v.x = smla_bf16x2_mul(v.x, two_m56);
            v.y = smla_bf16x2_mul(v.y, two_m56);
            v.z = smla_bf16x2_mul(v.z, two_m56);
            v.w = smla_bf16x2_mul(v.w, two_m56);
            *reinterpret_cast<uint4*>(kb + (64 + 2 * cg + i) * 1024 + slot * 16) = v;
            if (PAIR) smla_st_async(peer_kb + (64 + 2 * cg + i) * 1024 + slot * 16, v, peer_bar);
        }
    }
};

// The kernel body. PAIR: the grid's two head blocks of a query (128 heads) form a cluster of two CTAs whose
// producers each gather and dequantize half of every tile (32 tokens) and store it into both CTAs' buffers
// (their own by st.shared, the peer's by st.async counted on the peer's `full_remote` mbarrier); a buffer is
// free again when the consumers of both CTAs are done with it (`empty` counts the arrivals of this CTA's
// consumer threads and one of each of the peer's consumer warps). That halves each CTA's gather and
// dequantization work and doubles how many tiles a producer thread keeps in flight (one 32-token share of two
// tiles instead of two shares of one).
// The K operand of Q K^T for k-step ks (dims 16 ks ..): the decode kernel's interleaved buffer or the staged
// form's swizzled K-major tiles.
template <bool STAGED>
__device__ __forceinline__ unsigned long long smla_desc_k(u32 kbuf, int ks) {
    return STAGED ? tandem_desc_sw128(kbuf + (ks >> 2) * 8192 + (ks & 3) * 32)
                  : tandem_desc_inter(kbuf + ks * 2048, 1024, 128);
}

// The V operand of P V for output half `half` (dims 256 half ..) and k-step kk (tokens 16 kk ..): the decode
// kernel's interleaved buffer (8 dims x 64 tokens a 1024-byte column chunk) or the staged form's swizzled
// K-major tiles read MN-major (token rows of 64 dims, 8-token groups 1024 bytes apart, tiles 8192).
template <bool STAGED>
__device__ __forceinline__ unsigned long long smla_desc_v(u32 kbuf, int half, int kk) {
    return STAGED ? tandem_desc_sw128_mn(kbuf + half * 4 * 8192 + kk * 2048, 8192, 1024)
                  : tandem_desc_inter(kbuf + half * 32 * 1024 + kk * 256, 128, 1024);
}

// STAGED (never with PAIR): `latent` holds the staged bf16 rows of 576 instead, `num_blocks` their count,
// and `query_row[qi]` the row of query qi's position 0; `block_table` and `max_blocks` are not read.
template <bool PAIR, bool STAGED = false>
__device__ __forceinline__ void smla_decode(
    const u16* __restrict__ q,            // [queries, heads, 576] bf16
    int heads,
    const u8* __restrict__ latent,        // this layer's latent region: [num_blocks * 64] entries of 656 bytes
    int num_blocks,
    const int* __restrict__ block_table,  // [rows, max_blocks]
    int max_blocks,
    const int* __restrict__ query_row,    // null (query i reads table row i), or [queries] table rows
    const int* __restrict__ ctx_len,      // [queries]: causal length (positions at or past it are ignored)
    const int* __restrict__ sel,          // [queries, topk]: selected positions, -1 = none
    int topk,
    const int* __restrict__ sel_len,      // null, or [queries]: only the first sel_len entries are read
    int split_tiles,                      // tiles of SMLA_TILE tokens per split
    float scale,                          // softmax scale
    void* __restrict__ out,               // [queries, heads, 512] f32, or bf16 when out_bf16
    int out_bf16,
    float* __restrict__ lse,              // null, or [queries, heads] (natural log; -inf when nothing selected)
    float* __restrict__ part_o,           // [queries, max_splits, heads, 512]: splits' normalized outputs
    float* __restrict__ part_lse,         // [queries, max_splits, heads]
    int max_splits) {
    extern __shared__ __align__(1024) u8 smem_raw[];
    const u32 raw = (u32)__cvta_generic_to_shared(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;
    u8* const gbase = smem_raw + (base - raw);
    const int hb = blockIdx.x, qi = blockIdx.y, split = blockIdx.z;
    const int n = smla_selected(sel_len, qi, topk);
    const int n_tiles = (n + SMLA_TILE - 1) / SMLA_TILE;
    const int n_splits = max(1, (n_tiles + split_tiles - 1) / split_tiles);
    if (split >= n_splits || n_splits > max_splits) return;
    const int t0 = split * split_tiles, nt = max(0, min(t0 + split_tiles, n_tiles) - t0);

    const u32 sq = base, sk = base + SMLA_OFF_K, sp = base + SMLA_OFF_P;
    float* const s_scale = reinterpret_cast<float*>(gbase + SMLA_OFF_SCALE);
    float* const s_norm = reinterpret_cast<float*>(gbase + SMLA_OFF_NORM);
    u32* const valid = reinterpret_cast<u32*>(gbase + SMLA_OFF_VALID);
    const u32 valid_sa = base + SMLA_OFF_VALID;
    const u32 bar_full = base + SMLA_OFF_BAR, bar_empty = bar_full + 16, bar_remote = bar_full + 32;
    const u32 rank = PAIR ? tandem_cluster_rank() : 0, peer = rank ^ 1;
    if (threadIdx.x == 0) {
        for (int b = 0; b < 2; ++b) {
            // STAGED: each producer thread arrives once after storing its selected flags and once (cp.async
            // noinc) when its copies of the tile have landed.
            tandem_mbar_init(bar_full + 8 * b, STAGED ? 256 : 128);
            tandem_mbar_init(bar_empty + 8 * b, SMLA_EMPTY_ARRIVALS(PAIR));
            tandem_mbar_init(bar_remote + 8 * b, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    // Q: 64 heads (zeros past `heads`) x 576 dims into 9 swizzled 64 x 64 tiles.
    for (int c = threadIdx.x; c < SMLA_HEADS * (SMLA_DQK / 8); c += SMLA_THREADS) {
        const int h = c / (SMLA_DQK / 8), k = c % (SMLA_DQK / 8);
        const u32 dst = sq + (k >> 3) * 8192 + tandem_sw128(h, k & 7);
        const int gh = hb * SMLA_HEADS + h;
        if (gh < heads)
            tandem_cp_async16(dst, q + ((i64)qi * heads + gh) * SMLA_DQK + k * 8);
        else
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(dst), "r"(0u) : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    // The peer's barriers are initialized before anything is sent to them.
    if (PAIR) tandem_cluster_sync();

    const int wg = threadIdx.x >> 7, t = threadIdx.x & 127;
    const int warp = t >> 5, lane = t & 31;
    if (wg == 2 && STAGED) {
        // ----- staged producer: copy the selected rows -----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 128;");
        const u16* stg = reinterpret_cast<const u16*>(latent);
        const i64 rb = query_row[qi];
        const int* rsel = sel + (i64)qi * topk;
        const int clen = ctx_len[qi];
        // The staged form's K/V buffer is 9 tiles of 64 tokens x 64 dims in the 128-byte-swizzled K-major layout
        // (token rows of 128 bytes, as FlashMLA's): eight lanes copy one token's 128-byte piece of a tile, whole
        // L2 lines in one shared-memory row (no bank conflicts), a warp instruction four tokens. Thread t takes
        // tokens 16 g + 4 w + (lane >> 3) (g < 4), chunk lane & 7 of each of the 9 pieces.
        const int c8 = lane & 7;
        int slots[SMLA_STAGE_TOKENS];
#pragma unroll
        for (int g = 0; g < SMLA_STAGE_TOKENS; ++g) slots[g] = 16 * g + 4 * warp + (lane >> 3);
        auto position = [&](int tile, int slot) -> int {
            const int s = tile * SMLA_TILE + slot;
            return tile < t0 + nt && s < n ? rsel[s] : -1;
        };
        int pos[SMLA_STAGE_TOKENS];
#pragma unroll
        for (int g = 0; g < SMLA_STAGE_TOKENS; ++g) pos[g] = position(t0, slots[g]);
        for (int it = 0; it < nt; ++it) {
            const int b = it & 1;
            const u32 phase = (it >> 1) & 1;
            const u32 kb = sk + b * SMLA_K_BYTES;
            int nxt[SMLA_STAGE_TOKENS];
            bool ok[SMLA_STAGE_TOKENS];
            const u16* src[SMLA_STAGE_TOKENS];
#pragma unroll
            for (int g = 0; g < SMLA_STAGE_TOKENS; ++g) {
                nxt[g] = position(t0 + it + 1, slots[g]);
                ok[g] = pos[g] >= 0 && pos[g] < clen && rb >= 0 && rb + pos[g] < (i64)num_blocks;
                src[g] = stg + (ok[g] ? rb + pos[g] : 0) * SMLA_DQK;
            }
            tandem_mbar_wait(bar_empty + 8 * b, phase ^ 1);
            if (c8 == 0)
#pragma unroll
                for (int g = 0; g < SMLA_STAGE_TOKENS; ++g) valid[b * 64 + slots[g]] = ok[g] ? 1u : 0u;
            tandem_mbar_arrive(bar_full + 8 * b);
#pragma unroll
            for (int g = 0; g < SMLA_STAGE_TOKENS; ++g)
#pragma unroll
                for (int k = 0; k < SMLA_DQK / 64; ++k) {
                    const u32 dst = kb + k * 8192 + tandem_sw128(slots[g], c8);
                    const u16* from = src[g] + k * 64 + c8 * 8;
                    tandem_cp_async16_zfill(dst, from, ok[g] ? 16u : 0u);
                }
            asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar_full + 8 * b) : "memory");
#pragma unroll
            for (int g = 0; g < SMLA_STAGE_TOKENS; ++g) pos[g] = nxt[g];
        }
    } else if (wg == 2) {
        // ----- producer: gather, dequantize, store -----
        // Registers: the launch gives 168 a thread (65536 / 384, rounded down to 8); the producer gives 40
        // back, which WG0 takes (o, s and p live at once there). WG1 keeps 168: 128 + 168 + 208 = 3 x 168.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 128;");
        const int* rsel = sel + (i64)qi * topk;
        const int* table = block_table + (i64)(query_row ? query_row[qi] : qi) * max_blocks;
        const int clen = ctx_len[qi];
        const int slot0 = warp * 8 + (lane & 7), cg = lane >> 3;
        // A token's bytes take three dependent loads (its position, the block-table entry, the entry), so they
        // are pipelined: a thread holds two 32-token shares (SmlaRound) of entries in flight, whose block-table
        // entries were loaded one step earlier and positions two steps earlier, so nothing waits on a load
        // issued in the same step until the conversion. A share's registers are refilled as soon as it is
        // stored. Alone, a CTA's step is one tile and its two shares are the tile's halves; in a pair, each
        // CTA converts one half (its rank's) of every tile, a step is one tile and the two shares in flight
        // are that tile and the next (share j of step it is tile t0 + it + j, refilled with tile it + 2).
        auto position = [&](int tile, int half) -> int {
            const int s = tile * SMLA_TILE + half * 32 + slot0;
            return tile < t0 + nt && s < n ? rsel[s] : -1;
        };
        auto usable = [&](int pos) { return pos >= 0 && pos < clen && pos < max_blocks * SMLA_TILE; };
        auto block_of = [&](int pos) -> int { return usable(pos) ? table[pos >> 6] : -1; };
        SmlaRound rd[2];
        // Per share slot j: the position and table entry of what it loads next, the position after that.
        int pos1[2], phys1[2], pos2[2], phys2[2], pos3[2];
        if (PAIR) {
            const int h = (int)rank;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int p0 = position(t0 + j, h);
                rd[j].load(latent, p0, block_of(p0), usable(p0), num_blocks, cg);
            }
            // Slot j (j = it & 1 when stored) is next refilled with tile it + 2: slot 0 with t0 + 2, slot 1
            // with t0 + 3; positions one refill later.
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                pos1[j] = position(t0 + 2 + j, h);
                pos2[j] = position(t0 + 4 + j, h);
                phys1[j] = block_of(pos1[j]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int p0 = position(t0, j);
                rd[j].load(latent, p0, block_of(p0), usable(p0), num_blocks, cg);
                pos1[j] = position(t0 + 1, j);
                pos2[j] = position(t0 + 2, j);
                phys1[j] = block_of(pos1[j]);
            }
        }
        const u32 peer_k0 = PAIR ? tandem_peer(sk, peer) : 0, peer_valid = PAIR ? tandem_peer(valid_sa, peer) : 0;
        const u32 peer_remote0 = PAIR ? tandem_peer(bar_remote, peer) : 0;
        for (int it = 0; it < nt; ++it) {
            const int b = it & 1;
            const u32 phase = (it >> 1) & 1;
            u8* const kb = gbase + SMLA_OFF_K + b * SMLA_K_BYTES;
            if (PAIR) {
                // The share slot is it & 1: two copies of the step with a constant slot keep rd in registers.
#define SMLA_PAIR_STEP(j)                                                                                \
    {                                                                                                    \
        const int h = (int)rank;                                                                         \
        phys2[j] = block_of(pos2[j]);                                                                    \
        pos3[j] = position(t0 + it + 6, h);                                                              \
        /* Both CTAs' consumers are done with buffer b (tile it - 2). */                                 \
        tandem_mbar_wait_cluster(bar_empty + 8 * b, phase ^ 1);                                            \
        /* This CTA expects the peer's half of tile it. */                                               \
        if (t == 0) tandem_mbar_expect_tx(bar_remote + 8 * b, SMLA_REMOTE_BYTES);                          \
        const int slot = h * 32 + slot0;                                                                 \
        const u32 pbar = peer_remote0 + 8 * b;                                                           \
        rd[j].template store<true>(kb, slot, cg, peer_k0 + b * SMLA_K_BYTES, pbar);                      \
        if (cg == 0) {                                                                                   \
            valid[b * 64 + slot] = rd[j].ok ? 1u : 0u;                                                   \
            smla_st_async_b32(peer_valid + (b * 64 + slot) * 4, rd[j].ok ? 1u : 0u, pbar);               \
        }                                                                                                \
        rd[j].load(latent, pos1[j], phys1[j], usable(pos1[j]), num_blocks, cg);                          \
        pos1[j] = pos2[j];                                                                               \
        phys1[j] = phys2[j];                                                                             \
        pos2[j] = pos3[j];                                                                               \
    }
                if (b == 0)
                    SMLA_PAIR_STEP(0)
                else
                    SMLA_PAIR_STEP(1)
#undef SMLA_PAIR_STEP
            } else {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    phys2[j] = block_of(pos2[j]);
                    pos3[j] = position(t0 + it + 3, j);
                }
                tandem_mbar_wait(bar_empty + 8 * b, phase ^ 1);
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int slot = j * 32 + slot0;
                    rd[j].template store<false>(kb, slot, cg, 0, 0);
                    if (cg == 0) valid[b * 64 + slot] = rd[j].ok ? 1u : 0u;
                    rd[j].load(latent, pos1[j], phys1[j], usable(pos1[j]), num_blocks, cg);
                    pos1[j] = pos2[j];
                    phys1[j] = phys2[j];
                    pos2[j] = pos3[j];
                }
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            tandem_mbar_arrive(bar_full + 8 * b);
        }
    } else {
    // ----- consumers -----
    const int r0 = warp * 16 + (lane >> 2), r1 = r0 + 8, qd = lane & 3;
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    const int col0 = wg * 256;  // this warpgroup's output columns
    if (wg == 0) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 208;");
        // Logits in log2 units: S comes out 2^-56 times q . k (see above).
        const float sl2 = scale * 72057594037927936.0f * 1.4426950408889634f;
        float m0 = -1e30f, m1 = -1e30f, l0 = 0.0f, l1 = 0.0f;
        for (int it = 0; it < nt; ++it) {
            const int b = it & 1;
            const u32 phase = (it >> 1) & 1;
            const u32 kbuf = sk + b * SMLA_K_BYTES;
            tandem_mbar_wait(bar_full + 8 * b, phase);
            if (PAIR) tandem_mbar_wait_cluster(bar_remote + 8 * b, phase);
            // cp.async writes are the generic proxy's; wgmma reads through the async proxy.
            if (STAGED) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            float s[32];
            tandem_wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < SMLA_DQK / 16; ++ks)
                tandem_wgmma_bf16_64x64x16(s, tandem_desc_sw128(sq + (ks >> 2) * 8192 + (ks & 3) * 32),
                                           smla_desc_k<STAGED>(kbuf, ks), ks);
            tandem_wgmma_commit();
            tandem_wgmma_wait<0>();
            // Online softmax of rows r0 (s[4j + 0/1]) and r1 (s[4j + 2/3]), columns 8j + 2 qd + 0/1.
            const u32* vb = valid + b * 64;
            float mx0 = -__int_as_float(0x7f800000), mx1 = mx0;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const bool v = vb[8 * j + 2 * qd + e];
                    s[4 * j + e] = v ? s[4 * j + e] * sl2 : -__int_as_float(0x7f800000);
                    s[4 * j + 2 + e] = v ? s[4 * j + 2 + e] * sl2 : -__int_as_float(0x7f800000);
                    mx0 = fmaxf(mx0, s[4 * j + e]);
                    mx1 = fmaxf(mx1, s[4 * j + 2 + e]);
                }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
            const float c0 = exp2f(m0 - n0), c1 = exp2f(m1 - n1);
            m0 = n0;
            m1 = n1;
            u32 pk[16];  // P as bf16 pairs: pk[2j] row r0, pk[2j + 1] row r1, columns 8j + 2 qd + 0/1
            float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                pk[2 * j] = smla_pack_bf16_as<STAGED>(exp2f(s[4 * j] - n0), exp2f(s[4 * j + 1] - n0));
                pk[2 * j + 1] = smla_pack_bf16_as<STAGED>(exp2f(s[4 * j + 2] - n1), exp2f(s[4 * j + 3] - n1));
                sum0 += smla_bf16_val(pk[2 * j] & 0xffffu) + smla_bf16_val(pk[2 * j] >> 16);
                sum1 += smla_bf16_val(pk[2 * j + 1] & 0xffffu) + smla_bf16_val(pk[2 * j + 1] >> 16);
            }
            l0 = l0 * c0 + sum0;
            l1 = l1 * c1 + sum1;
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                o[4 * j] *= c0;
                o[4 * j + 1] *= c0;
                o[4 * j + 2] *= c1;
                o[4 * j + 3] *= c1;
            }
            // WG1 is done with the previous tile's P and rescale factors.
            if (it > 0) smla_bar_sync(SMLA_BAR_P_FREE);
            if (qd == 0) {
                s_scale[r0] = c0;
                s_scale[r1] = c1;
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                asm volatile("st.shared.u32 [%0], %1;" ::"r"(sp + r0 * 128 + ((j ^ (r0 & 7)) << 4) + qd * 4),
                             "r"(pk[2 * j])
                             : "memory");
                asm volatile("st.shared.u32 [%0], %1;" ::"r"(sp + r1 * 128 + ((j ^ (r1 & 7)) << 4) + qd * 4),
                             "r"(pk[2 * j + 1])
                             : "memory");
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            smla_bar_sync(SMLA_BAR_P_READY);
            tandem_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const u32 a[4] = {pk[4 * kk], pk[4 * kk + 1], pk[4 * kk + 2], pk[4 * kk + 3]};
                tandem_wgmma_bf16_64x256x16_rs_tb(o, a, smla_desc_v<STAGED>(kbuf, 0, kk), 1);
            }
            tandem_wgmma_commit();
            tandem_wgmma_wait<0>();
            smla_release<PAIR>(bar_empty + 8 * b, t, peer);
        }
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        if (qd == 0) {
            s_norm[r0] = l0 > 0.0f ? 72057594037927936.0f / l0 : 0.0f;
            s_norm[r1] = l1 > 0.0f ? 72057594037927936.0f / l1 : 0.0f;
            const int h0 = hb * SMLA_HEADS + r0, h1 = hb * SMLA_HEADS + r1;
            const float ln2 = 0.6931471805599453f, ninf = -__int_as_float(0x7f800000);
            const float e0 = l0 > 0.0f ? (m0 + log2f(l0)) * ln2 : ninf, e1 = l1 > 0.0f ? (m1 + log2f(l1)) * ln2 : ninf;
            if (n_splits > 1) {
                float* pl = part_lse + ((i64)qi * max_splits + split) * heads;
                if (h0 < heads) pl[h0] = e0;
                if (h1 < heads) pl[h1] = e1;
            } else if (lse) {
                if (h0 < heads) lse[(i64)qi * heads + h0] = e0;
                if (h1 < heads) lse[(i64)qi * heads + h1] = e1;
            }
        }
        smla_bar_sync(SMLA_BAR_NORM);
    } else {
        for (int it = 0; it < nt; ++it) {
            const int b = it & 1;
            const u32 phase = (it >> 1) & 1;
            const u32 kbuf = sk + b * SMLA_K_BYTES;
            tandem_mbar_wait(bar_full + 8 * b, phase);
            if (PAIR) tandem_mbar_wait_cluster(bar_remote + 8 * b, phase);
            // cp.async writes are the generic proxy's; wgmma reads through the async proxy.
            if (STAGED) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            smla_bar_sync(SMLA_BAR_P_READY);
            const float c0 = s_scale[r0], c1 = s_scale[r1];
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                o[4 * j] *= c0;
                o[4 * j + 1] *= c0;
                o[4 * j + 2] *= c1;
                o[4 * j + 3] *= c1;
            }
            tandem_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                tandem_wgmma_bf16_64x256x16_tb(o, tandem_desc_sw128(sp + kk * 32), smla_desc_v<STAGED>(kbuf, 1, kk), 1);
            tandem_wgmma_commit();
            tandem_wgmma_wait<0>();
            smla_release<PAIR>(bar_empty + 8 * b, t, peer);
            if (it + 1 < nt) smla_bar_sync(SMLA_BAR_P_FREE);
        }
        smla_bar_sync(SMLA_BAR_NORM);
    }

    // Both consumers: their 256 output columns, rows r0 and r1.
    const float f0 = s_norm[r0], f1 = s_norm[r1];
    const int h0 = hb * SMLA_HEADS + r0, h1 = hb * SMLA_HEADS + r1;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int col = col0 + 8 * j + 2 * qd;
        const float a0 = o[4 * j] * f0, a1 = o[4 * j + 1] * f0, b0 = o[4 * j + 2] * f1, b1 = o[4 * j + 3] * f1;
        if (n_splits > 1) {
            float* po = part_o + ((i64)qi * max_splits + split) * heads * SMLA_DV;
            if (h0 < heads) *reinterpret_cast<float2*>(po + (i64)h0 * SMLA_DV + col) = make_float2(a0, a1);
            if (h1 < heads) *reinterpret_cast<float2*>(po + (i64)h1 * SMLA_DV + col) = make_float2(b0, b1);
        } else if (out_bf16) {
            u32* ob = reinterpret_cast<u32*>(out);
            if (h0 < heads) ob[(((i64)qi * heads + h0) * SMLA_DV + col) >> 1] = smla_pack_bf16_as<STAGED>(a0, a1);
            if (h1 < heads) ob[(((i64)qi * heads + h1) * SMLA_DV + col) >> 1] = smla_pack_bf16_as<STAGED>(b0, b1);
        } else {
            float* of = reinterpret_cast<float*>(out);
            if (h0 < heads) *reinterpret_cast<float2*>(of + ((i64)qi * heads + h0) * SMLA_DV + col) = make_float2(a0, a1);
            if (h1 < heads) *reinterpret_cast<float2*>(of + ((i64)qi * heads + h1) * SMLA_DV + col) = make_float2(b0, b1);
        }
    }
    }
    // Neither CTA of a pair leaves while the other may still send to its shared memory or barriers.
    if (PAIR) tandem_cluster_sync();
}

#define SMLA_ENTRY_ARGS                                                                                          \
    const u16 *__restrict__ q, int heads, const u8 *__restrict__ latent, int num_blocks,                         \
        const int *__restrict__ block_table, int max_blocks, const int *__restrict__ query_row,                  \
        const int *__restrict__ ctx_len, const int *__restrict__ sel, int topk, const int *__restrict__ sel_len, \
        int split_tiles, float scale, void *__restrict__ out, int out_bf16, float *__restrict__ lse,             \
        float *__restrict__ part_o, float *__restrict__ part_lse, int max_splits
#define SMLA_PASS_ARGS                                                                                         \
    q, heads, latent, num_blocks, block_table, max_blocks, query_row, ctx_len, sel, topk, sel_len, split_tiles, \
        scale, out, out_bf16, lse, part_o, part_lse, max_splits

// Any head count: each 64-head block a CTA of its own.
extern "C" __global__ void __launch_bounds__(SMLA_THREADS, 1) tandem_sparse_mla_decode(SMLA_ENTRY_ARGS) {
    smla_decode<false>(SMLA_PASS_ARGS);
}

// Exactly two head blocks (128 heads): the pair form, grid.x = 2 and one cluster per query and split.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(SMLA_THREADS, 1)
    tandem_sparse_mla_decode_pair(SMLA_ENTRY_ARGS) {
    smla_decode<true>(SMLA_PASS_ARGS);
}

// The staged prefill form (see the top of this file): any head count, a CTA per head block, `latent` the
// staged rows, `num_blocks` their count, `query_row` each query's first row.
extern "C" __global__ void __launch_bounds__(SMLA_THREADS, 1) tandem_sparse_mla_prefill(SMLA_ENTRY_ARGS) {
    smla_decode<false, true>(SMLA_PASS_ARGS);
}

// Staged rows for tandem_sparse_mla_prefill: row r = the bf16 values the gathering producer stores for the
// cache entry at slots[r] (c as its e4m3 value times scale times 2^-56, then k_pe times 2^-56), zeros for a
// slot that is negative or outside the region's num_blocks blocks. 64 threads a row, four rows a CTA: thread
// j < 32 converts codes 16 j .. 16 j + 15, thread 32 + i copies k_pe values 8 i .. 8 i + 7.
extern "C" __global__ void __launch_bounds__(256) tandem_sparse_mla_stage(const u8* __restrict__ latent,
                                                                          int num_blocks,
                                                                          const i64* __restrict__ slots, int rows,
                                                                          u16* __restrict__ out) {
    const int r = blockIdx.x * 4 + (threadIdx.x >> 6), j = threadIdx.x & 63;
    if (r >= rows || j >= 40) return;
    const i64 slot = slots[r];
    const bool ok = slot >= 0 && slot < (i64)num_blocks * SMLA_TILE;
    const u8* e = latent + (ok ? slot : 0) * SMLA_ENTRY;
    u16* o = out + (i64)r * SMLA_DQK;
    uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
    if (j < 32) {
        if (ok) {
            const float sc = reinterpret_cast<const float*>(e + 512)[j >> 3];
            const u32 fb = tandem_bf16(sc * 18446744073709551616.0f);
            smla_dequant16(*reinterpret_cast<const uint4*>(e + 16 * j), fb | (fb << 16), lo, hi);
        }
        *reinterpret_cast<uint4*>(o + 16 * j) = lo;
        *reinterpret_cast<uint4*>(o + 16 * j + 8) = hi;
    } else {
        const int i = j - 32;
        if (ok) {
            const u32 two_m56 = 0x23802380u;
            lo = *reinterpret_cast<const uint4*>(e + 528 + 16 * i);
            lo.x = smla_bf16x2_mul(lo.x, two_m56);
            lo.y = smla_bf16x2_mul(lo.y, two_m56);
            lo.z = smla_bf16x2_mul(lo.z, two_m56);
            lo.w = smla_bf16x2_mul(lo.w, two_m56);
        }
        *reinterpret_cast<uint4*>(o + 512 + 8 * i) = lo;
    }
}

// Splits -> output, for queries with more than one split (the others were written by the decode kernel):
// o = sum_s exp(lse_s - lse) o_s in split order, lse = m + log(sum_s exp(lse_s - m)). One CTA of 128 threads
// per (head, query), 4 columns a thread.
extern "C" __global__ void __launch_bounds__(128) tandem_sparse_mla_combine(
    const float* __restrict__ part_o, const float* __restrict__ part_lse, int heads, int max_splits,
    const int* __restrict__ sel_len, int topk, int split_tiles, void* __restrict__ out, int out_bf16,
    float* __restrict__ lse) {
    const int h = blockIdx.x, qi = blockIdx.y;
    const int n = smla_selected(sel_len, qi, topk);
    const int n_tiles = (n + SMLA_TILE - 1) / SMLA_TILE;
    const int n_splits = max(1, (n_tiles + split_tiles - 1) / split_tiles);
    if (n_splits == 1 || n_splits > max_splits) return;
    const float* pl = part_lse + (i64)qi * max_splits * heads + h;
    float m = -__int_as_float(0x7f800000);
    for (int s = 0; s < n_splits; ++s) m = fmaxf(m, pl[(i64)s * heads]);
    float sum = 0.0f;
    for (int s = 0; s < n_splits; ++s) sum += m == -__int_as_float(0x7f800000) ? 0.0f : expf(pl[(i64)s * heads] - m);
    const int col = threadIdx.x * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (sum > 0.0f) {
        for (int s = 0; s < n_splits; ++s) {
            const float w = __fdiv_rn(expf(pl[(i64)s * heads] - m), sum);
            const float4 v = *reinterpret_cast<const float4*>(
                part_o + (((i64)qi * max_splits + s) * heads + h) * SMLA_DV + col);
            acc.x = __fmaf_rn(w, v.x, acc.x);
            acc.y = __fmaf_rn(w, v.y, acc.y);
            acc.z = __fmaf_rn(w, v.z, acc.z);
            acc.w = __fmaf_rn(w, v.w, acc.w);
        }
    }
    const i64 o = ((i64)qi * heads + h) * SMLA_DV + col;
    if (out_bf16) {
        u32* ob = reinterpret_cast<u32*>(out);
        ob[o >> 1] = smla_pack_bf16(acc.x, acc.y);
        ob[(o >> 1) + 1] = smla_pack_bf16(acc.z, acc.w);
    } else {
        *reinterpret_cast<float4*>(reinterpret_cast<float*>(out) + o) = acc;
    }
    if (lse && threadIdx.x == 0) lse[(i64)qi * heads + h] = sum > 0.0f ? m + logf(sum) : m;
}
