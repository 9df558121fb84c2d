/* pagedlib's fused paged attention for CPUs: attention="cpu" (notebooks 04 and 05).

   The loop of the Triton kernels (triton_decode.py, triton_varlen.py), written in C for a processor's
   cores. A work item is one sequence's query rows for one KV head: a decode's GROUP query heads, or up to
   ROWS rows (token x query head) of a prompt chunk. It walks the sequence's block table, reads each block
   of K and V where it lies in the pool, and keeps an online softmax per row. Nothing is gathered into a
   copy: a float32 block is read in place; fp16, bf16 and fp8 blocks are widened to float one block (one
   head) at a time into a few kilobytes that stay in the core's cache.

   A sliding window (window > 0) starts a work item's walk at the first block its first row's window
   reaches: blocks before it are never read (their table entries may be -1, the null block of a group
   that gave them back), and each row skips the keys before its own window. Each loop is compiled twice,
   with and without the window (W), so that full attention runs the loop it ran before windows existed.

   Two loops, for two shapes of work. A few rows (a decode) take dot products, key after key
   (attend_rows). A tile of many rows (a prompt chunk) takes each key against all its rows at once, its
   queries transposed so that the arithmetic runs along the rows (attend_tile): a dot product ends in a
   sum across a vector, which costs more than its multiply-adds when head_dim is small.

   Built on first use by cpu_varlen.py with the machine's C compiler (-O3, the machine's own vector
   instructions, OpenMP where the compiler has it) and called through ctypes; it checks the arguments. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define ROWS 16                 /* query rows per work item: a tile of (token, query head) rows */
#define INLINE static inline __attribute__((always_inline))

enum { F32 = 0, F16 = 1, BF16 = 2, BYTE = 3 };  /* how a pool's elements are stored */

typedef struct {                /* one pool, K or V: [num_blocks, block_size, kv_heads, head_dim] */
    const void *data;
    int64_t block, slot, head;  /* strides in elements (head_dim's is 1) */
    int kind;                   /* F32, F16, BF16, or BYTE: one byte read through `table` (fp8) */
    const float *table;         /* BYTE: the value of each of the 256 bytes */
    const float *scale;         /* [kv_heads]: multiplies every widened value (fp8's scales; else 1) */
} Pool;

typedef struct {                /* what every work item of one call shares */
    const float *q; float *out;   /* [T, q_heads, D], float32, contiguous */
    Pool k, v;
    const int32_t *tables; int64_t table_stride;  /* [batch, max_blocks] */
    const int32_t *seq_lens, *qsl;                /* [batch], [batch + 1] */
    int q_heads, kv_heads, group, block_size, num_blocks;
    int window;                                   /* a row at p sees keys p - window < k <= p; 0: k <= p */
    float scale;
} Call;

/* e^x for x <= 0 in a form compilers vectorize: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' expf
   polynomial, times 2^n built in the exponent bits; within 1.02 ulp of e^x on every float in [-87, 0].
   Below -87 it returns e^-87 (~1e-38), which no sum of probabilities of at least 1 can tell from 0. */
INLINE float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;     /* ln2 in two parts: r stays exact */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n = { ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    union { uint32_t u; float f; } out;
    if (exp == 0x1f) out.u = sign | 0x7f800000u | (man << 13);            /* inf, NaN */
    else if (exp) out.u = sign | ((exp + 112) << 23) | (man << 13);       /* normal */
    else { out.f = (float)man * 5.9604644775390625e-8f; out.u |= sign; }  /* subnormal, zero: man 2^-24 */
    return out.f;
}

/* Slots [0, n) of heads [h0, h0 + heads) of block blk as float32: a pointer and the strides of a slot
   and of a head. A float32 pool is read in place; any other is widened (and scaled) into buf, [n, heads,
   D]. */
