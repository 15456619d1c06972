// y = x @ w^T for a few rows of x: [M, K] x [N, K] -> [M, N], float32 x and y, row-major, on CPU; w in
// float32 (few_rows) or in int8 with one scale per row (few_rows_int8).
//
// A step or a verify pass multiplies 1 to ~9 rows by every weight matrix, so its cost is reading the
// weights once from memory. BLAS GEMMs switch kernels as M grows and lose that roof at a few rows (on
// an AVX-512 Xeon MKL takes 20 ms over the target's matrices at 1-3 rows, 35-48 ms at 4-9). Here each
// weight row is read once and multiplied into all M rows while it is in registers: R output rows at a
// time share each load of x, and rows further on are prefetched a cache line per step, so the stream
// from memory never waits on the arithmetic. Same products as F.linear, summed in another order.
//
// int8 weights (the draft's): each weight row is widened to float in registers and its scale applied to
// the sum, so x stays float32 and each row's result depends on that row alone (fbgemm's dynamic int8
// product quantizes x on one grid per pass). A draft's step reads its weights cold, since the target's
// pass between two rounds streams half a gigabyte through the caches: a quarter of the bytes of float32,
// prefetched further ahead than the short rows of a small model would reach one block at a time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <immintrin.h>

#include "vec.h"

static inline vec load_weights(const float* p) { return load(p); }

// 16 bytes -> 16 floats, unsigned when U, else signed: two instructions on AVX-512. GCC's
// __builtin_convertvector from 16 int8 lanes compiles to 16 scalar conversions, 8x slower, so this is written
// in intrinsics.
template <bool U>
static inline vec widen16(__m128i b) {
  vec v;
#ifdef __AVX512F__
  const __m512 f = _mm512_cvtepi32_ps(U ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b));
  __builtin_memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
  const __m128i b1 = _mm_srli_si128(b, 8);
  const __m256 lo = _mm256_cvtepi32_ps(U ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(U ? _mm256_cvtepu8_epi32(b1) : _mm256_cvtepi8_epi32(b1));
  __builtin_memcpy(&v, &lo, sizeof lo);
  __builtin_memcpy((char*)&v + sizeof lo, &hi, sizeof hi);
#else
  uint8_t q[16];
  _mm_storeu_si128((__m128i*)q, b);
  for (int i = 0; i < 16; i++) v[i] = U ? (float)q[i] : (float)(int8_t)q[i];
#endif
  return v;
}

static inline vec load_weights(const int8_t* p) { return widen16<false>(_mm_loadu_si128((const __m128i*)p)); }

// Output rows n..n+R-1. w rows are K apart (an int8 row is padded to a multiple of 16, and so is x);
// rows `ahead` further on are prefetched, one cache line per line read; scale: one per row, or null.
template <int M, int R, typename W>
static inline void block(const float* __restrict x, const W* __restrict w, const float* __restrict scale,
                         float* __restrict y, int64_t K, int64_t N, int64_t n, int64_t ahead, int64_t prefetch_end) {
  vec acc[R][M];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) acc[r][m] = vec{};
  const int64_t K16 = K - K % 16;
  for (int64_t k = 0; k < K16; k += 16) {
    vec wv[R];
    for (int r = 0; r < R; r++) wv[r] = load_weights(w + (n + r) * K + k);
    if ((k * sizeof(W)) % 64 == 0)
      for (int r = 0; r < R; r++)
        if (n + ahead + r < prefetch_end) __builtin_prefetch(w + (n + ahead + r) * K + k, 0, 3);
    for (int m = 0; m < M; m++) {
      vec xv = load(x + m * K + k);
      for (int r = 0; r < R; r++) acc[r][m] += xv * wv[r];
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) {
      float s = lane_sum(acc[r][m]);
      for (int64_t k = K16; k < K; k++) s += x[m * K + k] * w[(n + r) * K + k];
      y[m * N + n + r] = scale ? s * scale[n + r] : s;
    }
}

