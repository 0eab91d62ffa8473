/* Non-temporal copies for jreshard's compiled kernels (jreshard/views/_casts.c,
 * jreshard/schedule/_rows.c): a copy into memory nobody reads soon (a destination shard,
 * a staging arena the transport reads after the whole round is packed) is written
 * with streaming stores, so its cache lines are not read from memory first (no
 * read-for-ownership) and do not push the reader's working set out of the caches.
 * STREAM_FENCE() orders the streaming stores before whatever follows (the copy's
 * bytes are visible to another thread or process once it returns).
 * Elsewhere than x86-64 with GCC or clang both are a plain memcpy.
 */
#ifndef JRESHARD_STREAM_H
#define JRESHARD_STREAM_H
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <emmintrin.h>
/* Copy n bytes with non-temporal 16-byte stores (SSE2, every x86-64 has them): the
 * destination lines are written without being read first, as a large memcpy does. */
static inline void stream_copy(char *dst, const char *src, size_t n) {
    if (n < 256) {
        memcpy(dst, src, n);
        return;
    }
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    for (; n >= 16; n -= 16, dst += 16, src += 16) {
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
    }
    memcpy(dst, src, n);
}
#define STREAM_FENCE() _mm_sfence()
#else
#define stream_copy memcpy
#define STREAM_FENCE() ((void)0)
#endif

#endif
