/* Paged attention on the CPU, for hitchllm's CPU_ATTN backend.

   Reads keys and values where they lie in the paged cache (no gather into contiguous copies,
   which is what makes the pure-PyTorch path slow on a CPU: it copies every request's whole
   context once per layer per step). One work unit is one request and one KV head: its query
   heads (the GQA group) share each key and value row as it is read. Online softmax, block by
   block, in float32 (bfloat16 caches are widened on load; fp8 caches are decoded through a
   256-entry table per cache, which holds each byte's value times the layer's scale).

   Layouts (all contiguous):
     q, out          [num_tokens, num_heads, head_size] float32
     k_cache/v_cache [num_kv_heads, cache_blocks, block_size, head_size] float32, bfloat16
                     or fp8 (one byte, any format: k_lut/v_lut [256] float32 decode it)
     block_table     [num_reqs, bt_stride] int32
   Request r owns tokens q_start[r] .. q_start[r] + q_len[r] - 1, which sit at positions
   context_len[r] .. context_len[r] + q_len[r] - 1 of its sequence; token j attends causally
   to positions up to its own (the last `window` of them when window > 0). softcap > 0 applies
   softcap * tanh(score / softcap) to the scaled scores.

   Compiled by compiler.py with OpenMP where the compiler has it (the units are shared among
   num_threads threads), and built serial otherwise; with 512-bit vectors preferred where the
   compiler takes -mprefer-vector-width=512, so that a block's 16 scores are one vector. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_numerics.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef struct {
    const float *q;
    const void *k_cache, *v_cache;
    float *out;
    const int64_t *q_start, *q_len, *context_len;
    const int32_t *block_table;
    int64_t bt_stride, num_reqs, num_heads, num_kv_heads, head_size, block_size, cache_blocks;
    float scale, softcap;
    int64_t window;
    int kv_format;
    const float *k_lut, *v_lut;
} attn_args;

enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 };

/* exp(x) for x <= 0 (a score minus the running maximum): x = n ln2 + r with |r| <= ln2/2, a
   degree-6 polynomial for exp(r) (Cephes' coefficients), and 2^n put into the exponent bits.
   Written without calls so the loops around it vectorize. Relative error at most 1e-7 on
   [-1, 0], growing to 4e-6 toward -87 (the relaxed float flags fold the two-part ln2
   constant into one), where the weight itself is below 1e-30 of the maximum's 1: the absolute
   error stays under 6e-8 everywhere. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    int32_t bits, e;
    float p = exp_reduced(x, &e);
    memcpy(&bits, &p, 4);
    bits += (int32_t)((uint32_t)e << 23); /* e < 0: shift as unsigned, no UB */
    memcpy(&p, &bits, 4);
    return p;
}

/* Rows t0 .. t0 + n - 1 of one block of one head, as float32: in place for a float32 cache,
   widened into buf for a bfloat16 one, decoded through lut into buf for an fp8 one. */
static const float *rows_f32(const attn_args *a, const void *cache, const float *lut,
                             int64_t head, int64_t block, int64_t t0, int64_t n, int64_t d,
                             float *buf) {
    const int64_t off = ((head * a->cache_blocks + block) * a->block_size + t0) * d;
    if (a->kv_format == KV_F32) return (const float *)cache + off;
    if (a->kv_format == KV_FP8) {
        const uint8_t *src = (const uint8_t *)cache + off;
        for (int64_t i = 0; i < n * d; i++) buf[i] = lut[src[i]];
        return buf;
    }
    const uint16_t *src = (const uint16_t *)cache + off;
    uint32_t *dst = (uint32_t *)buf;
    for (int64_t i = 0; i < n * d; i++) dst[i] = (uint32_t)src[i] << 16;
    return buf;
}

/* Asks for one whole block of one head (the next one a unit reads) ahead of its use: the
   blocks of a request lie anywhere in the cache, where the hardware prefetcher cannot follow,
   and each block's keys and values are a few cache lines read once per unit. */
