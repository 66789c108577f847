/* A Llama-family decoder layer of a decode step in one call, for attention_cpu's
   decode_layer.py: the kernels the layer's modules call, in their order, on the same inputs,
   through function pointers the Python side takes from the libraries that hold them. In
   bfloat16 those are the plugin's (fused_ops.c, amx_linear.c, paged_attention.c, each built in
   its own library with its own flags), and nothing is computed here but the two conversions
   around the attention kernel (bfloat16 queries widened to float32: exact; float32 outputs
   rounded to bfloat16 to nearest even, as torch's .to does). In float32 the linears are MKL's
   in libtorch, called as the modules call them: a weight packed for 32 rows
   (cblas_sgemm_compute, mkl_linear.py) for 16-32 rows, else sgemm_ as F.linear calls it; the
   rest are the plugin's kernels, whose float32 paths equal PyTorch's. So the result equals the
   modules' bit for bit in both dtypes.

   Threads. With two threads, the attention kernel's units (a request and KV head each) are
   shared with one helper thread of this library instead of an OpenMP team: on a decode step
   the kernel runs for 100-250 us per layer, and an OpenMP thread that sleeps between parallel
   regions (OMP_WAIT_POLICY=PASSIVE, or libgomp's default as soon as a process has more
   threads than cores) took about 70 us to wake each time on a 2-core VM, most of the gain.
   The helper waits for HELPER_SPIN_NS after each kernel call (a decode step calls the next
   layer's well within that) in a loop of sched_yield, so that a thread the scheduler put on
   its core, the caller's included, runs instead (spinning with pause instructions made runs
   1.2x faster or slower depending on where the threads landed); then it sleeps until woken.
   The calling thread never waits for the helper to start: units are handed out one at a time
   from a shared counter, so a helper that is late (asleep, or its core taken by another
   process) simply gets fewer of them or none; the caller waits only for units the helper has
   claimed (a few microseconds each; after CALLER_SPIN pause instructions it yields its core,
   in case the helper was preempted on it). A child forked from the process has no helper
   thread (fork copies only the calling thread): there every call computes alone. Every
   unit is computed by one thread with the same code, so the output does not depend on who
   computed it. The plugin's other kernels run on the calling thread at two threads (their
   calls are 10-40 us: a sleeping OpenMP thread would cost more than it saves); with more
   threads everything keeps the OpenMP paths. MKL's GEMMs use MKL's own threads, as in the
   modules (their results can depend on the thread count).

   Layouts: hidden, residual, out, total [rows, hidden_size] in the model dtype, contiguous;
   the layer's weights as the kernels take them (above); the KV caches [kv_heads, slots, d] in
   the model dtype (slots = cache blocks x block size). rows <= PACKED_ROWS. */

#define _POSIX_C_SOURCE 200809L /* clock_gettime, sched_yield under -std=c11 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu_numerics.h"

/* The bfloat16 dtype code (fused_ops.c's, and paged_attention.c's kv_format; float32 is 0). */
enum { BF16 = 1 };
/* CBLAS's constants (mkl_cblas.h). */
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_PACKED = 151 };
/* The row count MKL's packed weights are made for (mkl_linear.PACKED_ROWS), and the most
   rows a call takes. */
#define PACKED_ROWS 32
/* The layer's linears, in the order of layer_params' weight arrays. */
enum { QKV = 0, O_PROJ = 1, GATE_UP = 2, DOWN = 3 };

typedef int (*rms_norm_fn)(const void *x, int64_t x_stride, const void *residual,
                           int64_t res_stride, void *sum_out, const void *weight, void *out,
                           int64_t rows, int64_t width, float eps, int dtype, int num_threads);
typedef int (*amx_linear_fn)(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                             const uint16_t *w_packed, int64_t n, uint16_t *out,
                             int num_threads);
/* MKL's Fortran sgemm_ and cblas_sgemm_compute (LP64: int). */
typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n,
                         const int *k, const float *alpha, const float *a, const int *lda,
                         const float *b, const int *ldb, const float *beta, float *c,
                         const int *ldc);
