/* The softmax passes of the opt-in CPU loss backend, one read and one write per row
 * (heads/cpu_backend.py: the fused loss's chunks, Mixtape's frequent blocks included).
 *
 * In eager PyTorch, E = exp(max(z - M, floor)) with Z = sum E is five passes over [N, C]
 * (amax, sub_, clamp_, exp_, sum), each reading and most writing the whole tensor. Here a row
 * is read once for its maximum and once more, from cache, to write its exps and sum them:
 * 2-3x faster on this project's CPUs. Compiled at first use by heads/native/__init__.py, with
 * OpenMP over rows (the same libgomp as PyTorch's, which the loader finds already loaded).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x in [floor, 0] (floor >= -87, so results stay normal floats): x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by the degree-6 polynomial of Cephes' expf, 2^n written into the
 * exponent bits. Plain C that the compiler vectorises; within 2 ulp of expf (tested). */
static inline float exp_nonpositive(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    const float n = __builtin_rintf(x * log2e);
    /* fused multiply-adds: the compiler may re-associate plain arithmetic here (the loader's
     * -fassociative-math), and x - n (hi + lo) would lose the reduction's low bits */
    float r = __builtin_fmaf(n, -ln2_hi, x);
    r = __builtin_fmaf(n, -ln2_lo, r);
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)n * (1 << 23);
    memcpy(&p, &bits, sizeof p);
    return p;
}

/* row[j] <- exp(max(row[j] - shift, floor)); returns sum_j row[j]. Float lanes within chunks
 * of 1024 and the chunks' sums added in double: the error stays near float rounding however
 * long the row (torch's sum is pairwise). A NaN in the row makes its exp, and the sum, NaN. */
static double exp_row(float *row, int64_t c, float shift, float floor_) {
    double total = 0.0;
    for (int64_t start = 0; start < c; start += 1024) {
        const int64_t stop = start + 1024 < c ? start + 1024 : c;
        float chunk = 0.0f;
        for (int64_t j = start; j < stop; ++j) {
            const float x = row[j] - shift;
            const float clamped = x < floor_ ? floor_ : x;
            /* NaN fails both comparisons: compute on 0 (defined), then give back the NaN */
            const float e = exp_nonpositive(clamped == clamped ? clamped : 0.0f);
            row[j] = x == x ? e : x;
            chunk += row[j];
        }
        total += chunk;
    }
    return total;
}

/* For each of n rows of c floats (row i at z + i * ld): row_max[i] = max_j z_ij (NaN entries
 * ignored), then the row's exps in place and row_sum[i] = their sum. */
void softmax_rows(float *z, int64_t n, int64_t c, int64_t ld, float floor_, float *row_max,
                  float *row_sum, int32_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n * c >= 65536)
    for (int64_t i = 0; i < n; ++i) {
        float *row = z + i * ld;
        float m = -INFINITY;
        for (int64_t j = 0; j < c; ++j) m = row[j] > m ? row[j] : m;
        row_max[i] = m;
        row_sum[i] = (float)exp_row(row, c, m, floor_);
    }
}

/* The same exps with a given shift per row (the maximum over several column blocks); each
 * row's sum is added to row_sum[i], which gathers the blocks' sums. */
void exp_shifted_rows(float *z, int64_t n, int64_t c, int64_t ld, const float *shift,
                      float floor_, float *row_sum, int32_t threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n * c >= 65536)
    for (int64_t i = 0; i < n; ++i) row_sum[i] += (float)exp_row(z + i * ld, c, shift[i], floor_);
}
