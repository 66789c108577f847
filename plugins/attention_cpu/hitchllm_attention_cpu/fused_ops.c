/* A decoder layer's elementwise work on the CPU, one pass per function, for
   hitchllm.models.fused (registered by attention_cpu's fused.py).

   Written op by op in PyTorch, RMSNorm is seven passes over its tensor (and seven operator
   dispatches), rotary a dozen and SiLU-and-mul three; at prompt sizes every pass streams a
   tensor larger than the L2, at decode sizes every dispatch is a fixed cost. Here each function
   reads its inputs once and writes its outputs once, rows shared among OpenMP threads when
   there are enough of them.

   Every rounding PyTorch's eager code makes is made here too, in the same order: each
   elementwise operation is computed in float32 and, for bfloat16 tensors, rounded to bfloat16
   (round to nearest even) where PyTorch stores a bfloat16 intermediate. Built without
   floating-point contraction or reassociation (compiler.py's FUSED_FLAGS), so rotary (products
   and sums only) equals PyTorch's bit for bit in float32 and bfloat16, and so does RMSNorm,
   whose sum of squares follows ATen's summation order (aten_sum). SiLU in float32 calls
   PyTorch's own vector exponential (Sleef's expf u10 in libtorch, whose address fused.py hands
   over) on the elements ATen's loop gives it and glibc's expf on the rest (silu_f32_run), so
   it equals F.silu bit for bit too; in bfloat16 the exponential is a polynomial (relative
   error ~1e-7), so SiLU can differ from PyTorch's by one bfloat16 unit after rounding, rarely
   (the Python side accepts that for bfloat16 only).

   dtype: 0 float32, 1 bfloat16, for every tensor argument but positions (int64) and the
   rotary tables (float32 [max_position, head_size / 2]). Rows may be strided (stride in
   elements); each row's elements are contiguous. Outputs are contiguous. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_numerics.h"

enum { F32 = 0, BF16 = 1 };

/* Every helper is inlined into a body specialized for one dtype (the public functions below
   call their body with a constant dtype), so no loop tests the dtype per element. */
#define INLINE __attribute__((always_inline))

/* Rows times width below which a call stays on the calling thread (waking OpenMP's threads
   costs more than the work). */
#define PARALLEL_MIN_WORK 32768

