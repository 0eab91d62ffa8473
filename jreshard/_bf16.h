/* float32 <-> bfloat16 on bit patterns, bit-exact with jnp.astype (and ml_dtypes), shared by jreshard's compiled
 * kernels (jreshard/views/_casts.c, jreshard/schedule/_rows.h): float32 -> bfloat16 rounds to nearest even,
 * overflows to inf, keeps subnormals, and turns every NaN into the quiet NaN 0x7fc0 with the sign kept;
 * bfloat16 -> float32 is exact (the bits shifted up, NaN payloads kept).
 */
#ifndef JRESHARD_BF16_H
#define JRESHARD_BF16_H
#include <stdint.h>

static inline uint16_t bf16_of_f32_bits(uint32_t u) {
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = ((u >> 16) & 0x8000u) | 0x7FC0u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

static inline uint32_t f32_bits_of_bf16(uint16_t h) { return (uint32_t)h << 16; }

#endif
