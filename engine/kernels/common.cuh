// Small device helpers shared by tandem's kernel families. Passed to NVRTC as an in-memory header, so
// the kernel cache key covers its text (engine::cuda::kernels).
//
// No CUDA headers are needed: conversions are single PTX instructions whose rounding is the one the CPU
// backend implements (kv-cache/src/fp8.rs): round to nearest even, saturating to +-448 for e4m3.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define TANDEM_E4M3_MAX 448.0f
#define TANDEM_AMAX_FLOOR 1e-4f

// Two f32 -> two e4m3 bytes (lo in the low byte), RNE, saturating (sm_89+).
__device__ __forceinline__ u16 tandem_e4m3x2(float lo, float hi) {
    u16 r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

// f32 -> bf16 bits, RNE.
__device__ __forceinline__ u16 tandem_bf16(float x) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// Two f32 -> two bf16 (lo in the low half), RNE: the bits of two tandem_bf16 from one F2FP instruction
// instead of two conversions on the slower F2F pipe.
__device__ __forceinline__ u32 tandem_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Largest |x| across the warp (max is exact and order-free, so any reduction order gives the same bits).
__device__ __forceinline__ float tandem_warp_amax(float a) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    return a;
}

// The ue8m0 group scale of engine::fp8::group_scale: max(amax, 1e-4) / 448 rounded up to a power of two.
__device__ __forceinline__ float tandem_ue8m0_scale(float amax) {
    float s = fmaxf(amax, TANDEM_AMAX_FLOOR) * (1.0f / TANDEM_E4M3_MAX);
    u32 bits = __float_as_uint(s);
    int e = (int)((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0 ? 1 : 0);
    // s >= 1e-4 / 448 keeps e far above the subnormal range; an infinite amax gives an infinite scale.
    return e > 127 ? __int_as_float(0x7f800000) : __uint_as_float((u32)(e + 127) << 23);
}

// Quantizes 4 values of a group times 1/scale (exact for power-of-two scales) into 4 bytes. `satfinite`
// clamps to +-448 as the CPU's clamp does.
__device__ __forceinline__ u32 tandem_e4m3x4(float4 v, float inv) {
    return (u32)tandem_e4m3x2(v.x * inv, v.y * inv) | ((u32)tandem_e4m3x2(v.z * inv, v.w * inv) << 16);
}