static inline void prefetch_block(const attn_args *a, const void *cache, int64_t head,
                                  int64_t block, int64_t d) {
    const int64_t esize = a->kv_format == KV_F32 ? 4 : a->kv_format == KV_BF16 ? 2 : 1;
    const char *p = (const char *)cache + (head * a->cache_blocks + block) * a->block_size * d
                    * esize;
    for (int64_t off = 0; off < a->block_size * d * esize; off += 64)
        __builtin_prefetch(p + off, 0, 3);
}

#if defined(__AVX512F__)
/* Lane t of the result: the sum of v[t]'s 16 lanes. Four rounds of pairwise interleave-and-add
   (within 128-bit lanes by floats, then by pairs, then across 128-bit lanes twice) reduce the
   16 vectors together: 15 adds for 16 dot products, where one horizontal sum each took 4. */
static inline __m512 sum16(const __m512 *v) {
    __m512 b[8], c[4];
    for (int j = 0; j < 8; j++)
        b[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) {
        const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
        c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                    _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                    _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

/* s[t] = scale * dot(q, k[t]) for the n <= 16 rows k[0..n-1] (d floats each, d a multiple of
   16); rows past n read the zero row. */
static inline __attribute__((always_inline)) void scores16(const float *q, const float *k,
                                                           int64_t n, const int64_t d,
                                                           const float *zero_row, float scale,
                                                           float *s) {
    const float *rows[16];
    for (int t = 0; t < 16; t++) rows[t] = t < n ? k + t * d : zero_row;
    __m512 acc[16];
    for (int t = 0; t < 16; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 16) {
        const __m512 qc = _mm512_loadu_ps(q + c);
        for (int t = 0; t < 16; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(rows[t] + c), qc, acc[t]);
    }
    _mm512_mask_storeu_ps(s, (__mmask16)((1u << n) - 1u),
                          _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

/* acc[0..d-1] += sum over t < n of p[t] * v[t], one 16-float column of acc at a time (held in
   a register across the rows). */
static inline __attribute__((always_inline)) void weighted_rows(float *acc, const float *p,
                                                                const float *v, int64_t n,
                                                                const int64_t d) {
    for (int64_t c = 0; c < d; c += 16) {
        __m512 a = _mm512_loadu_ps(acc + c);
        for (int64_t t = 0; t < n; t++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(v + t * d + c), a);
        _mm512_storeu_ps(acc + c, a);
    }
}

/* weighted_rows for all g heads of a group at once, g and d constants with g * d <= 256: the
   g * d / 16 accumulator columns stay in registers across the rows, so their FMA chains run
   side by side instead of one head after another (each column still adds the rows in order:
   the same sums, bit for bit). p holds head i's weights at p[i * p_stride + t]. */
static inline __attribute__((always_inline)) void weighted_rows_group(
    float *acc, const float *p, int64_t p_stride, const float *v, int64_t n, const int64_t d,
    const int64_t g) {
    __m512 a[16];
    const int64_t cols = d / 16;
    for (int64_t j = 0; j < g * cols; j++) a[j] = _mm512_loadu_ps(acc + j * 16);
    for (int64_t t = 0; t < n; t++) {
        const float *vt = v + t * d;
        for (int64_t i = 0; i < g; i++) {
            const __m512 pi = _mm512_set1_ps(p[i * p_stride + t]);
            for (int64_t c = 0; c < cols; c++)
                a[i * cols + c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(vt + c * 16),
                                                  a[i * cols + c]);
        }
    }
    for (int64_t j = 0; j < g * cols; j++) _mm512_storeu_ps(acc + j * 16, a[j]);
}

/* The group sizes with a register-resident copy of weighted_rows_group at head size d. */
static inline __attribute__((always_inline)) int weighted_group(float *acc, const float *p,
                                                                int64_t p_stride,
                                                                const float *v, int64_t n,
                                                                const int64_t d, int64_t g) {
#define GROUP_CASE(G) \
    case G: \
        if ((G) * d <= 256) { weighted_rows_group(acc, p, p_stride, v, n, d, G); return 1; } \
        return 0;
    switch (g) {
        GROUP_CASE(1)
        GROUP_CASE(2)
        GROUP_CASE(3)
        GROUP_CASE(4)
        GROUP_CASE(6)
        GROUP_CASE(8)
        default: return 0;
    }
#undef GROUP_CASE
}
#define VECTOR_ROWS(d) ((d) % 16 == 0)
#else
#define VECTOR_ROWS(d) 0
#endif

/* One request's queries of one KV head's group. d is a parameter so that the fixed-size
   copies below are compiled with a constant head size (unrolled, vectorized loops). */
static inline __attribute__((always_inline)) void attend(const attn_args *a, int64_t r,
                                                         int64_t kvh, float *scratch,
                                                         const int64_t d) {
    const int64_t bs = a->block_size;
    const int64_t g = a->num_heads / a->num_kv_heads;
    float *acc = scratch, *m = acc + g * d, *l = m + g, *s = l + g;
    float *kbuf = s + g * bs, *vbuf = kbuf + bs * d, *zero_row = vbuf + bs * d;
    (void)zero_row; /* read by the AVX-512 score loop only */
    const int32_t *bt = a->block_table + r * a->bt_stride;
    for (int64_t j = 0; j < a->q_len[r]; j++) {
        const int64_t tok = a->q_start[r] + j;
        const float *q = a->q + (tok * a->num_heads + kvh * g) * d;
        const int64_t hi = a->context_len[r] + j + 1;
        const int64_t lo = (a->window > 0 && hi > a->window) ? hi - a->window : 0;
        for (int64_t i = 0; i < g; i++) { m[i] = -FLT_MAX; l[i] = 0.f; }
        memset(acc, 0, sizeof(float) * g * d);
        for (int64_t c = lo / bs; c * bs < hi; c++) {
            if ((c + 1) * bs < hi) {
                prefetch_block(a, a->k_cache, kvh, bt[c + 1], d);
                prefetch_block(a, a->v_cache, kvh, bt[c + 1], d);
            }
            const int64_t t0 = c * bs > lo ? c * bs : lo;
            const int64_t t1 = (c + 1) * bs < hi ? (c + 1) * bs : hi;
            const int64_t n = t1 - t0;
            const float *k = rows_f32(a, a->k_cache, a->k_lut, kvh, bt[c], t0 - c * bs, n, d,
                                      kbuf);
#if defined(__AVX512F__)
            if (VECTOR_ROWS(d)) {
                for (int64_t i = 0; i < g; i++)
                    for (int64_t t = 0; t < n; t += 16)
                        scores16(q + i * d, k + t * d, n - t < 16 ? n - t : 16, d, zero_row,
                                 a->scale, s + i * bs + t);
            } else
#endif
            for (int64_t t = 0; t < n; t++) {
                const float *kt = k + t * d;
                for (int64_t i = 0; i < g; i++) {
                    const float *qi = q + i * d;
                    float dot = 0.f;
                    for (int64_t e = 0; e < d; e++) dot += qi[e] * kt[e];
                    s[i * bs + t] = dot * a->scale;
                }
            }
            for (int64_t i = 0; i < g; i++) {
                float *si = s + i * bs;
                if (a->softcap > 0.f)
                    for (int64_t t = 0; t < n; t++) si[t] = a->softcap * tanhf(si[t] / a->softcap);
                float mb = m[i];
                for (int64_t t = 0; t < n; t++) mb = si[t] > mb ? si[t] : mb;
                const float corr = exp_nonpositive(m[i] - mb);
                m[i] = mb;
                float sum = 0.f;
                for (int64_t t = 0; t < n; t++) { si[t] = exp_nonpositive(si[t] - mb); sum += si[t]; }
                l[i] = l[i] * corr + sum;
                float *ai = acc + i * d;
                for (int64_t e = 0; e < d; e++) ai[e] *= corr;
            }
            const float *v = rows_f32(a, a->v_cache, a->v_lut, kvh, bt[c], t0 - c * bs, n, d,
                                      vbuf);
#if defined(__AVX512F__)
            if (VECTOR_ROWS(d)) {
                if (!weighted_group(acc, s, bs, v, n, d, g))
                    for (int64_t i = 0; i < g; i++)
                        weighted_rows(acc + i * d, s + i * bs, v, n, d);
            } else
#endif
            for (int64_t t = 0; t < n; t++) {
                const float *vt = v + t * d;
                for (int64_t i = 0; i < g; i++) {
                    const float p = s[i * bs + t];
                    float *ai = acc + i * d;
                    for (int64_t e = 0; e < d; e++) ai[e] += p * vt[e];
                }
            }
        }
        for (int64_t i = 0; i < g; i++) {
            float *o = a->out + (tok * a->num_heads + kvh * g + i) * d;
            const float inv = 1.f / l[i];
            for (int64_t e = 0; e < d; e++) o[e] = acc[i * d + e] * inv;
        }
    }
}

/* The common head sizes get specialized copies; any other runs the generic one. */
#define ATTEND_FIXED(D) \
    static void attend_##D(const attn_args *a, int64_t r, int64_t h, float *s) { attend(a, r, h, s, D); }
ATTEND_FIXED(32)
ATTEND_FIXED(64)
ATTEND_FIXED(128)
ATTEND_FIXED(256)
static void attend_any(const attn_args *a, int64_t r, int64_t h, float *s) {
    attend(a, r, h, s, a->head_size);
}

typedef void (*unit_fn)(const attn_args *, int64_t, int64_t, float *);

static unit_fn unit_function(int64_t head_size) {
    return head_size == 32 ? attend_32 : head_size == 64 ? attend_64
        : head_size == 128 ? attend_128 : head_size == 256 ? attend_256 : attend_any;
}

/* Bytes of one thread's scratch buffer (zeroed: its last head_size floats are the zero row). */
static size_t scratch_bytes(const attn_args *a) {
    const int64_t g = a->num_heads / a->num_kv_heads;
    return sizeof(float) * (g * a->head_size + 2 * g + g * a->block_size
                            + 2 * a->block_size * a->head_size + a->head_size);
}

#define ATTN_ARGS                                                                              \
    {q, k_cache, v_cache, out, q_start, q_len, context_len, block_table, bt_stride, num_reqs, \
     num_heads, num_kv_heads, head_size, block_size, cache_blocks, (float)scale,              \
     (float)softcap, window, kv_format, k_lut, v_lut}

/* Returns 0, or -1 when a thread could not allocate its scratch buffer (out is then partly
   written). */
int hitch_paged_attention(HITCH_ATTENTION_PARAMS, int num_threads) {
    const attn_args a = ATTN_ARGS;
    const unit_fn fn = unit_function(head_size);
    const size_t scratch = scratch_bytes(&a);
    const int64_t units = num_reqs * num_kv_heads;
    int status = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = calloc(1, scratch);
        if (buf == NULL) {
#pragma omp atomic write
            status = -1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++)
            if (buf != NULL) fn(&a, u / num_kv_heads, u % num_kv_heads, buf);
        free(buf);
    }
    return status;
}

/* The same units computed the same way, on the calling thread alone, each claimed from
   *cursor (fetch-and-add) until none is left: threads that call this at once with the same
   arguments and cursor share the units, whichever claims one computing it (decode_layer.c's
   helper thread). Returns 0, or -1 when the scratch buffer could not be allocated (nothing
   claimed then). */
int hitch_paged_attention_claim(HITCH_ATTENTION_PARAMS, int64_t *cursor) {
    const attn_args a = ATTN_ARGS;
    const unit_fn fn = unit_function(head_size);
    const int64_t units = num_reqs * num_kv_heads;
    float *buf = calloc(1, scratch_bytes(&a));
    if (buf == NULL) {
        return -1;
    }
    for (int64_t u; (u = __atomic_fetch_add(cursor, 1, __ATOMIC_RELAXED)) < units;)
        fn(&a, u / num_kv_heads, u % num_kv_heads, buf);
    free(buf);
    return 0;
}
