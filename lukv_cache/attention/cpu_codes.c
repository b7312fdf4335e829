/* The CPU decode step over a quantized ragged store: attention that reads the codes (8 or 4 bits per entry,
 * per-row groups of channels with a bf16 scale and zero, lukv_cache/cache/storage/quant.py) and never writes a
 * dequantized block. lukv_cache/attention/cpu_codes.py builds this file once per machine with the system's C
 * compiler and calls it through ctypes; it says what every argument is.
 *
 * Work items are (segment, chunk of at most CHUNK rows); each one streams its rows once: a row's key is
 * dequantized into a D-float buffer on the stack, its M logits computed, the online softmax's running max and
 * sum updated, and its value row, dequantized the same way, accumulated into M x D sums (flash-decoding). The
 * rows appended in place beside the store (its tail) are more work items, the dense suffix (read in its buffers,
 * each segment's rows a stride apart) one more per segment. A segment's items are then merged by log-sum-exp into
 * its output rows. Everything in fp32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 256
#define MAX_M 64

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* row n's D channels in fp32, from its codes (D * bits / 8 bytes), scales and zeros (D / group each). At 4 bits
 * in the "nibble order" of each group (its even channels, then its odd ones: the low nibbles, then the high
 * ones), so that the loops stay contiguous; attend_rows permutes the queries and its sums to match. */
static inline __attribute__((always_inline)) void dequantize_row(const uint8_t *codes, const uint16_t *scale, const uint16_t *zero, int d,
                                  int bits, int group, float *out) {
    int groups = d / group;
    for (int g = 0; g < groups; g++) {
        float s = bf16_to_float(scale[g]), z = bf16_to_float(zero[g]);
        float *o = out + g * group;
        if (bits == 8) {
            const uint8_t *c = codes + g * group;
#pragma omp simd
            for (int j = 0; j < group; j++) o[j] = (float)c[j] * s + z;
        } else {
            const uint8_t *c = codes + g * group / 2;
#pragma omp simd
            for (int j = 0; j < group / 2; j++) o[j] = (float)(c[j] & 0x0F) * s + z;
#pragma omp simd
            for (int j = 0; j < group / 2; j++) o[group / 2 + j] = (float)(c[j] >> 4) * s + z;
        }
    }
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int j = 0; j < d; j++) acc += a[j] * b[j];
    return acc;
}

/* exp(x) in fp32 without libm (so that the loops over a block vectorize): 2^n exp(r), r in [-ln2/2, ln2/2],
 * Cephes' expf polynomial (about 1 ulp); 0 below EXP_LOW (exp(-inf) = 0). The range and the polynomial are
 * macros so that the vector version (vexp) shares them: the arithmetic reads the same on floats and vectors. */
#define EXP_LOW -87.3f
#define EXP_HIGH 88.7f
#define EXP_LOG2E 1.44269504088896341f
/* r = x - n ln2, ln2 in two parts (Cephes' C1, C2) */
#define EXP_REDUCE(x, n) ((x) - (n) * 0.693359375f + (n) * 2.12194440e-4f)
/* exp(r) for |r| <= ln2 / 2 */
#define EXP_POLY(r)                                                                                                \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) * (r) + \
       1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)
static inline __attribute__((always_inline)) float exp_approx(float x) {
    float low = x < EXP_LOW ? 0.0f : 1.0f;
    x = x < EXP_LOW ? EXP_LOW : (x > EXP_HIGH ? EXP_HIGH : x);
    float n = floorf(x * EXP_LOG2E + 0.5f);
    float r = EXP_REDUCE(x, n);
    float p = EXP_POLY(r);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * low;
}

static inline float capped(float x, float softcap) { return softcap > 0.0f ? tanhf(x / softcap) * softcap : x; }

/* An item's start: the queries in the codes' nibble order at 4 bits (each group's even channels, then its odd
 * ones, as the codes' low then high nibbles), the running max, sum and sums emptied. Returns the queries to use. */