// ahead_bytes: how far ahead to prefetch, at least the next block of rows; rows up to prefetch_end may be prefetched.
template <int M, typename W>
static void rows(const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N, int64_t begin,
                 int64_t end, int64_t prefetch_end, int64_t ahead_bytes) {
  constexpr int fit = (kRegisters - 1) / (M + 1);  // R * M accumulators, R weight vectors, one of x
  constexpr int R = fit < 1 ? 1 : fit > 4 ? 4 : fit;
  const int64_t ahead = std::max<int64_t>(1, ahead_bytes / (R * K * (int64_t)sizeof(W))) * R;
  int64_t n = begin;
  for (; n + R <= end; n += R) block<M, R>(x, w, scale, y, K, N, n, ahead, prefetch_end);
  for (; n < end; n++) block<M, 1>(x, w, scale, y, K, N, n, ahead, prefetch_end);
}

// Rows of x a sweep multiplies at once. Each needs R accumulators, so past 8 rows R falls to 1-2 and every FMA
// waits on a load of x: the embedded target's pass took 17.5 ms at 8 rows and 44.8 at 16 (Zen 4 VM). More rows
// go in tiles of kTile over a panel of w that stays in cache (kPanelBytes), so w still comes from memory once.
constexpr int64_t kTile = 8;
constexpr int64_t kPanelBytes = 16384;

// The product's rows split over torch's threads by output rows (rows of w). rows_of(std::integral_constant<int, M>,
// x, y, begin, end, limit) computes output rows begin..end-1 of M <= kTile rows of x (x and y moved to the tile's
// first row), prefetching no row at or past limit. Each output is summed in the same order whatever M and the
// tiling: a row's result is the one it gets alone, bit for bit.
template <typename RowsOf>
static void sweep(const torch::Tensor& x, torch::Tensor& y, int64_t N, int64_t w_row_bytes, RowsOf rows_of) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t panel = M <= kTile ? N : std::max<int64_t>(4, kPanelBytes / std::max<int64_t>(1, w_row_bytes) / 4 * 4);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p += panel) {
      const int64_t p_end = std::min(p + panel, end);
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const float* xt = xp + m0 * K;
        float* yt = yp + m0 * N;
        switch (std::min<int64_t>(kTile, M - m0)) {
#define ROWS(m) case m: rows_of(std::integral_constant<int, m>{}, xt, yt, p, p_end, end); break;
          ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
      }
    }
  });
}

torch::Tensor few_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "few_rows: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && x.device().is_cpu() &&
              w.device().is_cpu(), "few_rows: float32 tensors on CPU");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  const float* wp = w.data_ptr<float>();
  const int64_t K = x.size(1), N = w.size(0);
  sweep(x, y, N, K * sizeof(float), [&](auto m, const float* xp, float* yp, int64_t begin, int64_t end, int64_t limit) {
    rows<decltype(m)::value>(xp, wp, nullptr, yp, K, N, begin, end, limit, 0);  // a float row is long enough: one block ahead
  });
  return y;
}

// How far ahead an int8 sweep prefetches. A draft step after a target pass reads its weights cold; in a
// two-process imitation of a round (Zen 5 VM), 16 KB against 4 KB took its first step from 0.69-0.75 to
// 0.60-0.71 ms and the next two from 0.55 to 0.45; 8 KB did half of that, 32 and 64 KB less than 16.
constexpr int64_t kInt8AheadBytes = 16384;

// w: [N, Kp] int8, Kp = K rounded up to 16 with zeros (pack_int8_rows in specdec/lean_llama.py); scale: [N].
torch::Tensor few_rows_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 1 && scale.size(0) == w.size(0),
              "few_rows_int8: x [M, K], w [N, Kp] and scale [N]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kChar &&
              scale.scalar_type() == torch::kFloat && x.device().is_cpu() && w.device().is_cpu() &&
              scale.device().is_cpu(), "few_rows_int8: float32 x, int8 w, float32 scale, on CPU");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "few_rows_int8: contiguous w and scale");
  const int64_t K = x.size(1), Kp = w.size(1);
  TORCH_CHECK(Kp % 16 == 0 && K <= Kp && Kp < K + 16, "few_rows_int8: w's rows must be x's width padded to 16, got ",
              Kp, " for ", K);
  x = K == Kp ? x.contiguous() : torch::constant_pad_nd(x, {0, Kp - K});
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t N = w.size(0);
  sweep(x, y, N, Kp + sizeof(float), [&](auto m, const float* xp, float* yp, int64_t begin, int64_t end, int64_t limit) {
    rows<decltype(m)::value>(xp, wp, sp, yp, Kp, N, begin, end, limit, kInt8AheadBytes);
  });
  return y;
}