static const float *block_rows(const Pool *p, int64_t blk, int h0, int heads, int n, int D, float *buf,
                               int64_t *slot, int64_t *head) {
    if (p->kind == F32) {
        *slot = p->slot; *head = p->head;
        return (const float *)p->data + blk * p->block + h0 * p->head;
    }
    for (int t = 0; t < n; t++)
        for (int h = h0; h < h0 + heads; h++) {
            int64_t at = blk * p->block + t * p->slot + h * p->head;
            float *row = buf + ((int64_t)t * heads + h - h0) * D, s = p->scale[h];
            if (p->kind == BF16) {
                const uint16_t *x = (const uint16_t *)p->data + at;
                for (int d = 0; d < D; d++) { union { uint32_t u; float f; } v = { (uint32_t)x[d] << 16 };
                                              row[d] = v.f * s; }
            } else if (p->kind == F16) {
                const uint16_t *x = (const uint16_t *)p->data + at;
                for (int d = 0; d < D; d++) row[d] = half_to_float(x[d]) * s;
            } else {
                const uint8_t *x = (const uint8_t *)p->data + at;
                for (int d = 0; d < D; d++) row[d] = p->table[x[d]] * s;
            }
        }
    *slot = (int64_t)heads * D; *head = D;
    return buf;
}

/* A work item's row r: a new token of the sequence (0 its first) and a query head. An item of one KV
   head h (h >= 0) has `group` rows per token, its query heads h * group...; an item of every head (h < 0,
   a decode's) has q_heads rows per token. */
typedef struct { int token, head; } Row;
INLINE Row row_of(const Call *c, int h, int r) {
    int width = h < 0 ? c->q_heads : c->group;
    Row x = { r / width, (h < 0 ? 0 : h * c->group) + r % width };
    return x;
}

/* Where a row's query is in q and its output in out (the sequence's first new token is q's row q0). */
INLINE int64_t row_at(const Call *c, int q0, Row x, int D) {
    return ((int64_t)(q0 + x.token) * c->q_heads + x.head) * D;
}

/* Block j of sequence b's table, K and V of the item's heads (h, or all of them for h < 0) as float rows,
   read in place or widened into kbuf, vbuf; n: the slots anyone in the item sees. Strides: a slot's and a
   head's. Returns 0, or 1 for a block outside the pool (then nothing is read). */
INLINE int fetch_block(const Call *c, int b, int j, int h, int n, int D, float *kbuf, float *vbuf,
                       const float **kp, const float **vp, int64_t stride[4]) {
    int64_t blk = c->tables[(int64_t)b * c->table_stride + j];
    if (blk < 0 || blk >= c->num_blocks) return 1;
    int h0 = h < 0 ? 0 : h, heads = h < 0 ? c->kv_heads : 1;
    *kp = block_rows(&c->k, blk, h0, heads, n, D, kbuf, &stride[0], &stride[1]);
    *vp = block_rows(&c->v, blk, h0, heads, n, D, vbuf, &stride[2], &stride[3]);
    return 0;
}

/* acc[r] = acc[r] * fix + sum over t < see of p[t * step] * v[t]: probabilities times V, in registers */
INLINE void add_pv(float *acc, float fix, const float *p, int step, int see, const float *vp, int64_t vs,
                   const int D) {
    float a[D];
    for (int d = 0; d < D; d++) a[d] = acc[d] * fix;
    for (int t = 0; t < see; t++)
        #pragma omp simd
        for (int d = 0; d < D; d++) a[d] += p[t * step] * vp[t * vs + d];
    for (int d = 0; d < D; d++) acc[d] = a[d];
}

/* The first block a work item reads: 0, or with a window (W) the block of the first key the window of
   its first row (at position p) holds */
INLINE int first_block(const Call *c, int p, const int W) {
    int key = W ? p + 1 - c->window : 0;
    return key > 0 ? key / c->block_size : 0;
}

/* A work item of few rows: sequence b's rows [r0, r1) (of KV head h, or of every head for h < 0: a
   decode's item reads whole blocks, every head's slots in memory order). A row at position p sees keys
   0..p, or p - window + 1..p with a window (W). D and W are compile-time constants where the caller
   passes them (the loops over D then unroll). Each row's scores are dot products, four keys at a time.
   Returns 1 if the table names a block outside the pool, else 0. */
