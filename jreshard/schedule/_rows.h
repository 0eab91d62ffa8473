/* The byte rows of a descriptor table (jreshard.schedule.kernels), shared by the compiled kernels that run
 * them: jreshard/schedule/_rows.c (one table a call) and jreshard/engine/_replay.c (a prepared schedule's
 * tables, a whole refit a call). row_ok checks one row against the sizes of the buffers it names;
 * copy_row moves the bytes of a row row_ok accepted; cast_row_ok and cast_row do the same for the float32 <->
 * bfloat16 cast rows. Sizes come from the buffers, never from the table.
 */
#ifndef JRESHARD_ROWS_H
#define JRESHARD_ROWS_H
#include <stdint.h>
#include <string.h>

#include "../_bf16.h"
#include "../_stream.h"

/* kernels.py's columns; jreshard.schedule.kernels checks they agree before using this module. */
#define MAX_DIMS 8
#define C_BUF 0
#define C_OFF 1
#define C_STAGE 2
#define C_NBYTES 3
#define C_NDIM 4
#define C_SHAPE0 5
#define C_STRIDE0 (C_SHAPE0 + MAX_DIMS)
#define C_CAST (C_STRIDE0 + MAX_DIMS)
#define COLUMNS (C_CAST + 1)

#define STREAM_MIN (1 << 20)
#define STREAM_RUN 256

/* Whether row r is a byte row that lies inside its buffer and inside staging. */
static inline int row_ok(const int64_t *r, const int64_t *addresses, const int64_t *sizes, int64_t buffers,
                  int64_t staging_size) {
    int64_t b = r[C_BUF], nd = r[C_NDIM];
    if (r[C_CAST] != 0 || b < 0 || b >= buffers || addresses[b] == 0 || nd < 1 || nd > MAX_DIMS) {
        return 0;
    }
    if (r[C_STRIDE0 + nd - 1] != 1 || r[C_OFF] < 0 || r[C_STAGE] < 0) {
        return 0;
    }
    int64_t count = 1, last = r[C_OFF];
    for (int64_t d = 0; d < nd; d++) {
        int64_t n = r[C_SHAPE0 + d], stride = r[C_STRIDE0 + d], span;
        if (n < 0 || stride < 0 || __builtin_mul_overflow(count, n, &count)) {
            return 0;
        }
        if (n > 0 && (__builtin_mul_overflow(n - 1, stride, &span) || __builtin_add_overflow(last, span, &last))) {
            return 0;
        }
    }
    if (count != r[C_NBYTES]) {
        return 0;
    }
    if (count == 0) {
        return 1;
    }
    int64_t stage_end;
    if (last >= sizes[b] || __builtin_add_overflow(r[C_STAGE], count, &stage_end) || stage_end > staging_size) {
        return 0;
    }
    return 1;
}

/* Copy one row that row_ok accepted. */
static inline void copy_row(const int64_t *r, const int64_t *addresses, char *staging, int unpack, int stream) {
    int64_t nd = r[C_NDIM];
    if (r[C_NBYTES] == 0) {
        return;
    }
    char *base = (char *)(uintptr_t)addresses[r[C_BUF]] + r[C_OFF];
    char *stage = staging + r[C_STAGE];
    int64_t run = r[C_SHAPE0 + nd - 1];
    int64_t inner = nd >= 2 ? r[C_SHAPE0 + nd - 2] : 1, inner_stride = nd >= 2 ? r[C_STRIDE0 + nd - 2] : 0;
    int fast = stream && run >= STREAM_RUN;
    int64_t idx[MAX_DIMS] = {0};
    int64_t outer = 1;
    for (int64_t d = 0; d + 2 < nd; d++) {
        outer *= r[C_SHAPE0 + d];
    }
    for (int64_t o = 0; o < outer; o++) {
        char *at = base;
        for (int64_t d = 0; d + 2 < nd; d++) {
            at += idx[d] * r[C_STRIDE0 + d];
        }
        for (int64_t i = 0; i < inner; i++, at += inner_stride, stage += run) {
            char *dst = unpack ? at : stage;
            const char *src = unpack ? stage : at;
            if (fast) {
                stream_copy(dst, src, (size_t)run);
            } else {
                memcpy(dst, src, (size_t)run);
            }
        }
        for (int64_t d = nd - 3; d >= 0; d--) {
            if (++idx[d] < r[C_SHAPE0 + d]) {
                break;
            }
            idx[d] = 0;
        }
    }
}

/* Cast rows (kernels.py's CAST column, here only the two casts a view's rows make on the way to and from the
 * wire): a pack row reads float32 elements from its buffer (SHAPE counts elements, STRIDE is in bytes) and stages
 * them as bfloat16, back to back; an unpack row reads bfloat16 from staging and writes float32 into its buffer.
 * NBYTES is what the row takes in staging (2 bytes an element). The codes are kernels.chain_code's, which
 * jreshard.schedule.kernels checks against CAST_F32_BF16 and CAST_BF16_F32 before it hands this module a cast
 * row. Unaligned elements are read and written through memcpy. */
#define CAST_F32_BF16 33 /* chain_code(("float32", "bfloat16")): a pack row */
#define CAST_BF16_F32 18 /* chain_code(("bfloat16", "float32")): an unpack row */

