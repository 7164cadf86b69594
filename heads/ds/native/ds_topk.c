/* DS-Softmax top-k queries in C (heads/ds/softmax.py, DSSoftmaxHead.topk; heads/ds/svd.py).
 *
 * At batch 1 the selected expert holds a few hundred rows: its matrix-vector product is a
 * read of ~200 KB from L3 cache (about 7 us here), while each eager PyTorch call costs 1-5 us.
 * One call here does gate -> expert product -> log-softmax -> top-k (ds-softmax.txt, Eq. 1-2,
 * Table 1 measures this latency). In batches, queries are sorted by expert so each expert's
 * rows are read from memory once per batch (then from L2 for its other queries), where a
 * padded batched product reads every expert. With an SVD preview (Shim et al. 2017, as the DS
 * paper's section 4.6 applies it to large experts) an expert first scores its classes with
 * its top singular directions and computes exact logits for the best candidates only.
 *
 * The structure is described once per head by a ds_plan (built by heads/ds/softmax.py and
 * kept alive with the tensors it points to), so a query passes five arguments.
 * Compiled at first use by heads/ds/native/__init__.py.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    int64_t d;                 /* query size */
    int64_t n_experts;         /* K */
    int64_t row_stride;        /* d, or d + 1 when column d holds the bias */
    int64_t has_bias;
    int64_t max_rows;          /* largest expert */
    const float *gate;         /* [K, d] */
    const float *weight;       /* [R, row_stride]: every expert's rows, packed */
    const int64_t *offsets;    /* [K + 1]: expert e holds rows offsets[e] .. offsets[e+1]-1 */
    const int64_t *row_class;  /* [R]: class id of each row */
    /* SVD preview, NULL when off. Expert e with preview_rank[e] = W > 0 has
     * basis [W, row_stride] (its top right singular vectors, at basis + basis_offsets[e]) and
     * preview [n_e, W] (its rows projected on them, at preview + preview_offsets[e]). */
    const int64_t *preview_rank;    /* [K] */
    const int64_t *candidates;      /* [K]: classes that get exact logits (at least k) */
    const int64_t *basis_offsets;   /* [K] */
    const int64_t *preview_offsets; /* [K] */
    const float *basis;
    const float *preview;
} ds_plan;

static float dot(const float *a, const float *b, int64_t n) {
    /* the loader's flags allow re-association, so this reduction vectorises */
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

/* out[r] = rows[r] . h for 4 rows at a time: four independent sums keep the FMA units busy
 * where one sum would wait on its own previous addition */
static void matvec(const float *rows, int64_t stride, int64_t n_rows, const float *h,
                   int64_t d, float *out) {
    int64_t r = 0;
    for (; r + 4 <= n_rows; r += 4) {
        const float *a = rows + r * stride, *b = a + stride, *c = b + stride, *e = c + stride;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        for (int64_t i = 0; i < d; ++i) {
            s0 += a[i] * h[i];
            s1 += b[i] * h[i];
            s2 += c[i] * h[i];
            s3 += e[i] * h[i];
        }
        out[r] = s0;
        out[r + 1] = s1;
        out[r + 2] = s2;
        out[r + 3] = s3;
    }
    for (; r < n_rows; ++r) out[r] = dot(rows + r * stride, h, d);
}

/* Insert z (from position i) into the sorted best-first answer of `filled` <= take entries;
 * earlier positions win ties. Returns the new fill. */
static int64_t insert_top(float z, int64_t i, int64_t filled, int64_t take, float *values,
                          int64_t *where) {
    if (filled == take && !(z > values[take - 1])) return filled;
    int64_t j = filled < take ? filled++ : take - 1;
    while (j > 0 && z > values[j - 1]) {
        values[j] = values[j - 1];
        where[j] = where[j - 1];
        --j;
    }
    values[j] = z;
    where[j] = i;
    return filled;
}

/* e^x for x <= 0, as the terms of a log-sum-exp need it: below -87 it is 0 (next to the
 * maximum's e^0 = 1 such terms vanish in float); above, x = m ln2 + r with |r| <= ln2/2,
 * e^r by Cephes' degree-6 polynomial for expf, 2^m put into the exponent bits. Plain C, so
 * the loops that call it vectorise (libm's expf does not); within 2 ulp of expf (tested
 * through the answers' log-probabilities). NaN gives 0: log_sum_exp checks for NaN apart. */
static inline float exp_nonpositive(float x) {
    const float xc = x > -87.0f ? x : -87.0f;  /* NaN too: the arithmetic stays defined */
    const float m = __builtin_rintf(xc * 1.44269504088896341f);
    /* fused multiply-adds keep the reduction's low bits under -fassociative-math */
    float r = __builtin_fmaf(m, -0.693359375f, xc);
    r = __builtin_fmaf(m, 2.12194440e-4f, r);
    float e = 1.9875691500e-4f;
    e = e * r + 1.3981999507e-3f;
    e = e * r + 8.3334519073e-3f;
    e = e * r + 4.1665795894e-2f;
    e = e * r + 1.6666665459e-1f;
    e = e * r + 5.0000001201e-1f;
    e = e * r * r + r + 1.0f;
    int32_t bits;
    memcpy(&bits, &e, sizeof bits);
    bits += (int32_t)m * (1 << 23);
    memcpy(&e, &bits, sizeof e);
    return x > -87.0f ? e : 0.0f;
}

/* log sum_i e^z_i, given shift >= max_i z_i (the caller knows the maximum from its top-k):
 * one vectorised pass. NaN when a z_i is NaN (or all are -inf), as torch's log-softmax. */
static float log_sum_exp(const float *z, int64_t n, float shift) {
    float sum = 0.0f, check = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        const float x = z[i] - shift;
        sum += exp_nonpositive(x);
        check += x;  /* NaN if any x is */
    }
    if (check != check) return NAN;
    if (!(sum >= FLT_MIN)) {  /* shift far above every z_i: shift by the true maximum */
        float top = -INFINITY;
        for (int64_t i = 0; i < n; ++i)
            if (z[i] > top) top = z[i];
        return top < shift ? log_sum_exp(z, n, top) : shift + logf(sum);
    }
    return shift + logf(sum);
}