INLINE int attend_rows(const Call *c, int b, int h, int r0, int r1, const int D, const int W, float *kbuf,
                       float *vbuf) {
    float acc[ROWS][D], qs[ROWS][D], m[ROWS], l[ROWS], s[c->block_size];
    int R = r1 - r0, bs = c->block_size, q0 = c->qsl[b], kvh[ROWS], pos[ROWS];
    int context = c->seq_lens[b] - (c->qsl[b + 1] - q0);        /* tokens before the new ones */
    for (int r = 0; r < R; r++) {              /* each row's query, times the softmax scale; its state */
        Row x = row_of(c, h, r0 + r);
        const float *qr = c->q + row_at(c, q0, x, D);
        for (int d = 0; d < D; d++) { qs[r][d] = qr[d] * c->scale; acc[r][d] = 0.0f; }
        m[r] = -FLT_MAX; l[r] = 0.0f;
        pos[r] = context + x.token;
        kvh[r] = h < 0 ? x.head / c->group : 0;          /* its head among the fetched ones */
    }
    int last = context + row_of(c, h, r1 - 1).token;    /* the last row's position: keys 0..last */
    for (int j = first_block(c, context + row_of(c, h, r0).token, W); j <= last / bs; j++) {  /* the walk */
        int n = last + 1 - j * bs < bs ? last + 1 - j * bs : bs;
        const float *kb, *vb; int64_t st[4];
        if (fetch_block(c, b, j, h, n, D, kbuf, vbuf, &kb, &vb, st)) return 1;
        for (int r = 0; r < R; r++) {
            int see = pos[r] + 1 - j * bs;                    /* causal: this row's keys in the block */
            if (see <= 0) continue;
            see = see < n ? see : n;
            int from = W ? pos[r] + 1 - c->window - j * bs : 0;  /* window: its first key in the block */
            from = from > 0 ? from : 0;
            if (W && from >= see) continue;
            see -= from;                                      /* the keys it sees, from key `from` on */
            const float *qr = qs[r], *kp = kb + kvh[r] * st[1] + from * st[0];
            const float *vp = vb + kvh[r] * st[3] + from * st[2];
            int64_t ks = st[0];
            int t = 0;
            for (; t + 4 <= see; t += 4) {                    /* scores, four keys at a time */
                const float *k0 = kp + t * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
                #pragma omp simd reduction(+:d0, d1, d2, d3)
                for (int d = 0; d < D; d++) {
                    d0 += qr[d] * k0[d]; d1 += qr[d] * k1[d]; d2 += qr[d] * k2[d]; d3 += qr[d] * k3[d];
                }
                s[t] = d0; s[t + 1] = d1; s[t + 2] = d2; s[t + 3] = d3;
            }
            for (; t < see; t++) {                            /* and the last few one by one */
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int d = 0; d < D; d++) dot += qr[d] * kp[t * ks + d];
                s[t] = dot;
            }
            float top = m[r], sum = 0.0f;
            for (t = 0; t < see; t++) top = s[t] > top ? s[t] : top;
            #pragma omp simd reduction(+:sum)
            for (t = 0; t < see; t++) { s[t] = exp_neg(s[t] - top); sum += s[t]; }
            float fix = exp_neg(m[r] - top);                  /* online softmax: rescale what came before */
            l[r] = l[r] * fix + sum;
            m[r] = top;
            add_pv(acc[r], fix, s, 1, see, vp, st[2], D);
        }
    }
    for (int r = 0; r < R; r++)
        for (int d = 0; d < D; d++) c->out[row_at(c, q0, row_of(c, h, r0 + r), D) + d] = acc[r][d] / l[r];
    return 0;
}

/* A work item of many rows of one KV head h (a prompt chunk's tile), as attend_rows computes them. Its
   queries transposed once, qT [D, ROWS], each key's scores for every row come from one multiply-add per
   element of the key, along the rows; s[t][r] holds scores, then probabilities (0 where a row must not
   see key t: row r sees keys from[r] <= t < see[r] of the block). */
