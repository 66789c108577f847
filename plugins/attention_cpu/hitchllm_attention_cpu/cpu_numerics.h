/* Numerics shared by the plugin's C files (each is built on its own by compiler.py, which
   names a build by its source and this header, so a change here rebuilds all of them).
   Always inlined: the callers' loops are specialized and vectorized around them. */

#ifndef HITCH_CPU_NUMERICS_H
#define HITCH_CPU_NUMERICS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define HITCH_INLINE inline __attribute__((always_inline))

/* Round to nearest even, NaN kept quiet: c10::BFloat16's conversion. */
static HITCH_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for -87 <= x <= 0 as p * 2^n: x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts),
   p a degree-6 polynomial for exp(r) with Cephes' coefficients. Written without calls so the
   loops around it vectorize; the caller puts 2^n into p (or a scale) as it needs. */
static HITCH_INLINE float exp_reduced(float x, int32_t *n) {
    const float nf = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    *n = (int32_t)nf;
    return p * r * r + r + 1.0f;
}

/* The paged attention kernel's parameters (paged_attention.c defines the kernels,
   decode_layer.c calls them through pointers from that library). */
#define HITCH_ATTENTION_PARAMS                                                                    \
    const float *q, const void *k_cache, const void *v_cache, float *out,                     \
        const int64_t *q_start, const int64_t *q_len, const int64_t *context_len,             \
        const int32_t *block_table, int64_t bt_stride, int64_t num_reqs, int64_t num_heads,   \
        int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t cache_blocks,    \
        double scale, double softcap, int64_t window, int kv_format, const float *k_lut,      \
        const float *v_lut

#endif