/* Eq. 1: G = softmax(U h), kept at its argmax only. Returns the expert, writes G to *g. */
static int64_t select_expert(const ds_plan *p, const float *h, float *scratch, float *g) {
    int64_t best = 0;
    matvec(p->gate, p->d, p->n_experts, h, p->d, scratch);
    for (int64_t e = 1; e < p->n_experts; ++e)
        if (scratch[e] > scratch[best]) best = e;
    float norm = 0.0f;
    for (int64_t e = 0; e < p->n_experts; ++e) norm += exp_nonpositive(scratch[e] - scratch[best]);
    *g = 1.0f / norm;
    return best;
}

/* The value of rank `nth` (0 = largest) among v[0..n), by quickselect; v is reordered. */
static float select_nth_largest(float *v, int64_t n, int64_t nth) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const float pivot = v[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) ++i;
            while (v[j] < pivot) --j;
            if (i <= j) {
                const float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (nth <= j) hi = j;
        else if (nth >= i) lo = i;
        else return v[nth];
    }
    return v[nth];
}

/* Scratch of one query: logits z and a copy for the selection (M floats each, M = the larger of
 * K and the largest expert), the candidates (M indices), the preview coordinates t. */
typedef struct {
    float *z, *spare, *t;
    int64_t *picked;
} scratch_t;

static int64_t scratch_rows(const ds_plan *p) {
    return p->max_rows > p->n_experts ? p->max_rows : p->n_experts;
}

static void *scratch_alloc(const ds_plan *p, scratch_t *s) {
    const int64_t m = scratch_rows(p);
    char *block = malloc((size_t)m * (2 * sizeof(float) + sizeof(int64_t)) +
                         (size_t)p->row_stride * sizeof(float));
    if (block == NULL) return NULL;
    s->picked = (int64_t *)block;  /* first: 8-byte aligned */
    s->z = (float *)(block + (size_t)m * sizeof(int64_t));
    s->spare = s->z + m;
    s->t = s->spare + m;
    return block;
}

/* Nanoseconds of this thread's CPU time, for ds_topk_profile only: on a machine shared with
   other jobs, wall time would count their turns too (the benchmark's --clock cpu measures
   process CPU time likewise; the profile runs on one thread). Costs a few hundred ns a call. */