INLINE int attend_tile(const Call *c, int b, int h, int r0, int r1, const int D, const int W, float *kbuf,
                       float *vbuf) {
    float acc[ROWS][D], qT[D][ROWS], s[c->block_size][ROWS], m[ROWS], l[ROWS], top[ROWS], sum[ROWS];
    int see[ROWS], from[ROWS], R = r1 - r0, bs = c->block_size, q0 = c->qsl[b];
    int context = c->seq_lens[b] - (c->qsl[b + 1] - q0);
    for (int r = 0; r < ROWS; r++) {           /* rows past R: zero queries that see nothing */
        const float *qr = c->q + row_at(c, q0, row_of(c, h, r0 + (r < R ? r : 0)), D);
        for (int d = 0; d < D; d++) { qT[d][r] = r < R ? qr[d] * c->scale : 0.0f; acc[r][d] = 0.0f; }
        m[r] = -FLT_MAX; l[r] = 0.0f;
    }
    int first = context + row_of(c, h, r0).token, last = context + row_of(c, h, r1 - 1).token;
    for (int j = first_block(c, first, W); j <= last / bs; j++) {
        int n = last + 1 - j * bs < bs ? last + 1 - j * bs : bs;
        const float *kp, *vp; int64_t st[4];
        if (fetch_block(c, b, j, h, n, D, kbuf, vbuf, &kp, &vp, st)) return 1;
        int t0 = W ? first + 1 - c->window - j * bs : 0;      /* window: the block's first key any row sees */
        t0 = t0 > 0 ? t0 : 0;
        for (int r = 0; r < ROWS; r++) {
            int v = r < R ? context + row_of(c, h, r0 + r).token + 1 - j * bs : 0;
            see[r] = v < 0 ? 0 : v > n ? n : v;
            int f = W ? v - c->window : 0;
            from[r] = f < 0 ? 0 : f > see[r] ? see[r] : f;
            top[r] = m[r]; sum[r] = 0.0f;
        }
        for (int t = t0; t < n; t++) {                        /* scores: key t against every row */
            float sc[ROWS] = {0};
            for (int d = 0; d < D; d++)
                #pragma omp simd
                for (int r = 0; r < ROWS; r++) sc[r] += qT[d][r] * kp[t * st[0] + d];
            #pragma omp simd
            for (int r = 0; r < ROWS; r++) {
                s[t][r] = sc[r];
                top[r] = t < see[r] && (!W || t >= from[r]) && sc[r] > top[r] ? sc[r] : top[r];
            }
        }
        for (int t = t0; t < n; t++)                          /* probabilities: exactly 0 where unseen */
            #pragma omp simd
            for (int r = 0; r < ROWS; r++) {
                s[t][r] = t < see[r] && (!W || t >= from[r]) ? exp_neg(s[t][r] - top[r]) : 0.0f;
                sum[r] += s[t][r];
            }
        for (int r = 0; r < R; r++) {
            float fix = exp_neg(m[r] - top[r]);
            l[r] = l[r] * fix + sum[r];
            m[r] = top[r];
            if (see[r] > from[r])      /* V from the row's first key on: keys before it are never weighed */
                add_pv(acc[r], fix, &s[from[r]][r], ROWS, see[r] - from[r], vp + from[r] * st[2], st[2], D);
        }
    }
    for (int r = 0; r < R; r++)
        for (int d = 0; d < D; d++) c->out[row_at(c, q0, row_of(c, h, r0 + r), D) + d] = acc[r][d] / l[r];
    return 0;
}

/* Either loop, compiled once per common head_dim and once for any other (up to 256), each with and
   without a window */
