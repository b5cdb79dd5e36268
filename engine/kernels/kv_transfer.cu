// What kv-transfer runs on a GPU cache pool (engine::cuda::pool):
//
// tandem_kv_hash: the transfer checksum, the sum of kv_cache::hash (kv-cache/src/hash.rs), which the host
// computes in one pass and this kernel in parallel, bit for bit the same (integer adds modulo 2^64 in any
// order). The host finishes the digest (length, avalanche) and adds the last word's term where the stream
// ends inside a word. One CTA per task: `words` whole 8-byte words at pool offset `offset`, the first being
// word `word0` of the stream. Offsets are 8-byte aligned (checked on the host).
//
// tandem_kv_copy: gathers a scattered request's pieces into one buffer before it is sent, and scatters a
// received buffer into the blocks, so a fragmented block table moves in a few large transfers. One CTA per
// task of at most 64 KiB; 16-byte streaming (evict-first) global loads and stores where source, destination and length allow,
// bytes otherwise.
#include "common.cuh"

#define TANDEM_HASH_THREADS 256
#define TANDEM_HASH_UNROLL 4

struct KvHashTask {
    unsigned long long offset;
    unsigned long long word0;
    unsigned long long words;
};

// kv_cache::hash::term.
__device__ __forceinline__ unsigned long long tandem_hash_term(unsigned long long w, unsigned long long j) {
    const unsigned long long P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full;
    const unsigned long long x = w ^ ((j + 1ull) * P1 ^ P2);
    return (x & 0xffffffffull) * (x >> 32) + ((w << 29) | (w >> 35));
}

extern "C" __global__ void __launch_bounds__(TANDEM_HASH_THREADS) tandem_kv_hash(
    const u8* __restrict__ pool, const KvHashTask* __restrict__ tasks, unsigned long long* __restrict__ sum) {
    const KvHashTask t = tasks[blockIdx.x];
    const unsigned long long* w = reinterpret_cast<const unsigned long long*>(pool + t.offset);
    unsigned long long acc = 0;
    const unsigned long long step = TANDEM_HASH_THREADS * TANDEM_HASH_UNROLL;
    unsigned long long i = threadIdx.x;
    // Several independent loads in flight per thread, then the remainder.
    for (; i + (TANDEM_HASH_UNROLL - 1) * TANDEM_HASH_THREADS < t.words; i += step) {
        unsigned long long v[TANDEM_HASH_UNROLL];
#pragma unroll
        for (int u = 0; u < TANDEM_HASH_UNROLL; u++) v[u] = __ldg(w + i + u * TANDEM_HASH_THREADS);
#pragma unroll
        for (int u = 0; u < TANDEM_HASH_UNROLL; u++) acc += tandem_hash_term(v[u], t.word0 + i + u * TANDEM_HASH_THREADS);
    }
    for (; i < t.words; i += TANDEM_HASH_THREADS) acc += tandem_hash_term(__ldg(w + i), t.word0 + i);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ unsigned long long part[TANDEM_HASH_THREADS / 32];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long s = 0;
        for (int k = 0; k < TANDEM_HASH_THREADS / 32; k++) s += part[k];
        atomicAdd(sum, s);
    }
}

#define TANDEM_COPY_THREADS 256

struct KvCopyTask {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long len;
};

extern "C" __global__ void __launch_bounds__(TANDEM_COPY_THREADS) tandem_kv_copy(const KvCopyTask* __restrict__ tasks) {
    const KvCopyTask t = tasks[blockIdx.x];
    if (((t.src | t.dst | t.len) & 15ull) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(t.src);
        uint4* d = reinterpret_cast<uint4*>(t.dst);
        const unsigned n = (unsigned)(t.len >> 4);
        unsigned i = threadIdx.x;
        for (; i + 3 * TANDEM_COPY_THREADS < n; i += 4 * TANDEM_COPY_THREADS) {
            uint4 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) v[u] = __ldcs(s + i + u * TANDEM_COPY_THREADS);
#pragma unroll
            for (int u = 0; u < 4; u++) __stcs(d + i + u * TANDEM_COPY_THREADS, v[u]);
        }
        for (; i < n; i += TANDEM_COPY_THREADS) __stcs(d + i, __ldcs(s + i));
    } else {
        const u8* s = reinterpret_cast<const u8*>(t.src);
        u8* d = reinterpret_cast<u8*>(t.dst);
        for (unsigned long long i = threadIdx.x; i < t.len; i += TANDEM_COPY_THREADS) d[i] = s[i];
    }
}
