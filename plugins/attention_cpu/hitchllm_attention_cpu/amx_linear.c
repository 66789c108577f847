/* bfloat16 linear layers of 1-32 rows (decode steps) on Intel AMX, for the attention_cpu
   plugin (amx_linear.py).

   oneDNN's AMX GEMM costs 13-27 us per call on the bundled model's decode shapes whatever the
   work (its primitive's set-up), 50-85 us inside the engine; here a call configures the tiles
   once and streams the weight, prepacked once into the tile layout, through TDPBF16PS.

   out[m, n] = bf16(sum over k of x[m, k] * w[n, k]), accumulated in float32 in the order
   k = 0, 2, 4, ... (pairs, as TDPBF16PS adds them), rounded to nearest even once.

   Layouts: x [m, k] bfloat16 (row stride x_stride elements, rows contiguous), out [m, n]
   bfloat16 contiguous, w_packed [n / 16][k / 32][16][16][2] bfloat16: for each block of 16
   outputs and 32 inputs a 16 x 64-byte tile whose row r, column c holds w[c, 2r] and
   w[c, 2r + 1] (VNNI pairs along k). Needs m <= 32, k % 32 == 0, n % 16 == 0.

   Built only where the compiler targets AMX (-march=native on such a CPU defines __AMX_TILE__
   and __AMX_BF16__); elsewhere every function returns -1 and the caller keeps oneDNN. */

#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#include "cpu_numerics.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Outputs times inputs above which a call shares its output blocks among OpenMP threads. */
#define PARALLEL_MIN_WEIGHTS (1 << 18)

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Asks Linux for the AMX tile state (once per process; oneDNN asks too). 0 when granted. */
int hitch_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}


/* Tiles: 0-3 accumulators (rows 0-15 / 16-31 x output block j / j + 1), 4-5 the two row
   halves of x, 6-7 the weight tiles of blocks j and j + 1. */
static void configure(int64_t m) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    const uint8_t r0 = (uint8_t)(m < 16 ? m : 16), r1 = (uint8_t)(m > 16 ? m - 16 : 0);
    const uint8_t rows[8] = {r0, r1, r0, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

/* Output blocks [j0, j1) of 16 columns each. */
static void blocks(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                   const uint16_t *w, int64_t n, uint16_t *out, int64_t j0, int64_t j1) {
    const int64_t kb_count = k / 32, tile = 16 * 32;
    const int two_halves = m > 16;
    float acc[32][32];
    configure(m);
    for (int64_t j = j0; j < j1; j += 2) {
        const int pair = j + 1 < j1;
        _tile_zero(0);
        _tile_zero(2);
        if (two_halves) {
            _tile_zero(1);
            _tile_zero(3);
        }
        const uint16_t *wj = w + j * kb_count * tile, *wj1 = wj + kb_count * tile;
        for (int64_t kb = 0; kb < kb_count; ++kb) {
            _tile_loadd(4, x + kb * 32, x_stride * 2);
            _tile_loadd(6, wj + kb * tile, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two_halves) {
                _tile_loadd(5, x + 16 * x_stride + kb * 32, x_stride * 2);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (pair) {
                _tile_loadd(7, wj1 + kb * tile, 64);
                _tile_dpbf16ps(2, 4, 7);
                if (two_halves) {
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
        }
        _tile_stored(0, &acc[0][0], 128);
        _tile_stored(2, &acc[0][16], 128);
        if (two_halves) {
            _tile_stored(1, &acc[16][0], 128);
            _tile_stored(3, &acc[16][16], 128);
        }
        const int64_t cols = pair ? 32 : 16;
        for (int64_t r = 0; r < m; ++r) {
            uint16_t *o = out + r * n + j * 16;
#if defined(__AVX512BF16__)
            /* VCVTNEPS2BF16: round to nearest even, as f32_to_bf16 (and oneDNN). */
            for (int64_t c = 0; c < cols; c += 16) {
                const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(&acc[r][c]));
                _mm256_storeu_si256((__m256i *)(o + c), (__m256i)h);
            }
#else
            for (int64_t c = 0; c < cols; ++c) {
                o[c] = f32_to_bf16(acc[r][c]);
            }
#endif
        }
    }
    _tile_release();
}

/* Returns 0, or -1 when the shape is not one this kernel takes. */
int hitch_amx_linear(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                     const uint16_t *w_packed, int64_t n, uint16_t *out, int num_threads) {
    if (m < 1 || m > 32 || k % 32 != 0 || n % 16 != 0 || k < 32) {
        return -1;
    }
    const int64_t nb = n / 16;
    if (num_threads > 1 && n * k >= PARALLEL_MIN_WEIGHTS && nb >= 4) {
#pragma omp parallel num_threads(num_threads)
        {
#ifdef _OPENMP
            const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
            const int64_t t = 0, threads = 1;
#endif
            /* Even numbers of blocks per thread, so pairs stay together. */
            const int64_t pairs = (nb + 1) / 2, per = (pairs + threads - 1) / threads;
            const int64_t j0 = 2 * per * t, j1 = 2 * per * (t + 1) < nb ? 2 * per * (t + 1) : nb;
            if (j0 < j1) {
                blocks(x, x_stride, m, k, w_packed, n, out, j0, j1);
            }
        }
    } else {
        blocks(x, x_stride, m, k, w_packed, n, out, 0, nb);
    }
    return 0;
}

#else

int hitch_amx_init(void) { return -1; }

int hitch_amx_linear(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                     const uint16_t *w_packed, int64_t n, uint16_t *out, int num_threads) {
    (void)x, (void)x_stride, (void)m, (void)k, (void)w_packed, (void)n, (void)out;
    (void)num_threads;
    return -1;
}

#endif