INLINE int attend_item(const Call *c, int b, int h, int r0, int r1, const int D, float *kb, float *vb) {
    int tile = h >= 0 && r1 - r0 > ROWS / 2;
    if (c->window)
        return tile ? attend_tile(c, b, h, r0, r1, D, 1, kb, vb) : attend_rows(c, b, h, r0, r1, D, 1, kb, vb);
    return tile ? attend_tile(c, b, h, r0, r1, D, 0, kb, vb) : attend_rows(c, b, h, r0, r1, D, 0, kb, vb);
}
typedef int (*Item)(const Call *, int, int, int, int, int, float *, float *);
#define ITEM_FOR(D) static int item_##D(const Call *c, int b, int h, int r0, int r1, int dim, float *kb, \
                                        float *vb) { (void)dim; return attend_item(c, b, h, r0, r1, D, kb, vb); }
ITEM_FOR(32)
ITEM_FOR(64)
ITEM_FOR(128)
static int item_any(const Call *c, int b, int h, int r0, int r1, int dim, float *kb, float *vb) {
    return attend_item(c, b, h, r0, r1, dim, kb, vb);
}

/* How sequence b is cut into work items: a sequence with few rows per KV head (a decode's group) into
   items of every head (whole blocks read in memory order), tiles of ROWS rows; any other into items of one
   KV head, tiles of ROWS rows each. Sets the item's KV head (-1: every head) and rows, given its index i
   among the sequence's items; returns the sequence's item count. */
INLINE int64_t cut(const Call *c, int b, int64_t i, int *h, int *r0, int *r1) {
    int64_t rows = (int64_t)(c->qsl[b + 1] - c->qsl[b]) * c->group;  /* per KV head */
    int every = rows <= ROWS / 2;
    int64_t width = every ? rows * c->kv_heads : rows, tiles = (width + ROWS - 1) / ROWS;
    *h = every ? -1 : (int)(i / tiles);
    *r0 = (int)(i % tiles) * ROWS;
    *r1 = *r0 + ROWS < width ? *r0 + ROWS : (int)width;
    return every ? tiles : tiles * c->kv_heads;
}

/* Attention for every query row of a step: q [T, q_heads, head_dim] float32 (pagedlib's varlen layout,
   query_start_loc's rows), out the same, the work items shared by `threads` threads; window > 0: a
   sliding window (0: full causal attention). Returns 0; -1 if memory ran out; 1 if a block table names a
   block outside the pool where a row's keys lie (nothing is read there; out is then incomplete). */
int paged_attention_varlen_cpu(const float *q, float *out, const Pool *k, const Pool *v,
                               const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                               const int32_t *qsl, int batch, int q_heads, int kv_heads, int head_dim,
                               int block_size, int num_blocks, float scale, int threads, int window) {
    Call c = { q, out, *k, *v, tables, table_stride, seq_lens, qsl, q_heads, kv_heads, q_heads / kv_heads,
               block_size, num_blocks, window, scale };
    Item item = head_dim == 32 ? item_32 : head_dim == 64 ? item_64 : head_dim == 128 ? item_128 : item_any;
    int64_t *first = malloc(sizeof(int64_t) * (batch + 1));       /* sequence b's first work item */
    if (!first) return -1;
    first[0] = 0;
    for (int b = 0; b < batch; b++) { int h, r0, r1; first[b + 1] = first[b] + cut(&c, b, 0, &h, &r0, &r1); }
    int status = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *buf = malloc(sizeof(float) * 2 * block_size * kv_heads * head_dim);  /* widened K and V */
        #pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < first[batch]; i++) {
            int b = 0, hi = batch - 1, h, r0, r1, err = -1;  /* the sequence whose items hold item i */
            while (b < hi) { int mid = (b + hi + 1) / 2; if (first[mid] <= i) b = mid; else hi = mid - 1; }
            cut(&c, b, i - first[b], &h, &r0, &r1);
            if (buf) err = item(&c, b, h, r0, r1, head_dim, buf, buf + (int64_t)block_size * kv_heads * head_dim);
            if (err) {
                #pragma omp atomic write
                status = err;
            }
        }
        free(buf);
    }
    free(first);
    return status;
}