typedef void (*sgemm_compute_fn)(int layout, int transa, int transb, int m, int n, int k,
                                 const float *a, int lda, const void *b, int ldb, float beta,
                                 float *c, int ldc);
typedef int (*rotary_fn)(const int64_t *positions, const void *q, int64_t q_stride,
                         int64_t q_heads, void *q_out, const void *k, int64_t k_stride,
                         int64_t k_heads, void *k_out, int64_t rows, int64_t d,
                         const float *cos, const float *sin, int64_t max_position,
                         const void *q_weight, const void *k_weight, float eps, int dtype,
                         int num_threads);
typedef int (*write_kv_fn)(const void *key, int64_t key_stride, const void *value,
                           int64_t value_stride, void *k_cache, void *v_cache,
                           const int64_t *slots, int64_t tokens, int64_t kv_heads, int64_t d,
                           int64_t cache_slots, int64_t esize);
typedef int (*silu_and_mul_fn)(const void *x, int64_t x_stride, void *out, int64_t rows,
                               int64_t width, int dtype, int num_threads, int torch_threads);
/* paged_attention.c's hitch_paged_attention (OpenMP) and hitch_paged_attention_claim. */
typedef int (*attention_fn)(HITCH_ATTENTION_PARAMS, int num_threads);
typedef int (*attention_claim_fn)(HITCH_ATTENTION_PARAMS, int64_t *cursor);

/* What stays the same from step to step (set once per layer by decode_layer.py). */
typedef struct {
    int dtype;
    rms_norm_fn rms_norm;
    amx_linear_fn amx_linear; /* bfloat16 */
    sgemm_fn sgemm;           /* float32 */
    sgemm_compute_fn sgemm_compute;
    rotary_fn rotary;
    write_kv_fn write_kv;
    silu_and_mul_fn silu_and_mul;
    attention_fn attention;
    attention_claim_fn attention_claim;
    const void *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms: NULL but for Qwen3 */
    float input_eps, post_eps, qk_eps;
    /* By linear (QKV ...): bfloat16 the AMX-packed weights; float32 MKL's packed copy (NULL
       where the module has none) for min_packed_rows to PACKED_ROWS rows, else weight. */
    const void *packed[4];
    const float *weight[4];
    int64_t min_packed_rows;
    int64_t hidden, heads, kv_heads, head_size, intermediate;
    const float *cos, *sin;
    int64_t max_position;
    double scale, softcap;
    int64_t window;
} layer_params;

/* The step's requests as CPU_ATTN's kernel reads them, and each token's KV slot. */
typedef struct {
    const int64_t *positions, *slots, *q_start, *q_len, *context_len;
    const int32_t *block_table;
    int64_t bt_stride, num_reqs;
} step_params;

enum {
    DECODE_OK = 0,
    DECODE_BAD_POSITION = 1,
    DECODE_BAD_SLOT = 2,
    DECODE_NO_MEMORY = 3,
    DECODE_BAD_SHAPE = 4,
    DECODE_NO_EXP = 5, /* float32 SiLU without PyTorch's exponential (fused.silu_chunk) */
};

/* ---- the helper thread ------------------------------------------------------------------ */

/* How long the helper waits for the next call before it sleeps. */
#define HELPER_SPIN_NS 200000
/* Pause instructions the caller spins on the helper's last units before each sched_yield
   (about 10 us: more than a unit takes when the helper is running). */
#define CALLER_SPIN 256

/* One attention call's arguments, as the helper needs them. */
typedef struct {
    attention_claim_fn claim;
    const float *q;
    const void *k_cache, *v_cache;
    float *out;
    const step_params *step;
    const layer_params *layer;
    int64_t cache_blocks, block_size;
    int64_t cursor;
    int status;
} attention_job;

/* job_state: (generation << 2) | one of these. The caller publishes a job OPEN; the helper
   takes it (OPEN -> TAKEN) and marks it DONE, or the caller closes it first (OPEN -> CLOSED)
   when it has computed every unit itself, after which the helper never reads the job. */