static inline INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Element i of a row in either dtype, as float32. */
static inline INLINE float load(const void *row, int64_t i, int dtype) {
    return dtype == BF16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline INLINE void store(void *row, int64_t i, float v, int dtype) {
    if (dtype == BF16) {
        ((uint16_t *)row)[i] = f32_to_bf16(v);
    } else {
        ((float *)row)[i] = v;
    }
}

/* v as the tensor dtype stores it (bfloat16: rounded), back in float32. */
static inline INLINE float rounded(float v, int dtype) {
    return dtype == BF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

static inline INLINE const char *row_at(const void *base, int64_t row, int64_t stride, int dtype) {
    return (const char *)base + row * stride * (dtype == BF16 ? 2 : 4);
}

/* Lanes of the float32 vector in the ATen sum kernel torch runs (Vectorized<float>::size() of
   the kernel's build: 8 for AVX2, which torch's x86 wheels dispatch sums to even on AVX-512
   CPUs; 16 for an AVX-512 build), which fix the order of its sums. fused.py finds it by
   comparing with torch (hitch_set_sum_lanes). */
static int sum_lanes = 8;

int hitch_set_sum_lanes(int lanes) {
    if (lanes != 16 && lanes != 8) {
        return -1;
    }
    sum_lanes = lanes;
    return 0;
}

/* ceil(log2(x)), and 1 for x <= 2 (c10's CeilLog2). */
static inline INLINE int64_t ceil_log2(int64_t x) {
    return x <= 2 ? 1 : 64 - __builtin_clzll((uint64_t)(x - 1));
}

/* acc[0..w) += item[0..w) */
static inline INLINE void add_item(float *acc, const float *item, int w) {
    for (int l = 0; l < w; ++l) {
        acc[l] += item[l];
    }
}

/* ATen's sum of `size` items of w lanes each (item i at v + i * w), lane by lane, in the order
   of SumKernel.cpp's row_sum / multi_row_sum: four interleaved accumulators (item 4i + k into
   accumulator k), each a cascade of four levels flushed every 2^p groups (p = max(4,
   ceil_log2(groups) / 4)), the items left after the last group of four into accumulator 0,
   then accumulators 1, 2, 3 added to it in turn. */
static inline INLINE void row_sum_items(const float *v, int64_t size, int w, float *out) {
    const int64_t groups = size / 4;
    const int64_t level_power = ceil_log2(groups) / 4 > 4 ? ceil_log2(groups) / 4 : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[4][4][16];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    while (i + level_step <= groups) {
        for (int64_t j = 0; j < level_step; ++j, ++i) {
            for (int k = 0; k < 4; ++k) {
                add_item(acc[0][k], v + (i * 4 + k) * w, w);
            }
        }
        for (int j = 1; j < 4; ++j) {
            for (int k = 0; k < 4; ++k) {
                add_item(acc[j][k], acc[j - 1][k], w);
                memset(acc[j - 1][k], 0, sizeof(acc[j - 1][k]));
            }
            if ((i & (level_mask << (j * level_power))) != 0) {
                break;
            }
        }
    }
    for (; i < groups; ++i) {
        for (int k = 0; k < 4; ++k) {
            add_item(acc[0][k], v + (i * 4 + k) * w, w);
        }
    }
    for (int j = 1; j < 4; ++j) {
        for (int k = 0; k < 4; ++k) {
            add_item(acc[0][k], acc[j][k], w);
        }
    }
    for (int64_t t = groups * 4; t < size; ++t) {
        add_item(acc[0][0], v + t * w, w);
    }
    for (int k = 1; k < 4; ++k) {
        add_item(acc[0][0], acc[0][k], w);
    }
    memcpy(out, acc[0][0], (size_t)w * sizeof(float));
}

/* The sum of n float32 values as torch.sum computes it over a contiguous last dimension
   (cascade_sum's inner case): with at least `lanes` values, row_sum_items over whole vectors,
   then 0 + the values past the last whole vector + each lane in turn; fewer values, row_sum
   over single values. Bit for bit torch's result (tests/test_cpug_norm.py). */
static inline INLINE float aten_sum(const float *v, int64_t n, int lanes) {
    float part[16];
    if (n < lanes) {
        row_sum_items(v, n, 1, part);
        return part[0];
    }
    const int64_t vectors = n / lanes;
    if (lanes == 16) {
        row_sum_items(v, vectors, 16, part);
    } else {
        row_sum_items(v, vectors, 8, part);
    }
    float sum = 0.0f;
    for (int64_t k = vectors * lanes; k < n; ++k) {
        sum += v[k];
    }
    for (int l = 0; l < lanes; ++l) {
        sum += part[l];
    }
    return sum;
}

/* 1 / sqrt(mean(x^2) + eps) over n float32 values as PyTorch's eager RMSNorm computes it:
   squares rounded (pow(2) is x * x), summed in ATen's order, divided by n (CPU mean is sum then
   division), eps rounded to float32 and added, then 1 / sqrt (ATen's rsqrt, vector and
   scalar). */
static inline INLINE float inverse_rms(const float *x, int64_t n, float eps) {
    float sq[n];
    for (int64_t i = 0; i < n; ++i) {
        sq[i] = x[i] * x[i];
    }
    return 1.0f / sqrtf(aten_sum(sq, n, sum_lanes) / (float)n + eps);
}

/* buf[i] = round(weight[i] * round(buf[i] / rms(buf))) over one row of n values: what
   PyTorch's RMSNorm stores, as float32. */
static inline INLINE void normalize_in_place(float *buf, int64_t n, const void *weight, float eps,
                                      int dtype) {
    const float r = inverse_rms(buf, n, eps);
    for (int64_t i = 0; i < n; ++i) {
        buf[i] = rounded(load(weight, i, dtype) * rounded(buf[i] * r, dtype), dtype);
    }
}

/* RMSNorm over rows of width values: out = rms_norm(x) or, with residual,
   sum_out = x + residual and out = rms_norm(sum_out). Returns 0. */
static inline INLINE void rms_norm_rows(const void *x, int64_t x_stride, const void *residual,
                                        int64_t res_stride, void *sum_out, const void *weight,
                                        void *out, int64_t rows, int64_t width, float eps,
                                        int dtype, int num_threads) {
    const int64_t esize = dtype == BF16 ? 2 : 4;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && rows > 1 && \
                                                  rows * width >= PARALLEL_MIN_WORK)
    {
        float buf[width];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; ++t) {
            const char *xr = row_at(x, t, x_stride, dtype);
            if (residual != NULL) {
                const char *rr = row_at(residual, t, res_stride, dtype);
                char *sr = (char *)sum_out + t * width * esize;
                for (int64_t i = 0; i < width; ++i) {
                    const float s = rounded(load(xr, i, dtype) + load(rr, i, dtype), dtype);
                    buf[i] = s;
                    store(sr, i, s, dtype);
                }
            } else {
                for (int64_t i = 0; i < width; ++i) {
                    buf[i] = load(xr, i, dtype);
                }
            }
            normalize_in_place(buf, width, weight, eps, dtype);
            char *o = (char *)out + t * width * esize;
            for (int64_t i = 0; i < width; ++i) {
                store(o, i, buf[i], dtype);
            }
        }
    }
}