static inline __attribute__((always_inline)) const float *start_item(const float *q, int m_rows, int d, int group,
                                                                     int nibbles, float *nibble_q, float *item_max,
                                                                     float *item_sum, float *acc) {
    if (nibbles) {
        for (int m = 0; m < m_rows; m++)
            for (int g = 0; g < d / group; g++)
                for (int j = 0; j < group / 2; j++) {
                    const float *from = q + (size_t)m * d + g * group;
                    float *to = nibble_q + (size_t)m * d + g * group;
                    to[j] = from[2 * j];
                    to[group / 2 + j] = from[2 * j + 1];
                }
        q = nibble_q;
    }
    for (int m = 0; m < m_rows; m++) {
        item_max[m] = -INFINITY;
        item_sum[m] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)m_rows * d);
    return q;
}

/* An item's end at 4 bits: its sums back in channel order */
static inline __attribute__((always_inline)) void sums_in_channel_order(float *acc, int m_rows, int d, int group) {
    float row[MAX_D];
    for (int m = 0; m < m_rows; m++) {
        float *a = acc + (size_t)m * d;
        memcpy(row, a, sizeof(float) * d);
        for (int g = 0; g < d / group; g++)
            for (int j = 0; j < group / 2; j++) {
                a[g * group + 2 * j] = row[g * group + j];
                a[g * group + 2 * j + 1] = row[g * group + group / 2 + j];
            }
    }
}

/* One work item: rows [lo, hi) of a store (codes) or of a dense suffix (keys/values given as floats),
 * attended by the M queries q [M, D]; writes the item's max, sum and unnormalised sums acc [M, D]. Rows go
 * BLOCK at a time: the block's keys dequantized, its M x BLOCK logits, one rescale per query and block, the
 * weights' exponentials, then the values dequantized and accumulated. */
#define BLOCK 16
static inline __attribute__((always_inline)) void attend_rows(const float *q, int m_rows, int d, int lo, int hi, const uint8_t *kc, const uint16_t *ks,
                        const uint16_t *kz, const uint8_t *vc, const uint16_t *vs, const uint16_t *vz, int bits,
                        int group, const float *dense_k, const float *dense_v, float softcap, float *item_max,
                        float *item_sum, float *acc) {
    float keys[BLOCK * MAX_D], values[BLOCK * MAX_D], weight[MAX_M * BLOCK];
    float nibble_q[MAX_M * MAX_D];
    int row_bytes = d * bits / 8, groups = d / group;
    int nibbles = bits == 4 && !dense_k; /* codes in nibble order: the queries permuted alike */
    q = start_item(q, m_rows, d, group, nibbles, nibble_q, item_max, item_sum, acc);
    for (int start = lo; start < hi; start += BLOCK) {
        int rows = hi - start < BLOCK ? hi - start : BLOCK;
        const float *k = keys, *v = values;
        if (dense_k) {
            k = dense_k + (size_t)start * d;
            v = dense_v + (size_t)start * d;
        } else {
            for (int r = 0; r < rows; r++) {
                size_t n = (size_t)(start + r);
                dequantize_row(kc + n * row_bytes, ks + n * groups, kz + n * groups, d, bits, group, keys + r * d);
            }
        }
        for (int m = 0; m < m_rows; m++) {
            float *w = weight + m * BLOCK, top = item_max[m];
            for (int r = 0; r < rows; r++) {
                w[r] = capped(dot(q + (size_t)m * d, k + (size_t)r * d, d), softcap);
                if (w[r] > top) top = w[r];
            }
            if (top > item_max[m]) { /* a new max: rescale what is summed so far */
                float scale = expf(item_max[m] - top);
                float *a = acc + (size_t)m * d;
                item_sum[m] *= scale;
#pragma omp simd
                for (int j = 0; j < d; j++) a[j] *= scale;
                item_max[m] = top;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int r = 0; r < rows; r++) {
                w[r] = exp_approx(w[r] - top);
                sum += w[r];
            }
            item_sum[m] += sum;
        }
        if (!dense_k) {
            for (int r = 0; r < rows; r++) {
                size_t n = (size_t)(start + r);
                dequantize_row(vc + n * row_bytes, vs + n * groups, vz + n * groups, d, bits, group, values + r * d);
            }
        }
        for (int m = 0; m < m_rows; m++) {  /* each channel's sum in a register across the block's rows */
            float *a = acc + (size_t)m * d;
            const float *w = weight + m * BLOCK;
#pragma omp simd
            for (int j = 0; j < d; j++) {
                float sum = a[j];
                for (int r = 0; r < rows; r++) sum += w[r] * v[(size_t)r * d + j];
                a[j] = sum;
            }
        }
    }
    if (nibbles) sums_in_channel_order(acc, m_rows, d, group);
}


