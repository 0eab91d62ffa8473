/* float32 <-> bfloat16 on bit patterns, bit-exact with jnp.astype (and ml_dtypes), shared by jreshard's compiled
 * kernels (jreshard/views/_casts.c, jreshard/schedule/_rows.h): float32 -> bfloat16 rounds to nearest even,
 * overflows to inf, keeps subnormals, and turns every NaN into the quiet NaN 0x7fc0 with the sign kept;
 * bfloat16 -> float32 is exact (the bits shifted up, NaN payloads kept).
 */
#ifndef JRESHARD_BF16_H
#define JRESHARD_BF16_H
#include <stdint.h>

/* The cast loops are plain C that compilers vectorise; on x86-64 with GCC or clang an AVX-512 or AVX2 clone is
 * chosen at load time when the CPU has it, so the build needs no -march flag and runs on any x86-64. */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define JRESHARD_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif
#endif
#ifndef JRESHARD_CLONES
#define JRESHARD_CLONES
#endif

static inline uint16_t bf16_of_f32_bits(uint32_t u) {
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = ((u >> 16) & 0x8000u) | 0x7FC0u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

static inline uint32_t f32_bits_of_bf16(uint16_t h) { return (uint32_t)h << 16; }

#endif