// GGUF's block formats: a row of K weights is K / 32 blocks. Each block is widened to 32 floats in registers,
// exactly the values gguf's dequantization gives (d * q is exact in float32, so d * q + m rounds once either
// way), and summed in the order few_rows sums the float32 matrix: the same products, bit for bit, from a
// fifth of the bytes (Q4_1) or a quarter (Q8_0). The scales are kept apart as float32 (a fp16 conversion and
// two broadcasts per block and row cost 25% of a Q4_1 sweep on the Xeon).

// Q4_1: per block, 16 bytes (weight j in the low nibble of byte j, weight j + 16 in its high nibble) and
// two scales, d and m: w = d q + m.
struct Q4_1 {
  static constexpr int64_t kBytes = 16, kScales = 2;
  static inline void load(const uint8_t* q, const float* s, vec& lo, vec& hi) {
#ifdef __AVX512F__
    // A block has 16 possible weights, d q + m for q = 0..15: one register. Each byte widened to a 32-bit lane
    // indexes it by its low 4 bits (vpermps reads no more), so the low nibble needs no mask, the high one a
    // shift: 5 instructions a block instead of 9, and the same weights (one FMA each, as before).
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1]));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    const __m512 l = _mm512_permutexvar_ps(b, table), h = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
    __builtin_memcpy(&lo, &l, sizeof lo);
    __builtin_memcpy(&hi, &h, sizeof hi);
#else
    const __m128i b = _mm_loadu_si128((const __m128i*)q), nibble = _mm_set1_epi8(0x0f);
    lo = widen16<true>(_mm_and_si128(b, nibble)) * s[0] + s[1];
    hi = widen16<true>(_mm_and_si128(_mm_srli_epi16(b, 4), nibble)) * s[0] + s[1];
#endif
  }
};

// Q8_0: per block, 32 int8 weights and one scale d: w = d q.
struct Q8_0 {
  static constexpr int64_t kBytes = 32, kScales = 1;
  static inline void load(const uint8_t* q, const float* s, vec& lo, vec& hi) {
    lo = widen16<false>(_mm_loadu_si128((const __m128i*)q)) * s[0];
    hi = widen16<false>(_mm_loadu_si128((const __m128i*)(q + 16))) * s[0];
  }
};

// How far ahead a sweep prefetches, in groups of R rows: both streams, the blocks' bytes and their scales. The
// hardware's prefetcher follows the bytes only part of the way and the scales hardly at all, so a sweep that
// prefetched only the next group's bytes waited on memory at every group: on the Zen 5 VM (2 threads, 60 GB/s)
// the target's 120 layer products from memory took 2.6 ms where the same work in cache takes 1.5. Four groups of
// both (about 4.6 KB of a 576-wide Q4_1 matrix's bytes ahead) took a 1-token pass from 3.7-3.9 to 2.9-3.0 ms and
// a 4-token one from 5.0-5.4 to 4.8-4.9; one group of each, or eight and sixteen, did less (interleaved in one
// process). Compute-bound passes of 8 rows lose 2-4% to the extra prefetches.
constexpr int64_t kAheadGroups = 4;

