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
// polynomial, within about 2 ulp of expf; below -87 it gives e^-87 (~1.6e-38) where expf would give less. V: a float
// vector, I: the int32 vector of its lanes.
template <class V, class I>
static inline V exp_nonpositive(V x) {
  const V floor = V{} - 87.0f;
  x = x < floor ? floor : x;
  const V magic = V{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const V k = (x * 1.44269504088896341f + magic) - magic;
  const V r = x - k * 0.693359375f + k * 2.12194440e-4f;  // x - k ln2, ln2 in two parts
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(k, I) + 127) << 23;  // 2^k
  V scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Sixteen floats in the registers a CPU compares them in: one AVX-512 register, else two 8-float halves (AVX2's).
// Without AVX-512, GCC lowers a comparison or a select of 16-float vectors lane by lane, through the stack: a sampled
// row's distribution over 49,152 tokens took 450 us on an AVX2 CPU, and a softmax's max and exp in attention paid it
// too. Code that compares or selects goes through these; each lane's arithmetic is the same either way, and
// lane_sum and lane_max reduce in vec's order, so the bits are those of vec.
typedef int32_t ivec8 __attribute__((vector_size(32)));
#ifdef __AVX512F__
struct f16 {
  vec v;
};
struct m16 {
  ivec v;
};
template <class R, class A, class B, class F>
static inline R each(A a, B b, F f) {
  return R{f(a.v, b.v)};
}
static inline f16 load16(const float* p) { return {load(p)}; }
static inline void store16(float* p, f16 a) { store(p, a.v); }
static inline float lane_sum(f16 a) { return lane_sum(a.v); }
static inline float lane_max(f16 a) { return lane_max(a.v); }
static inline bool any16(m16 m) {
  bool any = false;
  for (int j = 0; j < 16; j++) any |= m.v[j] != 0;
  return any;
}
static inline f16 exp16(f16 a) { return {exp_nonpositive<vec, ivec>(a.v)}; }
static inline f16 splat16(float s) { return {vec{} + s}; }
static inline f16 select16(m16 m, f16 a, f16 b) { return {m.v ? a.v : b.v}; }
#else
struct f16 {
  vec8 lo, hi;
};
struct m16 {
  ivec8 lo, hi;
};
template <class R, class A, class B, class F>
static inline R each(A a, B b, F f) {
  return R{f(a.lo, b.lo), f(a.hi, b.hi)};
}
static inline f16 load16(const float* p) { return {load8(p), load8(p + 8)}; }
static inline void store16(float* p, f16 a) {
  __builtin_memcpy(p, &a.lo, sizeof a.lo);
  __builtin_memcpy(p + 8, &a.hi, sizeof a.hi);
}
static inline float lane_sum(f16 a) {  // lane_sum(vec)'s tree: halves, then quarters, then (0 + 2) + (1 + 3)
  const vec8 h = a.lo + a.hi;
  const vec4 b = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
static inline float lane_max(f16 a) {  // lane_max(vec)'s order
  float m = a.lo[0];
  for (int i = 1; i < 8; i++) m = a.lo[i] > m ? a.lo[i] : m;
  for (int i = 0; i < 8; i++) m = a.hi[i] > m ? a.hi[i] : m;
  return m;
}
static inline bool any16(m16 m) {
  const ivec8 o = m.lo | m.hi;
  uint64_t w[4];
  __builtin_memcpy(w, &o, sizeof w);
  return (w[0] | w[1] | w[2] | w[3]) != 0;
}
static inline f16 exp16(f16 a) { return {exp_nonpositive<vec8, ivec8>(a.lo), exp_nonpositive<vec8, ivec8>(a.hi)}; }
static inline f16 select16(m16 m, f16 a, f16 b) { return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi}; }
static inline f16 splat16(float s) { return {vec8{} + s, vec8{} + s}; }
#endif
static inline f16 operator+(f16 a, f16 b) { return each<f16>(a, b, [](auto x, auto y) { return x + y; }); }
static inline f16 operator-(f16 a, f16 b) { return each<f16>(a, b, [](auto x, auto y) { return x - y; }); }
static inline f16 operator*(f16 a, f16 b) { return each<f16>(a, b, [](auto x, auto y) { return x * y; }); }
static inline f16 operator/(f16 a, f16 b) { return each<f16>(a, b, [](auto x, auto y) { return x / y; }); }
static inline m16 operator>(f16 a, f16 b) { return each<m16>(a, b, [](auto x, auto y) { return x > y; }); }
static inline m16 operator>=(f16 a, f16 b) { return each<m16>(a, b, [](auto x, auto y) { return x >= y; }); }
static inline m16 operator!=(f16 a, f16 b) { return each<m16>(a, b, [](auto x, auto y) { return x != y; }); }
static inline m16 operator&(m16 a, m16 b) { return each<m16>(a, b, [](auto x, auto y) { return x & y; }); }
static inline f16 max16(f16 a, f16 b) { return each<f16>(a, b, [](auto x, auto y) { return x > y ? x : y; }); }
