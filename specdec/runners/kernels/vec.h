// 16-float vectors in GCC's vector extensions: one AVX-512 register, two AVX2 ones, so the same
// source compiles to either under -march=native.
#pragma once
#include <cstdint>

typedef float vec __attribute__((vector_size(64)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));
typedef int32_t ivec __attribute__((vector_size(64)));

#ifdef __AVX512F__
constexpr int kRegisters = 32;  // vec-sized registers the compiler can keep accumulators in
#else
constexpr int kRegisters = 8;
#endif

static inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

static inline void store(float* p, vec v) { __builtin_memcpy(p, &v, sizeof v); }

static inline vec8 load8(const float* p) {
  vec8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// A tree of shuffles: indexing lanes would give the accumulators an address and keep them in memory.
static inline float lane_sum(vec v) {
  vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vec4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Lane sums of 16 vectors at once, in four levels: lane u of the last is lane_sum(v_u), the same additions in the
// same tree, bit for bit, in 45 shuffles and adds instead of 16 x 7. Each level halves the lanes that hold one
// vector's partial sums and packs two inputs' halves into one output: level 1 takes v_2i and v_2i+1 (16 lanes of
// one vector each) to 8 lanes of each; level 2, 8 lanes of two vectors each to 4 of four; and so on.
static inline vec sums_level1(vec x, vec y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline vec sums_level2(vec x, vec y) {
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
static inline vec sums_level3(vec x, vec y) {
  return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
static inline vec sums_level4(vec x, vec y) {
  return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline float lane_max(vec v) {
  float m = v[0];
  for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
  return m;
}

// e^x for x <= 0 (a softmax's shifted scores): 2^k e^r with |r| <= ln2 / 2, e^r by Cephes' degree-6
// polynomial, within about 2 ulp of expf; below -87 it gives e^-87 (~1.6e-38) where expf would give less.
static inline vec exp_nonpositive(vec x) {
  const vec floor = vec{} - 87.0f;
  x = x < floor ? floor : x;
  const vec magic = vec{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vec k = (x * 1.44269504088896341f + magic) - magic;
  const vec r = x - k * 0.693359375f + k * 2.12194440e-4f;  // x - k ln2, ln2 in two parts
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec bits = (__builtin_convertvector(k, ivec) + 127) << 23;  // 2^k
  vec scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