/* The common shapes (head_dim a multiple of 32, groups of 32 channels) in GCC / clang vector extensions, one
 * register per vector: 16 floats on AVX-512, 8 on AVX2 with FMA (LUKV_LANES). A block's 16 key rows are dequantized
 * (one vpmovzxbd per LUKV_LANES codes), each query's dots taken as LUKV_LANES vectors of partial products at a time
 * and reduced together by a tree of shuffles (lane r of the result is row r's logit: no horizontal sum per row),
 * the block's softmax done on the lanes, and the values accumulated a tile of query rows at a time with the tile's
 * sums in registers: 0.6-0.7 of the scalar loop's time per row at head_dim 64 on either
 * (benchmarks/cpu_kernel_builds.py). The vectors are sized to the registers: 16-float vectors on AVX2 are split
 * through memory by the compilers (several times slower than the scalar loop, measured with GCC 12 and -mavx2).
 * Elsewhere (other CPUs, old compilers) the scalar attend_rows above serves, and everywhere for the dense suffix
 * and other shapes. */
#if !defined(LUKV_SCALAR) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)) /* -DLUKV_SCALAR: none */
#if defined(__AVX512F__)
#define LUKV_LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define LUKV_LANES 8
#endif
#endif
#ifdef LUKV_LANES
#define LUKV_VECTOR 1
#include <immintrin.h>
/* the registers a tile of query rows keeps its sums in: half of them (32 zmm on AVX-512, 16 ymm on AVX2: a tile
 * that fills all 16 spilled, 14-18% slower at head_dim 64) */
#define SUM_REGISTERS (LUKV_LANES == 16 ? 16 : 8)
typedef float vf __attribute__((vector_size(4 * LUKV_LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LUKV_LANES)));

static inline __attribute__((always_inline)) vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline __attribute__((always_inline)) void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline __attribute__((always_inline)) vf vcodes(vi c, float s, float z) {
    return __builtin_convertvector(c, vf) * s + z;
}
#if LUKV_LANES == 16
static const vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
/* 16 bytes at p, each widened to an int32 lane */
static inline __attribute__((always_inline)) vi widen(const uint8_t *p) {
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
/* the even lanes of a:b plus the odd ones: a's 16 lanes summed in pairs into lanes 0-7, b's into 8-15 */
static inline __attribute__((always_inline)) vf pair_sum(vf a, vf b) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
/* v's lanes combined by op with their partners at distance 8, 4, 2, 1: every lane holds the op of all */
#define HALVINGS(v, op)                                                                                             \
    do {                                                                                                           \
        v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));            \
        v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));            \
        v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));            \
        v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));            \
    } while (0)
#else
static const vi IOTA = {0, 1, 2, 3, 4, 5, 6, 7};
/* 8 bytes at p, each widened to an int32 lane */
static inline __attribute__((always_inline)) vi widen(const uint8_t *p) {
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
/* a's 8 lanes summed in pairs into lanes 0-3, b's into 4-7 */
static inline __attribute__((always_inline)) vf pair_sum(vf a, vf b) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
#define HALVINGS(v, op)                                                                                             \
    do {                                                                                                           \
        v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));                                          \
        v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));                                          \
        v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));                                          \
    } while (0)