// Output rows n..n+R-1 of M rows of x; a row is K / 32 blocks of F::kBytes in q and F::kScales floats in s;
// rows kAheadGroups * R further on are prefetched, a cache line of each stream per line read.
template <int M, int R, typename F>
static inline void block_gguf(const float* __restrict x, const uint8_t* __restrict q, const float* __restrict s,
                              float* __restrict y, int64_t K, int64_t N, int64_t n, int64_t end) {
  const int64_t blocks = K / 32, row_bytes = blocks * F::kBytes;
  vec acc[R][M];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) acc[r][m] = vec{};
  for (int64_t b = 0; b < blocks; b++) {
    vec lo[R], hi[R];
    for (int r = 0; r < R; r++)
      F::load(q + (n + r) * row_bytes + b * F::kBytes, s + ((n + r) * blocks + b) * F::kScales, lo[r], hi[r]);
    const int64_t ahead = n + kAheadGroups * R;
    if ((b * F::kBytes) % 64 < F::kBytes)  // once per cache line of q
      for (int r = 0; r < R; r++)
        if (ahead + r < end) __builtin_prefetch(q + (ahead + r) * row_bytes + b * F::kBytes + 64, 0, 3);
    if ((b * F::kScales * sizeof(float)) % 64 < F::kScales * sizeof(float))  // once per cache line of s
      for (int r = 0; r < R; r++)
        if (ahead + r < end) __builtin_prefetch(s + ((ahead + r) * blocks + b) * F::kScales + 16, 0, 3);
    for (int m = 0; m < M; m++) {
      const vec x0 = load(x + m * K + b * 32), x1 = load(x + m * K + b * 32 + 16);
      for (int r = 0; r < R; r++) acc[r][m] += x0 * lo[r];
      for (int r = 0; r < R; r++) acc[r][m] += x1 * hi[r];
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) y[m * N + n + r] = lane_sum(acc[r][m]);
}

template <int M, typename F>
static void rows_gguf(const float* x, const uint8_t* q, const float* s, float* y, int64_t K, int64_t N,
                      int64_t begin, int64_t end, int64_t limit) {
  constexpr int fit = (kRegisters - 2) / (M + 2);  // R * M accumulators, 2 R weight vectors, two of x
  constexpr int R = fit < 1 ? 1 : fit > 4 ? 4 : fit;
  int64_t n = begin;
  for (; n + R <= end; n += R) block_gguf<M, R, F>(x, q, s, y, K, N, n, limit);
  for (; n < end; n++) block_gguf<M, 1, F>(x, q, s, y, K, N, n, limit);
}

// A GGUF tensor's blocks split in two (specdec/gguf_blocks.py): q [N, K / 32 * bytes] uint8, the quantized
// weights, and scales [N, K / 32 * scales] float32, the blocks' fp16 scales widened (exactly) to float32.
torch::Tensor few_rows_gguf(torch::Tensor x, torch::Tensor q, torch::Tensor scales, const std::string& format) {
  TORCH_CHECK(format == "Q4_1" || format == "Q8_0", "few_rows_gguf: format Q4_1 or Q8_0, not ", format);
  const bool q4 = format == "Q4_1";
  const int64_t bytes = q4 ? Q4_1::kBytes : Q8_0::kBytes, per_block = q4 ? Q4_1::kScales : Q8_0::kScales;
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scales.dim() == 2 && x.scalar_type() == torch::kFloat &&
              q.scalar_type() == torch::kByte && scales.scalar_type() == torch::kFloat && x.device().is_cpu() &&
              q.device().is_cpu() && scales.device().is_cpu() && q.is_contiguous() && scales.is_contiguous(),
              "few_rows_gguf: float32 x [M, K], contiguous uint8 q and float32 scales, on CPU");
  const int64_t K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % 32 == 0 && q.size(1) == K / 32 * bytes && scales.size(0) == N &&
              scales.size(1) == K / 32 * per_block, "few_rows_gguf: ", format, " blocks of ", q.size(1), " bytes and ",
              scales.size(1), " scales a row do not hold x's width ", K);
  x = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  sweep(x, y, N, K / 32 * (bytes + per_block * sizeof(float)),
        [&](auto m, const float* xp, float* yp, int64_t begin, int64_t end, int64_t limit) {
    constexpr int M = decltype(m)::value;
    if (q4) rows_gguf<M, Q4_1>(xp, qp, sp, yp, K, N, begin, end, limit);
    else rows_gguf<M, Q8_0>(xp, qp, sp, yp, K, N, begin, end, limit);
  });
  return y;
}
