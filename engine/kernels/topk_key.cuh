// The top-k rule's order-preserving key of a score and the first-pass histogram layout, shared by the
// indexer scorer (which can count the first digit as it writes the scores) and the top-k kernel.
#pragma once
#include "common.cuh"

// Histogram words per row: 2048 counts of the key's top 11 bits, then the row's NaN count.
#define TOPK_HIST_BINS 2048
#define TOPK_HIST_NAN 2048
#define TOPK_HIST_WORDS 2049

// Order-preserving key of a score; 0 for NaN (no score maps to it). -0.0 maps to +0.0's key.
__device__ __forceinline__ u32 tandem_topk_key(float s) {
    u32 b = __float_as_uint(s);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0;  // NaN
    if (b == 0x80000000u) b = 0;                   // -0.0 == +0.0
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