#endif
/* lane r = the sum of p[r]'s lanes (pairs summed, then pairs of pairs: a tree of LUKV_LANES - 1 pair_sums) */
static inline __attribute__((always_inline)) vf lane_sums(const vf *p) {
    vf a[LUKV_LANES];
    for (int i = 0; i < LUKV_LANES; i++) a[i] = p[i];
    for (int n = LUKV_LANES; n > 1; n /= 2)
        for (int i = 0; i < n / 2; i++) a[i] = pair_sum(a[2 * i], a[2 * i + 1]);
    return a[0];
}
/* lane-wise max / min and a mask's select, in the vector extensions' words (C has no ?: on vectors) */
static inline __attribute__((always_inline)) vf vselect(vi mask, vf a, vf b) {
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}
static inline __attribute__((always_inline)) vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
static inline __attribute__((always_inline)) vf vmin(vf a, vf b) { return vselect(a < b, a, b); }
static inline __attribute__((always_inline)) vf vadd(vf a, vf b) { return a + b; }
/* the max and the sum of a vector's lanes (halving trees) */
static inline __attribute__((always_inline)) float hmax(vf v) {
    HALVINGS(v, vmax);
    return v[0];
}
static inline __attribute__((always_inline)) float hsum(vf v) {
    HALVINGS(v, vadd);
    return v[0];
}
/* exp_approx on the lanes (the same polynomial; n rounded to nearest by the 1.5 * 2^23 trick) */
static inline __attribute__((always_inline)) vf vexp(vf x) {
    vi below = x < EXP_LOW;
    x = vmin(vmax(x, (vf){} + EXP_LOW), (vf){} + EXP_HIGH);
    vf n = (x * EXP_LOG2E + 12582912.0f) - 12582912.0f;
    vf r = EXP_REDUCE(x, n);
    vf p = EXP_POLY(r);
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return vselect(~below, p * (vf)bits, (vf){});
}
/* row n of a store into d / LUKV_LANES vectors (groups of 32 channels; at 4 bits each group's low nibbles, then
 * its high ones: the nibble order) */
static inline __attribute__((always_inline)) void vrow(const uint8_t *codes, const uint16_t *scale,
                                                       const uint16_t *zero, int d, int bits, float *out) {
    for (int g = 0; g < d / 32; g++) {
        float s = bf16_to_float(scale[g]), z = bf16_to_float(zero[g]);
        float *o = out + 32 * g;
        if (bits == 8) {
            for (int i = 0; i < 32 / LUKV_LANES; i++)
                vstore(o + LUKV_LANES * i, vcodes(widen(codes + 32 * g + LUKV_LANES * i), s, z));
        } else {
            for (int i = 0; i < 16 / LUKV_LANES; i++) {
                vi b = widen(codes + 16 * g + LUKV_LANES * i);
                vstore(o + LUKV_LANES * i, vcodes(b & 0x0F, s, z));
                vstore(o + 16 + LUKV_LANES * i, vcodes(b >> 4, s, z));
            }
        }
    }
}
/* acc[m0 .. m0 + T) += the block's weights x values, the T x C sums in registers across its rows */
static inline __attribute__((always_inline)) void vaccumulate(float *acc, const float *weight, const float *v,
                                                              int m0, int T, int d, int rows) {
    int C = d / LUKV_LANES;
    vf a[4 * MAX_D / LUKV_LANES]; /* T x C of them used */
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) a[t * C + c] = vload(acc + (size_t)(m0 + t) * d + LUKV_LANES * c);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < C; c++) {
            vf x = vload(v + (size_t)r * d + LUKV_LANES * c);
            for (int t = 0; t < T; t++) a[t * C + c] += weight[(m0 + t) * BLOCK + r] * x;
        }
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) vstore(acc + (size_t)(m0 + t) * d + LUKV_LANES * c, a[t * C + c]);
}