int hitch_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t res_stride,
                   void *sum_out, const void *weight, void *out, int64_t rows, int64_t width,
                   float eps, int dtype, int num_threads) {
    if (dtype == BF16) {
        rms_norm_rows(x, x_stride, residual, res_stride, sum_out, weight, out, rows, width,
                      eps, BF16, num_threads);
    } else {
        rms_norm_rows(x, x_stride, residual, res_stride, sum_out, weight, out, rows, width,
                      eps, F32, num_threads);
    }
    return 0;
}

/* silu(x) = x / (1 + exp(-x)), exp by Cephes' polynomial on a reduced argument: e = exp(-|x|)
   (never overflows), then x / (1 + e) for x >= 0 and x * e / (1 + e) below. */
static inline INLINE float silu(float x) {
    float a = x < 0.0f ? x : -x;  /* -|x| */
    a = a < -87.0f ? -87.0f : a;
    int32_t n;
    const float p = exp_reduced(a, &n);
    const int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    const float e = p * scale;
    return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

/* PyTorch's float32 SiLU, x / (1 + exp(-x)), is an ATen elementwise loop: over each
   contiguous run of elements it computes whole chunks of two vectors with the vector
   exponential (Sleef_expf16_u10 in torch's AVX-512 kernels, Sleef_expf8_u10 in its AVX2 ones:
   the same values) and the run's remaining elements with std::exp (glibc's expf). A run is a
   row of the gate, cut where at::parallel_for splits the [rows, width] elements among
   threads (more than ATEN_GRAIN_SIZE elements and more than one thread: equal contiguous
   shares). fused.py looks up the exponential in libtorch and finds the chunk length by
   comparing with F.silu (hitch_set_silu_exp); without them float32 SiLU is not computed. */
#if defined(__AVX512F__)
typedef float exp_vector __attribute__((vector_size(64)));
#elif defined(__AVX2__)
typedef float exp_vector __attribute__((vector_size(32)));
#endif
#define ATEN_GRAIN_SIZE 32768

#ifdef __AVX2__ /* AVX-512 implies it */
enum { EXP_LANES = sizeof(exp_vector) / sizeof(float) };
static exp_vector (*torch_exp)(exp_vector);
static int64_t silu_chunk;

int hitch_silu_exp_lanes(void) { return EXP_LANES; }

int hitch_set_silu_exp(void *exp, int64_t chunk) {
    if (chunk <= 0 || chunk % EXP_LANES != 0) {
        return -1;
    }
    torch_exp = (exp_vector(*)(exp_vector))exp;
    silu_chunk = chunk;
    return 0;
}

/* out[i] = silu(g[i]) * u[i] over one run of n elements, as ATen computes silu there. */
static void silu_f32_run(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + silu_chunk <= n; i += silu_chunk) {
        for (int64_t j = i; j < i + silu_chunk; j += EXP_LANES) {
            exp_vector v;
            memcpy(&v, g + j, sizeof(v));
            v = v / (1.0f + torch_exp(-v));
            for (int l = 0; l < EXP_LANES; ++l) {
                out[j + l] = v[l] * u[j + l];
            }
        }
    }
    for (; i < n; ++i) {
        out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
#else
int hitch_silu_exp_lanes(void) { return 0; }

int hitch_set_silu_exp(void *exp, int64_t chunk) {
    (void)exp, (void)chunk;
    return -1;
}
#endif

/* out[t, i] = round(silu(x[t, i])) * x[t, width + i] for rows of 2 * width inputs, on up to
   num_threads OpenMP threads. float32 needs hitch_set_silu_exp first, and torch_threads must
   be torch's thread count (it fixes where ATen would split the elements, whatever team
   computes them); returns -1 without the exponential, else 0. */
int hitch_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t width,
                       int dtype, int num_threads, int torch_threads) {
    const int64_t esize = dtype == BF16 ? 2 : 4;
#ifdef __AVX2__
    if (dtype != BF16 && torch_exp == NULL) {
        return -1;
    }
    /* at::parallel_for's share of the rows * width elements per thread (all of them when
       ATen stays on one thread). */
    const int64_t numel = rows * width;
    int64_t shares = 1;
    if (numel > ATEN_GRAIN_SIZE && torch_threads > 1) {
        shares = (numel + ATEN_GRAIN_SIZE - 1) / ATEN_GRAIN_SIZE;
        shares = shares < torch_threads ? shares : torch_threads;
    }
    const int64_t share = (numel + shares - 1) / shares;
#else
    (void)torch_threads;
    if (dtype != BF16) {
        return -1;
    }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) \
    if (num_threads > 1 && rows > 1 && rows * width >= PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < rows; ++t) {
        const char *xr = row_at(x, t, x_stride, dtype);
        char *o = (char *)out + t * width * esize;
        if (dtype == BF16) {
            const uint16_t *g = (const uint16_t *)xr, *u = g + width;
            for (int64_t i = 0; i < width; ++i) {
                const float s = bf16_to_f32(f32_to_bf16(silu(bf16_to_f32(g[i]))));
                ((uint16_t *)o)[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
            }
        } else {
#ifdef __AVX2__
            const float *g = (const float *)xr, *u = g + width;
            /* The row's runs: cut at every multiple of share. */
            for (int64_t i = 0; i < width;) {
                const int64_t at = t * width + i;
                const int64_t end = (at / share + 1) * share - t * width;
                const int64_t n = (end < width ? end : width) - i;
                silu_f32_run(g + i, u + i, (float *)o + i, n);
                i += n;
            }
#endif
        }
    }
    return 0;
}

/* Rotate-half rotary of one head in place in buf (d values, float32 holding dtype values):
   [x1 * c - x2 * s, x2 * c + x1 * s] with c, s rounded to the dtype and every product and sum
   rounded as PyTorch rounds it. */
static inline INLINE void rotate_head(float *buf, int64_t half, const float *cos_row,
                               const float *sin_row, int dtype) {
    for (int64_t i = 0; i < half; ++i) {
        const float c = rounded(cos_row[i], dtype), s = rounded(sin_row[i], dtype);
        const float x1 = buf[i], x2 = buf[half + i];
        const float a = rounded(rounded(x1 * c, dtype) - rounded(x2 * s, dtype), dtype);
        const float b = rounded(rounded(x2 * c, dtype) + rounded(x1 * s, dtype), dtype);
        buf[i] = a;
        buf[half + i] = b;
    }
}

/* One [rows, heads, d] tensor: (optionally) each head RMS-normalized with weight (d values),
   then rotated at positions. Rows' heads are contiguous (head stride d). */
static inline INLINE void rotary_tensor(const int64_t *positions, const void *x, int64_t x_stride, void *out,
                          int64_t rows, int64_t heads, int64_t d, const float *cos,
                          const float *sin, const void *weight, float eps, int dtype,
                          int num_threads) {
    const int64_t esize = dtype == BF16 ? 2 : 4, half = d / 2;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && rows > 1 && \
                                                  rows * heads * d >= PARALLEL_MIN_WORK)
    {
        float buf[d];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; ++t) {
            const char *xr = row_at(x, t, x_stride, dtype);
            char *o = (char *)out + t * heads * d * esize;
            const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
            for (int64_t h = 0; h < heads; ++h) {
                const char *xh = xr + h * d * esize;
                for (int64_t i = 0; i < d; ++i) {
                    buf[i] = load(xh, i, dtype);
                }
                if (weight != NULL) {
                    normalize_in_place(buf, d, weight, eps, dtype);
                }
                rotate_head(buf, half, c, s, dtype);
                for (int64_t i = 0; i < d; ++i) {
                    store(o + h * d * esize, i, buf[i], dtype);
                }
            }
        }
    }
}