enum { JOB_OPEN = 0, JOB_TAKEN = 1, JOB_DONE = 2, JOB_CLOSED = 3 };

static struct {
    pthread_once_t once;
    int started;
    atomic_int in_use; /* one caller at a time (two engines in a process: the other one
                          computes alone) */
    atomic_uint_fast64_t job_state;
    atomic_int sleeping;
    uint64_t generation;
    attention_job job;
    pthread_mutex_t lock;
    pthread_cond_t wake;
} helper = {PTHREAD_ONCE_INIT, 0, 0, 0, 0, 0, {0}, PTHREAD_MUTEX_INITIALIZER,
            PTHREAD_COND_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void pause_briefly(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int run_job(attention_job *j) {
    const layer_params *p = j->layer;
    const step_params *s = j->step;
    return j->claim(j->q, j->k_cache, j->v_cache, j->out, s->q_start, s->q_len, s->context_len,
                    s->block_table, s->bt_stride, s->num_reqs, p->heads, p->kv_heads,
                    p->head_size, j->block_size, j->cache_blocks, p->scale, p->softcap,
                    p->window, p->dtype, NULL, NULL, &j->cursor);
}

static void *helper_main(void *unused) {
    (void)unused;
    uint64_t done = 0; /* the last generation taken */
    int64_t idle_since = now_ns();
    for (;;) {
        uint_fast64_t state = atomic_load(&helper.job_state);
        if ((state & 3) == JOB_OPEN && (state >> 2) != done) {
            if (atomic_compare_exchange_strong(&helper.job_state, &state,
                                               (state & ~(uint_fast64_t)3) | JOB_TAKEN)) {
                helper.job.status = run_job(&helper.job);
                done = state >> 2;
                atomic_store(&helper.job_state, (state & ~(uint_fast64_t)3) | JOB_DONE);
            }
            idle_since = now_ns();
            continue;
        }
        if (now_ns() - idle_since < HELPER_SPIN_NS) {
            sched_yield();
            continue;
        }
        pthread_mutex_lock(&helper.lock);
        atomic_store(&helper.sleeping, 1);
        for (;;) {
            state = atomic_load(&helper.job_state);
            if ((state & 3) == JOB_OPEN && (state >> 2) != done) {
                break;
            }
            pthread_cond_wait(&helper.wake, &helper.lock);
        }
        atomic_store(&helper.sleeping, 0);
        pthread_mutex_unlock(&helper.lock);
    }
    return NULL;
}

/* In a forked child the helper thread does not exist (and the state it shared with the
   parent's caller may be mid-call): the child's calls compute alone. */
static void forget_helper(void) { helper.started = 0; }

static void start_helper(void) {
    pthread_t thread;
    pthread_attr_t attr;
    if (pthread_atfork(NULL, NULL, forget_helper) != 0 || pthread_attr_init(&attr) != 0) {
        return;
    }
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    helper.started = pthread_create(&thread, &attr, helper_main, NULL) == 0;
    pthread_attr_destroy(&attr);
}

/* The attention kernel over the step's requests: with the helper when num_threads == 2 (and
   it is free), on the OpenMP team for more threads, on this thread alone for one. */
static int attend(const layer_params *p, const step_params *s, const float *q, float *out,
                  void *k_cache, void *v_cache, int64_t cache_blocks, int64_t block_size,
                  int num_threads) {
    if (num_threads > 2) {
        return p->attention(q, k_cache, v_cache, out, s->q_start, s->q_len, s->context_len,
                            s->block_table, s->bt_stride, s->num_reqs, p->heads, p->kv_heads,
                            p->head_size, block_size, cache_blocks, p->scale, p->softcap,
                            p->window, p->dtype, NULL, NULL, num_threads);
    }
    attention_job mine = {p->attention_claim, q, k_cache, v_cache, out, s, p, cache_blocks,
                          block_size, 0, 0};
    int expected = 0;
    if (num_threads == 1 || pthread_once(&helper.once, start_helper) != 0 || !helper.started
        || !atomic_compare_exchange_strong(&helper.in_use, &expected, 1)) {
        return run_job(&mine);
    }
    helper.job = mine;
    const uint64_t generation = ++helper.generation;
    atomic_store(&helper.job_state, (generation << 2) | JOB_OPEN);
    if (atomic_load(&helper.sleeping)) {
        pthread_mutex_lock(&helper.lock);
        pthread_cond_signal(&helper.wake);
        pthread_mutex_unlock(&helper.lock);
    }
    int status = run_job(&helper.job);
    uint_fast64_t open = (generation << 2) | JOB_OPEN;
    if (!atomic_compare_exchange_strong(&helper.job_state, &open,
                                        (generation << 2) | JOB_CLOSED)) {
        for (int spins = 0;
             atomic_load(&helper.job_state) != ((generation << 2) | JOB_DONE); ++spins) {
            if (spins < CALLER_SPIN) {
                pause_briefly();
            } else {
                sched_yield();
            }
        }
        /* A claim that fails claims no unit, and one that succeeds claims every unit left:
           the output is complete when either thread's call succeeded. */
        if (status != 0) {
            status = helper.job.status;
        }
    }
    atomic_store(&helper.in_use, 0);
    return status;
}

/* ---- the layer -------------------------------------------------------------------------- */

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* out[rows, n] = x[rows, k] @ W.T for the layer's linear `which`, as its module computes it.
   pad: PACKED_ROWS * (k + n) floats, for the packed GEMM's rows beyond `rows` (zeros). */
static int linear(const layer_params *p, int which, const void *x, int64_t rows, int64_t k,
                  int64_t n, void *out, float *pad, int threads) {
    if (p->dtype == BF16) {
        return p->amx_linear(x, k, rows, k, p->packed[which], n, out, threads) != 0
                   ? DECODE_BAD_SHAPE : DECODE_OK;
    }
    const int ki = (int)k, ni = (int)n, mi = (int)rows;
    if (p->packed[which] != NULL && rows >= p->min_packed_rows) {
        const float *in = x;
        float *result = out;
        if (rows < PACKED_ROWS) { /* mkl_linear.py pads to the packed row count */
            memcpy(pad, x, sizeof(float) * rows * k);
            memset(pad + rows * k, 0, sizeof(float) * (PACKED_ROWS - rows) * k);
            in = pad;
            result = pad + PACKED_ROWS * k;
        }
        p->sgemm_compute(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_PACKED, PACKED_ROWS, ni, ki, in,
                         ki, p->packed[which], ki, 0.0f, result, ni);
        if (result != out) {
            memcpy(out, result, sizeof(float) * rows * n);
        }
        return DECODE_OK;
    }
    /* F.linear's call (ATen's addmm: the column-major product W x^T). */
    const float one = 1.0f, zero = 0.0f;
    p->sgemm("T", "N", &ni, &mi, &ki, &one, p->weight[which], &ki, x, &ki, &zero, out, &ni);
    return DECODE_OK;
}

/* out = the layer's MLP output, total = its residual stream after attention (see
   PreNormDecoderLayer.forward). residual NULL: the first layer, whose residual stream is
   hidden itself. Returns one of the DECODE_ codes (outputs and cache partly written unless 0). */
int hitch_decode_layer(const layer_params *p, const step_params *s, const void *hidden,
                       const void *residual, void *out, void *total, void *k_cache,
                       void *v_cache, int64_t cache_blocks, int64_t block_size, int64_t rows,
                       int num_threads) {
    const int64_t h = p->hidden, d = p->head_size, inter = p->intermediate;
    const int64_t q_size = p->heads * d, kv_size = p->kv_heads * d;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int bf16 = p->dtype == BF16;
    const size_t esize = bf16 ? 2 : 4;
    if (rows > PACKED_ROWS) {
        return DECODE_BAD_SHAPE;
    }
    /* Scratch in the model dtype: normed, residual sum, qkv, q, k, attention output, o,
       gate_up, activated; float32: the attention kernel's q and output (bfloat16: widened
       copies; float32: q and the output above), and the packed GEMM's padding. */
    const int64_t widest = max64(max64(h, q_size), inter), longest = max64(qkv_size, 2 * inter);
    const size_t elements = (size_t)rows * (3 * h + qkv_size + 2 * q_size + kv_size + 3 * inter);
    const size_t floats = (bf16 ? (size_t)rows * 2 * q_size : 0)
                          + (bf16 ? 0 : (size_t)PACKED_ROWS * (widest + longest));
    char *scratch = malloc(floats * 4 + elements * esize);
    if (scratch == NULL) {
        return DECODE_NO_MEMORY;
    }
    float *pad = (float *)scratch, *q32 = pad, *attended32 = q32 + rows * q_size;
    char *normed = scratch + floats * 4;
    char *sum = normed + rows * h * esize, *qkv = sum + rows * h * esize;
    char *q = qkv + rows * qkv_size * esize, *k = q + rows * q_size * esize;
    char *attended = k + rows * kv_size * esize, *o = attended + rows * q_size * esize;
    char *gate_up = o + rows * h * esize, *activated = gate_up + rows * 2 * inter * esize;
    if (!bf16) { /* the kernel reads the rotated queries and writes the output in place */
        q32 = (float *)q;
        attended32 = (float *)attended;
    }
    int status = DECODE_OK;
    /* At two threads only the attention kernel is shared (with the helper); see above. */
    const int threads = num_threads == 2 ? 1 : num_threads;

    const void *stream = residual == NULL ? hidden : sum;
    p->rms_norm(hidden, h, residual, h, residual == NULL ? NULL : sum, p->input_norm, normed,
                rows, h, p->input_eps, p->dtype, threads);
    if ((status = linear(p, QKV, normed, rows, h, qkv_size, qkv, pad, threads)) != DECODE_OK) {
        goto done;
    }
    if (p->rotary(s->positions, qkv, qkv_size, p->heads, q, qkv + q_size * esize, qkv_size,
                  p->kv_heads, k, rows, d, p->cos, p->sin, p->max_position, p->q_norm,
                  p->k_norm, p->qk_eps, p->dtype, threads) != 0) {
        status = DECODE_BAD_POSITION;
        goto done;
    }
    if (p->write_kv(k, kv_size, qkv + (q_size + kv_size) * esize, qkv_size, k_cache, v_cache,
                    s->slots, rows, p->kv_heads, d, cache_blocks * block_size,
                    (int64_t)esize) != 0) {
        status = DECODE_BAD_SLOT;
        goto done;
    }
    if (bf16) {
        const uint16_t *q16 = (const uint16_t *)q;
        for (int64_t i = 0; i < rows * q_size; ++i) {
            const uint32_t u = (uint32_t)q16[i] << 16;
            memcpy(q32 + i, &u, 4);
        }
    }
    memset(attended32, 0, sizeof(float) * rows * q_size);
    if (attend(p, s, q32, attended32, k_cache, v_cache, cache_blocks, block_size,
               num_threads) != 0) {
        status = DECODE_NO_MEMORY;
        goto done;
    }
    if (bf16) {
        for (int64_t i = 0; i < rows * q_size; ++i) {
            ((uint16_t *)attended)[i] = f32_to_bf16(attended32[i]);
        }
    }
    if ((status = linear(p, O_PROJ, attended, rows, q_size, h, o, pad, threads)) != DECODE_OK) {
        goto done;
    }
    p->rms_norm(o, h, stream, h, total, p->post_norm, normed, rows, h, p->post_eps, p->dtype,
                threads);
    if ((status = linear(p, GATE_UP, normed, rows, h, 2 * inter, gate_up, pad,
                         threads)) != DECODE_OK) {
        goto done;
    }
    /* SiLU's float32 result depends on how ATen would split it among torch's threads (not
       on the threads that compute it). */
    if (p->silu_and_mul(gate_up, 2 * inter, activated, rows, inter, p->dtype, threads,
                        num_threads) != 0) {
        status = DECODE_NO_EXP;
        goto done;
    }
    status = linear(p, DOWN, activated, rows, inter, h, out, pad, threads);
done:
    free(scratch);
    return status;
}
