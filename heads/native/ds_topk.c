/* One DS-Softmax top-k query in a single call (heads/ds_softmax.py, DSSoftmaxHead._topk_one).
 *
 * At batch 1 the selected expert holds a few hundred rows, so its matrix-vector product costs
 * a few microseconds while each eager PyTorch call costs about as much: doing gate -> expert
 * product -> log-softmax -> top-k here replaces about ten calls with one (ds-softmax.txt,
 * Table 1 measures this latency). Compiled at first use by heads/native/__init__.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* Returns min(k, |v_k*|): the number of (value, class) pairs written, best first; -1 when
 * out of memory. weight: packed expert rows [R, row_stride]; with has_bias the bias is
 * column d. scratch_size: at least max(K, largest expert). */
int64_t ds_topk_one(const float *h, int64_t d, const float *gate, int64_t n_experts,
                    const float *weight, int64_t row_stride, int32_t has_bias,
                    const int64_t *offsets, const int64_t *row_class, int64_t k,
                    int64_t scratch_size, float *out_values, int64_t *out_classes) {
    /* per call, not per head: concurrent queries on one head must not share it */
    float *scratch = malloc(scratch_size * sizeof(float));
    if (scratch == NULL) return -1;
    /* Eq. 1: G = softmax(U h), kept at its argmax only */
    int64_t best = 0;
    matvec(gate, d, n_experts, h, d, scratch);
    for (int64_t e = 1; e < n_experts; ++e)
        if (scratch[e] > scratch[best]) best = e;
    float norm = 0.0f;
    for (int64_t e = 0; e < n_experts; ++e) norm += expf(scratch[e] - scratch[best]);
    const float g = 1.0f / norm;

    /* Eq. 2: logits G_k* (W_c h + b_c) over the expert's surviving rows */
    const int64_t first = offsets[best], n = offsets[best + 1] - first;
    const float *rows = weight + first * row_stride;
    matvec(rows, row_stride, n, h, d, scratch);
    float top = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
        float z = scratch[i];
        if (has_bias) z += rows[i * row_stride + d];
        z *= g;
        scratch[i] = z;
        if (z > top) top = z;
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += expf(scratch[i] - top);
    const float log_norm = top + logf(sum);

    /* top-k by insertion into the (short) sorted answer; earlier rows win ties */
    const int64_t take = k < n ? k : n;
    int64_t filled = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float z = scratch[i];
        if (filled == take && !(z > out_values[take - 1])) continue;
        int64_t j = filled < take ? filled++ : take - 1;
        while (j > 0 && z > out_values[j - 1]) {
            out_values[j] = out_values[j - 1];
            out_classes[j] = out_classes[j - 1];
            --j;
        }
        out_values[j] = z;
        out_classes[j] = i;
    }
    for (int64_t j = 0; j < take; ++j) {
        out_values[j] -= log_norm;
        out_classes[j] = row_class[first + out_classes[j]];
    }
    free(scratch);
    return take;
}