static int64_t clock_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Adds the time since *mark to ns[stage] and moves the mark: a no-op without a profile. */
static void lap(int64_t *ns, int stage, int64_t *mark) {
    if (ns == NULL) return;
    const int64_t t = clock_ns();
    ns[stage] += t - *mark;
    *mark = t;
}

enum { STAGE_GATE, STAGE_ROWS, STAGE_SELECT, STAGE_FINISH, N_STAGES };

/* Top-k of expert e for query h (Eq. 2): log-probabilities G (W_c h + b_c) - log Z over the
 * expert's classes, best first, as class ids. Returns min(k, n_e). With `ns`, the time of
 * each stage is added there (see ds_topk_profile). */
static int64_t expert_topk(const ds_plan *p, int64_t e, const float *h, float g, int64_t k,
                           const scratch_t *s, float *out_values, int64_t *out_classes,
                           int64_t *ns, int64_t *mark) {
    const int64_t first = p->offsets[e], n = p->offsets[e + 1] - first, d = p->d;
    const int64_t stride = p->row_stride;
    const float *rows = p->weight + first * stride;
    float *z = s->z;
    const int64_t rank = p->preview_rank ? p->preview_rank[e] : 0;
    const int64_t take = k < n ? k : n;
    int64_t filled = 0;
    float shift;  /* at least every logit: the top-1, or with a preview the threshold's */
    if (rank == 0) {  /* exact: every row of the expert */
        matvec(rows, stride, n, h, d, z);
        if (p->has_bias)
            for (int64_t i = 0; i < n; ++i) z[i] += rows[i * stride + d];
        for (int64_t i = 0; i < n; ++i) z[i] *= g;
        lap(ns, STAGE_ROWS, mark);
        for (int64_t i = 0; i < n; ++i)
            filled = insert_top(z[i], i, filled, take, out_values, out_classes);
        shift = out_values[0];
    } else {
        /* SVD-softmax: t = V_W^T [h; 1], preview z~_c = (A V_W)_c . t for every class */
        const float *basis = p->basis + p->basis_offsets[e];
        float *t = s->t;
        for (int64_t j = 0; j < rank; ++j) {
            const float *v = basis + j * stride;
            t[j] = dot(v, h, d) + (p->has_bias ? v[d] : 0.0f);
        }
        matvec(p->preview + p->preview_offsets[e], rank, n, t, rank, z);
        lap(ns, STAGE_ROWS, mark);
        /* the `wanted` best previews get exact logits (ties at the threshold: lowest rows) */
        int64_t wanted = p->candidates[e] > take ? p->candidates[e] : take;
        if (wanted > n) wanted = n;
        int64_t *picked = s->picked;
        memcpy(s->spare, z, (size_t)n * sizeof(float));
        const float threshold = select_nth_largest(s->spare, n, wanted - 1);
        int64_t count = 0;
        for (int64_t i = 0; i < n && count < wanted; ++i)
            if (z[i] > threshold) picked[count++] = i;
        for (int64_t i = 0; i < n && count < wanted; ++i)  /* ties at the threshold (or NaN) */
            if (!(z[i] > threshold) && !(z[i] < threshold)) picked[count++] = i;
        for (int64_t i = 0; i < n && count < wanted; ++i)  /* only reached with NaN about */
            if (z[i] < threshold) picked[count++] = i;
        lap(ns, STAGE_SELECT, mark);
        for (int64_t c = 0; c < count; ++c) {  /* full view: the candidates' own rows */
            const float *row = rows + picked[c] * stride;
            z[picked[c]] = dot(row, h, d) + (p->has_bias ? row[d] : 0.0f);
        }
        for (int64_t i = 0; i < n; ++i) z[i] *= g;
        lap(ns, STAGE_ROWS, mark);
        for (int64_t c = 0; c < count; ++c)
            filled = insert_top(z[picked[c]], picked[c], filled, take, out_values, out_classes);
        shift = out_values[0] > g * threshold ? out_values[0] : g * threshold;
    }
    /* normaliser over the expert: exact logits, and the preview where there is no other
     * (those previews are at most the threshold's) */
    const float log_norm = log_sum_exp(z, n, shift);
    for (int64_t j = 0; j < filled; ++j) {
        out_values[j] -= log_norm;
        out_classes[j] = p->row_class[first + out_classes[j]];
    }
    lap(ns, STAGE_FINISH, mark);
    return filled;
}