/* Rotary embedding of q [rows, q_heads, d] and k [rows, k_heads, d] into q_out and k_out, each
   head first RMS-normalized with q_weight / k_weight (d values) when they are not NULL
   (Qwen3). cos and sin are [max_position, d / 2] float32. Returns 0, or 1 when a position is
   outside [0, max_position) (nothing is written then). */
int hitch_rotary(const int64_t *positions, const void *q, int64_t q_stride, int64_t q_heads,
                 void *q_out, const void *k, int64_t k_stride, int64_t k_heads, void *k_out,
                 int64_t rows, int64_t d, const float *cos, const float *sin,
                 int64_t max_position, const void *q_weight, const void *k_weight, float eps,
                 int dtype, int num_threads) {
    for (int64_t t = 0; t < rows; ++t) {
        if (positions[t] < 0 || positions[t] >= max_position) {
            return 1;
        }
    }
    if (dtype == BF16) {
        rotary_tensor(positions, q, q_stride, q_out, rows, q_heads, d, cos, sin, q_weight, eps,
                      BF16, num_threads);
        rotary_tensor(positions, k, k_stride, k_out, rows, k_heads, d, cos, sin, k_weight, eps,
                      BF16, num_threads);
    } else {
        rotary_tensor(positions, q, q_stride, q_out, rows, q_heads, d, cos, sin, q_weight, eps,
                      F32, num_threads);
        rotary_tensor(positions, k, k_stride, k_out, rows, k_heads, d, cos, sin, k_weight, eps,
                      F32, num_threads);
    }
    return 0;
}

/* The KV-cache write: key and value rows [tokens, kv_heads, d] (row strides in elements, each
   row's heads contiguous) copied to their slots of the head-major caches [kv_heads, slots, d]
   (slots = cache blocks x block size); a negative slot (padding) is skipped. esize: bytes per
   element (any dtype: the copy is byte for byte). Returns 0, or 1 when a slot is outside the
   cache (nothing is written then). */
int hitch_write_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
                   void *k_cache, void *v_cache, const int64_t *slots, int64_t tokens,
                   int64_t kv_heads, int64_t d, int64_t cache_slots, int64_t esize) {
    for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] >= cache_slots) {
            return 1;
        }
    }
    const size_t bytes = (size_t)(d * esize);
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t s = slots[t];
        if (s < 0) {
            continue;
        }
        const char *kr = (const char *)key + t * key_stride * esize;
        const char *vr = (const char *)value + t * value_stride * esize;
        for (int64_t h = 0; h < kv_heads; ++h) {
            memcpy((char *)k_cache + (h * cache_slots + s) * (int64_t)bytes, kr + h * bytes,
                   bytes);
            memcpy((char *)v_cache + (h * cache_slots + s) * (int64_t)bytes, vr + h * bytes,
                   bytes);
        }
    }
    return 0;
}