/* Whether row r is a cast row of this direction that lies inside its buffer and inside staging. */
static inline int cast_row_ok(const int64_t *r, const int64_t *addresses, const int64_t *sizes, int64_t buffers,
                       int64_t staging_size, int unpack) {
    int64_t b = r[C_BUF], nd = r[C_NDIM];
    if (r[C_CAST] != (unpack ? CAST_BF16_F32 : CAST_F32_BF16) || b < 0 || b >= buffers || addresses[b] == 0 ||
        nd < 1 || nd > MAX_DIMS || r[C_OFF] < 0 || r[C_STAGE] < 0) {
        return 0;
    }
    int64_t count = 1, last = r[C_OFF], span, staged, end, stage_end;
    for (int64_t d = 0; d < nd; d++) {
        int64_t n = r[C_SHAPE0 + d], stride = r[C_STRIDE0 + d];
        if (n < 0 || stride < 0 || __builtin_mul_overflow(count, n, &count)) {
            return 0;
        }
        if (n > 0 && (__builtin_mul_overflow(n - 1, stride, &span) || __builtin_add_overflow(last, span, &last))) {
            return 0;
        }
    }
    if (__builtin_mul_overflow(count, 2, &staged) || staged != r[C_NBYTES]) {
        return 0;
    }
    if (count == 0) {
        return 1;
    }
    if (__builtin_add_overflow(last, 4, &end) || end > sizes[b] || __builtin_add_overflow(r[C_STAGE], staged, &stage_end) ||
        stage_end > staging_size) {
        return 0;
    }
    return 1;
}

/* One run of n elements, ``stride`` bytes apart in the buffer, back to back in staging. Inlined twice into each
 * clone below: with the stride of contiguous float32 (a constant the compiler vectorises) and with any other. */
static inline __attribute__((always_inline)) void cast_run(char *buf, int64_t stride, char *stage, int64_t n,
                                                           int unpack) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        uint16_t h;
        if (unpack) {
            memcpy(&h, stage + 2 * i, 2);
            u = f32_bits_of_bf16(h);
            memcpy(buf + i * stride, &u, 4);
        } else {
            memcpy(&u, buf + i * stride, 4);
            h = bf16_of_f32_bits(u);
            memcpy(stage + 2 * i, &h, 2);
        }
    }
}

JRESHARD_CLONES
static void f32_to_bf16_run(const char *src, int64_t stride, char *dst, int64_t n) {
    stride == 4 ? cast_run((char *)src, 4, dst, n, 0) : cast_run((char *)src, stride, dst, n, 0);
}

JRESHARD_CLONES
static void bf16_to_f32_run(const char *src, char *dst, int64_t stride, int64_t n) {
    stride == 4 ? cast_run(dst, 4, (char *)src, n, 1) : cast_run(dst, stride, (char *)src, n, 1);
}

#define CAST_CHUNK 2048 /* elements a pack casts into the first level cache before it streams them out */

/* A pack's run: cast into the cache, then streamed to staging (no read-for-ownership of the lines it writes). */
static inline void f32_to_bf16_streamed(const char *src, int64_t stride, char *dst, int64_t n) {
    uint16_t scratch[CAST_CHUNK];
    for (int64_t i = 0; i < n; i += CAST_CHUNK) {
        int64_t m = n - i < CAST_CHUNK ? n - i : CAST_CHUNK;
        f32_to_bf16_run(src + i * stride, stride, (char *)scratch, m);
        stream_copy(dst + 2 * i, (const char *)scratch, (size_t)(2 * m));
    }
}

/* Cast one row that cast_row_ok accepted: its innermost extent is a run of elements STRIDE bytes apart in the
 * buffer, back to back in staging; the outer extents are walked in C order. With ``stream`` (a call that moves
 * STREAM_MIN bytes or more) a pack's runs of STREAM_RUN staged bytes or more are streamed to staging. */
static inline void cast_row(const int64_t *r, const int64_t *addresses, char *staging, int unpack, int stream) {
    int64_t nd = r[C_NDIM];
    if (r[C_NBYTES] == 0) {
        return;
    }
    char *base = (char *)(uintptr_t)addresses[r[C_BUF]] + r[C_OFF];
    char *stage = staging + r[C_STAGE];
    int64_t run = r[C_SHAPE0 + nd - 1], stride = r[C_STRIDE0 + nd - 1], outer = 1;
    int64_t idx[MAX_DIMS] = {0};
    for (int64_t d = 0; d + 1 < nd; d++) {
        outer *= r[C_SHAPE0 + d];
    }
    for (int64_t o = 0; o < outer; o++, stage += 2 * run) {
        char *at = base;
        for (int64_t d = 0; d + 1 < nd; d++) {
            at += idx[d] * r[C_STRIDE0 + d];
        }
        if (unpack) {
            bf16_to_f32_run(stage, at, stride, run);
        } else if (stream && 2 * run >= STREAM_RUN) {
            f32_to_bf16_streamed(at, stride, stage, run);
        } else {
            f32_to_bf16_run(at, stride, stage, run);
        }
        for (int64_t d = nd - 2; d >= 0; d--) {
            if (++idx[d] < r[C_SHAPE0 + d]) {
                break;
            }
            idx[d] = 0;
        }
    }
}

#endif