/* One query: returns min(k, |v_e|) for its expert e (the pairs written, best first), -1 when
 * out of memory. */
int64_t ds_topk_one(const ds_plan *p, const float *h, int64_t k, float *out_values,
                    int64_t *out_classes) {
    /* per call, not per head: concurrent queries on one head must not share it */
    scratch_t s;
    void *block = scratch_alloc(p, &s);
    if (block == NULL) return -1;
    float g;
    const int64_t e = select_expert(p, h, s.z, &g);
    const int64_t taken = expert_topk(p, e, h, g, k, &s, out_values, out_classes, NULL, NULL);
    free(block);
    return taken;
}

/* Where batch-1 time goes (app/bench/inference.py --breakdown): the n queries h [n, d] one
 * by one as ds_topk_one answers them, with the nanoseconds of each stage summed into
 * ns[N_STAGES + 1]: gate (Eq. 1), the expert's products (or the SVD preview and full view),
 * the candidates' selection (SVD only), normaliser and top-k, then the whole calls. The
 * answers go to out [n, k]. Returns 0, or -1 when out of memory. */
int64_t ds_topk_profile(const ds_plan *p, const float *h, int64_t n, int64_t k,
                        float *out_values, int64_t *out_classes, int64_t *ns) {
    for (int i = 0; i <= N_STAGES; ++i) ns[i] = 0;
    for (int64_t q = 0; q < n; ++q) {
        const int64_t began = clock_ns();
        int64_t mark = began;
        scratch_t s;
        void *block = scratch_alloc(p, &s);
        if (block == NULL) return -1;
        float g;
        const int64_t e = select_expert(p, h + q * p->d, s.z, &g);
        lap(ns, STAGE_GATE, &mark);
        expert_topk(p, e, h + q * p->d, g, k, &s, out_values + q * k, out_classes + q * k, ns,
                    &mark);
        free(block);
        ns[N_STAGES] += clock_ns() - began;
    }
    return 0;
}

/* n queries h [n, h_stride]: out [n, k]. Where the expert holds fewer than k classes, the
 * missing entries are (-inf, class -1), for the caller to fill in.
 * Queries are sorted by expert (a counting sort), so an expert's rows come from memory once
 * and stay in cache for its other queries; `threads` > 1 splits the sorted queries into
 * contiguous shares. Returns 0, or -1 when out of memory. */
int64_t ds_topk_batch(const ds_plan *p, const float *h, int64_t h_stride, int64_t n, int64_t k,
                      float *out_values, int64_t *out_classes, int32_t threads) {
    int64_t *expert = malloc((size_t)n * sizeof(int64_t));
    int64_t *order = malloc((size_t)n * sizeof(int64_t));
    int64_t *start = calloc((size_t)p->n_experts + 1, sizeof(int64_t));
    float *g = malloc((size_t)n * sizeof(float));
    int failed = expert == NULL || order == NULL || start == NULL || g == NULL;
    if (!failed) {
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            float *scratch = malloc((size_t)p->n_experts * sizeof(float));
            if (scratch == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t q = 0; q < n; ++q)
                if (scratch != NULL) expert[q] = select_expert(p, h + q * h_stride, scratch, g + q);
            free(scratch);
        }
    }
    if (!failed) {
        for (int64_t q = 0; q < n; ++q) ++start[expert[q] + 1];
        for (int64_t e = 0; e < p->n_experts; ++e) start[e + 1] += start[e];
        for (int64_t q = 0; q < n; ++q) order[start[expert[q]]++] = q;  /* stable */
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            scratch_t s;
            void *block = scratch_alloc(p, &s);
            if (block == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; ++i) {
                const int64_t q = order[i];
                if (block == NULL) continue;
                float *values = out_values + q * k;
                int64_t *classes = out_classes + q * k;
                const float *query = h + q * h_stride;
                for (int64_t j = expert_topk(p, expert[q], query, g[q], k, &s, values, classes,
                                             NULL, NULL); j < k; ++j) {
                    values[j] = -INFINITY;  /* an expert smaller than k: the caller fills in */
                    classes[j] = -1;
                }
            }
            free(block);
        }
    }
    free(expert);
    free(order);
    free(start);
    free(g);
    return failed ? -1 : 0;
}