static inline __attribute__((always_inline)) void attend_rows_vector(
    const float *q, int m_rows, int d, int lo, int hi, const uint8_t *kc, const uint16_t *ks, const uint16_t *kz,
    const uint8_t *vc, const uint16_t *vs, const uint16_t *vz, int bits, float softcap, float *item_max,
    float *item_sum, float *acc) {
    enum { PARTS = BLOCK / LUKV_LANES }; /* the block's logits: PARTS vectors of LUKV_LANES rows */
    float keys[BLOCK * MAX_D] __attribute__((aligned(64))), values[BLOCK * MAX_D] __attribute__((aligned(64)));
    float weight[MAX_M * BLOCK] __attribute__((aligned(64))), nibble_q[MAX_M * MAX_D];
    int row_bytes = d * bits / 8, groups = d / 32, C = d / LUKV_LANES;
    q = start_item(q, m_rows, d, 32, bits == 4, nibble_q, item_max, item_sum, acc);
    for (int start = lo; start < hi; start += BLOCK) {
        int rows = hi - start < BLOCK ? hi - start : BLOCK;
        for (int r = 0; r < rows; r++) {
            size_t n = (size_t)(start + r);
            vrow(kc + n * row_bytes, ks + n * groups, kz + n * groups, d, bits, keys + r * d);
        }
        if (rows < BLOCK) memset(keys + rows * d, 0, sizeof(float) * (size_t)(BLOCK - rows) * d);
        for (int m = 0; m < m_rows; m++) {
            vf logits[PARTS];
            float top = -INFINITY;
            for (int part = 0; part < PARTS; part++) {
                vf p[LUKV_LANES];
                for (int r = 0; r < LUKV_LANES; r++) {
                    const float *k = keys + (part * LUKV_LANES + r) * d;
                    vf sum = vload(q + (size_t)m * d) * vload(k);
                    for (int c = 1; c < C; c++) sum += vload(q + (size_t)m * d + LUKV_LANES * c) * vload(k + LUKV_LANES * c);
                    p[r] = sum;
                }
                vf l = lane_sums(p);
                if (softcap > 0.0f) {
                    for (int r = 0; r < LUKV_LANES; r++) l[r] = capped(l[r], softcap);
                }
                l = vselect(IOTA + part * LUKV_LANES < rows, l, (vf){} - INFINITY);
                float part_top = hmax(l);
                if (part_top > top) top = part_top;
                logits[part] = l;
            }
            if (top > item_max[m]) { /* a new max: rescale what is summed so far */
                float scale = expf(item_max[m] - top);
                float *a = acc + (size_t)m * d;
                item_sum[m] *= scale;
                for (int c = 0; c < C; c++) vstore(a + LUKV_LANES * c, vload(a + LUKV_LANES * c) * scale);
                item_max[m] = top;
            }
            for (int part = 0; part < PARTS; part++) {
                vf w = vexp(logits[part] - item_max[m]);
                item_sum[m] += hsum(w);
                vstore(weight + m * BLOCK + part * LUKV_LANES, w);
            }
        }
        for (int r = 0; r < rows; r++) {
            size_t n = (size_t)(start + r);
            vrow(vc + n * row_bytes, vs + n * groups, vz + n * groups, d, bits, values + r * d);
        }
        /* query rows whose sums fit SUM_REGISTERS registers (at head_dim 128 and 256 on AVX2 a row's alone do
         * not: they spill, and cutting the channels into chunks that fit was 2-7% slower) */
        int tile = SUM_REGISTERS / C < 1 ? 1 : (SUM_REGISTERS / C > 4 ? 4 : SUM_REGISTERS / C);
        for (int m = 0; m < m_rows;) {
            int t = m_rows - m < tile ? m_rows - m : tile;
            switch (t) { /* T a constant in each: the sums stay in registers */
            case 4: vaccumulate(acc, weight, values, m, 4, d, rows); break;
            case 3: vaccumulate(acc, weight, values, m, 3, d, rows); break;
            case 2: vaccumulate(acc, weight, values, m, 2, d, rows); break;
            default: vaccumulate(acc, weight, values, m, 1, d, rows);
            }
            m += t;
        }
    }
    if (bits == 4) sums_in_channel_order(acc, m_rows, d, 32);
}
#endif

/* attend_rows with the common shapes' D, bits and group as constants (the compiler unrolls them) */
#define ATTEND_ARGS                                                                                                \
    const float *q, int m_rows, int d, int lo, int hi, const uint8_t *kc, const uint16_t *ks, const uint16_t *kz, \
        const uint8_t *vc, const uint16_t *vs, const uint16_t *vz, int bits, int group, const float *dense_k,    \
        const float *dense_v, float softcap, float *item_max, float *item_sum, float *acc
