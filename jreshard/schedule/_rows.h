/* The byte rows of a descriptor table (jreshard.schedule.kernels), shared by the compiled kernels that run
 * them: jreshard/schedule/_rows.c (one table a call) and jreshard/engine/_replay.c (a prepared schedule's
 * tables, a whole refit a call). row_ok checks one row against the sizes of the buffers it names;
 * copy_row moves the bytes of a row row_ok accepted. Sizes come from the buffers, never from the table.
 */
#ifndef JRESHARD_ROWS_H
#define JRESHARD_ROWS_H
#include <stdint.h>
#include <string.h>

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

#endif
