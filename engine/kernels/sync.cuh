// Hopper (sm_90) synchronization helpers shared by tandem's pipelined kernels: mbarriers (arrive, expected
// transaction bytes, parity waits) and clusters of CTAs (rank, distributed shared-memory addresses, remote
// arrivals, the cluster barrier), per the PTX ISA ("Parallel Synchronization and Communication
// Instructions: mbarrier", "Cluster"). Passed to NVRTC as an in-memory header.
#pragma once
#include "common.cuh"

// A CUDA tensor map (CUtensorMap: 128 opaque bytes, 64-byte aligned), passed by value as a
// __grid_constant__ parameter and used through its address.
struct alignas(64) TandemTensorMap {
    unsigned long long opaque[16];
};

// A 2-D TMA load of the box at (x: innermost, in elements; y: row) into shared memory, completing on `bar`.
__device__ __forceinline__ void tandem_tma_2d(u32 dst, const TandemTensorMap* map, int x, int y, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            dst),
        "l"((unsigned long long)map), "r"(x), "r"(y), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void tandem_mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void tandem_mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One arrival that also expects `bytes` of asynchronous transactions (TMA, st.async) in this phase.
__device__ __forceinline__ void tandem_mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void tandem_mbar_wait(u32 bar, u32 parity) {
    u32 done = 0;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// The same wait with cluster-scope acquire: data the peer CTA wrote (st.async) or released before arriving.
__device__ __forceinline__ void tandem_mbar_wait_cluster(u32 bar, u32 parity) {
    u32 done = 0;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// The address of this CTA's shared-memory address `a` in the CTA of rank `peer_rank` of the cluster.
__device__ __forceinline__ u32 tandem_peer(u32 a, u32 peer_rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(peer_rank));
    return r;
}
// An arrival on a peer's mbarrier with CTA-scope release (CUTLASS's ClusterBarrier::arrive(cta_id)): for
// "done reading the buffer you write", where the reads are complete (their values used). A cluster-scope
// release (`.release.cluster`) would put a MEMBAR before every such arrival: measured, half the GEMM's
// speed and 5-6% of the sparse MLA decode's.
__device__ __forceinline__ void tandem_mbar_arrive_remote_cta(u32 peer_bar) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(peer_bar) : "memory");
}
__device__ __forceinline__ void tandem_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 tandem_cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