#ifdef LUKV_VECTOR
#define SPECIALISE(NAME, D, BITS, GROUP)                                                                            \
    static void NAME(ATTEND_ARGS) {                                                                                \
        (void)d, (void)bits, (void)group;                                                                          \
        if (dense_k)                                                                                               \
            attend_rows(q, m_rows, D, lo, hi, kc, ks, kz, vc, vs, vz, BITS, GROUP, dense_k, dense_v, softcap,     \
                        item_max, item_sum, acc);                                                                  \
        else                                                                                                       \
            attend_rows_vector(q, m_rows, D, lo, hi, kc, ks, kz, vc, vs, vz, BITS, softcap, item_max, item_sum,  \
                               acc);                                                                               \
    }
#else
#define SPECIALISE(NAME, D, BITS, GROUP)                                                                            \
    static void NAME(ATTEND_ARGS) {                                                                                \
        (void)d, (void)bits, (void)group;                                                                          \
        attend_rows(q, m_rows, D, lo, hi, kc, ks, kz, vc, vs, vz, BITS, GROUP, dense_k, dense_v, softcap, item_max, \
                    item_sum, acc);                                                                                \
    }
#endif
SPECIALISE(attend_64_8, 64, 8, 32)
SPECIALISE(attend_64_4, 64, 4, 32)
SPECIALISE(attend_128_8, 128, 8, 32)
SPECIALISE(attend_128_4, 128, 4, 32)
SPECIALISE(attend_256_8, 256, 8, 32)
SPECIALISE(attend_256_4, 256, 4, 32)
static void attend_any(ATTEND_ARGS) {
    attend_rows(q, m_rows, d, lo, hi, kc, ks, kz, vc, vs, vz, bits, group, dense_k, dense_v, softcap, item_max,
                item_sum, acc);
}

/* The work items of a call: (segment, lo, hi, source: 0 the store, 1 the tail, 2 the suffix), written when item_seg
 * is given; returns how many there are. */
static int plan_items(int segments, const int64_t *offsets, int tail_len, int tail_cap, int suffix_len, int chunk,
                      int *item_seg, int *item_lo, int *item_hi, int *item_src) {
    int count = 0;
    for (int s = 0; s < segments; s++) {
        for (int src = 0; src < 3; src++) {
            int64_t first = src == 0 ? offsets[s] : (src == 1 ? (int64_t)s * tail_cap : 0);
            int64_t end = src == 0 ? offsets[s + 1] : first + (src == 1 ? tail_len : suffix_len);
            int64_t step = src == 2 ? (end > first ? end - first : 1) : chunk; /* the suffix: one item */
            for (int64_t lo = first; lo < end; lo += step) {
                if (item_seg) {
                    item_seg[count] = s;
                    item_lo[count] = (int)lo;
                    item_hi[count] = (int)(lo + step < end ? lo + step : end);
                    item_src[count] = src;
                }
                count++;
            }
        }
    }
    return count;
}

/* q [S, M, D] fp32 (multiplied by scaling here); store rows by segment (offsets [S + 1], int64); a tail of tail_len
 * rows per segment (segment s: rows s * tail_cap + 0 .. tail_len - 1 of tkc .. tvz, quantized like the store;
 * tail_len 0: none), the rows decoding appended since the store was built; suffix_k / suffix_v: segment s's L rows
 * of D fp32 at s * suffix_stride (L may be 0); out [S, M, D], lse [S, M] (fp32; a segment with nothing to attend:
 * out 0, lse -inf). chunk: rows per work item. Returns 0, or -1 when D or M exceed the buffers or memory runs out. */
int lukv_codes_decode(int segments, int m_rows, int d, int bits, int group, float scaling, const float *q,
                      const uint8_t *kc, const uint16_t *ks, const uint16_t *kz, const uint8_t *vc,
                      const uint16_t *vs, const uint16_t *vz, const int64_t *offsets, int tail_len, int tail_cap,
                      const uint8_t *tkc, const uint16_t *tks, const uint16_t *tkz, const uint8_t *tvc,
                      const uint16_t *tvs, const uint16_t *tvz, int suffix_len, int64_t suffix_stride,
                      const float *suffix_k, const float *suffix_v, float softcap, int chunk, int threads, float *out,
                      float *lse) {
    if (d > MAX_D || m_rows > MAX_M || chunk < 1 || tail_len > tail_cap) return -1;
    int per_item = m_rows * (d + 2);
    int items = plan_items(segments, offsets, tail_len, tail_cap, suffix_len, chunk, 0, 0, 0, 0);
    size_t queries = (size_t)segments * m_rows * d;
    /* one block: the items' (segment, lo, hi, source), the scaled queries, each item's max, sum and sums */
    size_t ints = 4 * (size_t)(items > 0 ? items : 1), floats = queries + (size_t)items * per_item;
    int *item_seg = (int *)malloc(sizeof(int) * ints + sizeof(float) * (floats + 16));
    if (!item_seg) return -1;
    int *item_lo = item_seg + items, *item_hi = item_lo + items, *item_src = item_hi + items;
    int count = plan_items(segments, offsets, tail_len, tail_cap, suffix_len, chunk, item_seg, item_lo, item_hi,
                           item_src);
    float *scaled = (float *)(((uintptr_t)(item_seg + ints) + 63) & ~(uintptr_t)63), *scratch = scaled + queries;
    for (size_t i = 0; i < queries; i++) scaled[i] = q[i] * scaling;
    q = scaled;
    void (*attend)(ATTEND_ARGS) = attend_any;
    if (group == 32 && d == 64) attend = bits == 8 ? attend_64_8 : attend_64_4;
    if (group == 32 && d == 128) attend = bits == 8 ? attend_128_8 : attend_128_4;
    if (group == 32 && d == 256) attend = bits == 8 ? attend_256_8 : attend_256_4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
    for (int i = 0; i < count; i++) {
        int s = item_seg[i];
        float *mx = scratch + (size_t)i * per_item, *sum = mx + m_rows, *acc = sum + m_rows;
        const float *qs = q + (size_t)s * m_rows * d;
        if (item_src[i] == 2) {
            const float *k = suffix_k + (size_t)s * suffix_stride, *v = suffix_v + (size_t)s * suffix_stride;
            attend(qs, m_rows, d, 0, item_hi[i], 0, 0, 0, 0, 0, 0, bits, group, k, v, softcap, mx, sum, acc);
        } else if (item_src[i] == 1) {
            attend(qs, m_rows, d, item_lo[i], item_hi[i], tkc, tks, tkz, tvc, tvs, tvz, bits, group, 0, 0, softcap,
                   mx, sum, acc);
        } else {
            attend(qs, m_rows, d, item_lo[i], item_hi[i], kc, ks, kz, vc, vs, vz, bits, group, 0, 0, softcap,
                        mx, sum, acc);
        }
    }
    /* merge each segment's items (they are consecutive) */
    int i = 0;
    for (int s = 0; s < segments; s++) {
        int first = i;
        while (i < count && item_seg[i] == s) i++;
        for (int m = 0; m < m_rows; m++) {
            float top = -INFINITY;
            for (int j = first; j < i; j++) {
                float v = scratch[(size_t)j * per_item + m];
                if (v > top) top = v;
            }
            float *o = out + ((size_t)s * m_rows + m) * d;
            memset(o, 0, sizeof(float) * d);
            if (top == -INFINITY) {
                lse[(size_t)s * m_rows + m] = -INFINITY;
                continue;
            }
            float total = 0.0f;
            for (int j = first; j < i; j++) {
                const float *item = scratch + (size_t)j * per_item;
                float w = expf(item[m] - top);
                if (w == 0.0f) continue;
                total += w * item[m_rows + m];
                const float *a = item + 2 * m_rows + (size_t)m * d;
#pragma omp simd
                for (int c = 0; c < d; c++) o[c] += w * a[c];
            }
            float inv = 1.0f / total;
#pragma omp simd
            for (int c = 0; c < d; c++) o[c] *= inv;
            lse[(size_t)s * m_rows + m] = top + logf(total);
        }
    }
    free(item_seg);
    return 0;
}

/* The vector width the common shapes run at: LUKV_LANES floats, or 0 where the scalar loop serves them. */
int lukv_codes_lanes(void) {
#ifdef LUKV_LANES
    return LUKV_LANES;
#else
    return 0;
#endif
}
