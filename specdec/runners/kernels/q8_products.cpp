// y = x @ w^T with x quantized to 8 bits: [M, K] float32 x, w in blocks of 32 along K, y [M, N] float32.
//
// A row of x is cut into blocks of 32 and each block quantized on its own (quantize_q8: q = round(x * 127 / amax)
// ties to even, d = amax / 127, and the block's integer sum of q), so a row's numbers depend on that row alone.
// Each block of weights is multiplied with it in integers, exactly, and the block's sum joins the row's float32
// result by the same two fused multiply-adds in every instruction-set form:
//   y += float(sum_k qw qx) * (dw * dx)        then, where the weights have a minimum (Q4_1),
//   y += mw * (dx * float(sum_k qx))
// Integer sums have no order, and the float steps are the same, so each output is the same bit for bit whatever
// the rows beside it, the form that ran it, or the thread that did: batch-invariant, and a verify row equals
// the step at its position.
//
// The weights are repacked in tiles of 16 output rows (q8_blocks.py): per tile and block of 32, groups of 4
// consecutive k for all 16 rows, [row][4] bytes, so one 4-byte broadcast of x and one dot-product instruction
// give 16 rows' partial sums, one per 32-bit lane, and a block's scales apply to 16 rows in one FMA, with no
// horizontal sums. Q4_1 keeps its 4 bits: the low nibbles of a group's 64 bytes hold k = 4g..4g+3, the high
// ones k = 16+4g..16+4g+3. Q8_0 (and int8 rows) are signed bytes: the VNNI forms multiply unsigned x + 128 by
// them and take off 128 * sum_k qw (exact, packed beside them); AVX2's maddubs would saturate there, so it
// moves w's sign onto x instead (the sign trick) and multiplies |w|.
//
// With 16-bit activations (bits = 16) a block's q = round(x * 16256 / amax), d = amax / 16256, is split into a
// high and a low byte, q = 128 h + l (h in -127..127, l in -64..63), and each half runs through the same dot
// products as 8-bit x: the integer sum is 128 sum(qw h) + sum(qw l), exact, then the same two float steps.
// Twice the integer work for 128 times finer x: teacher-forced, the embedded target's top-1 agreement with
// float32 x is 97% with 8 bits and over 99.9% with 16 (docs/performance.md).
//
// AMX (Intel's tile units, Sapphire Rapids on) computes the same integer sums of Q8_0 weights for up to 16 rows
// at once: x's bytes of a block as one tile, the block's 16 rows of weights, in the layout above, as another, and
// one tile dot product gives every row's 16 sums. A tile's sums leave through memory and take the same float step,
// so the AMX form equals the others bit for bit. It runs where it pays (amx_rows), the AVX-512 form elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512VNNI__)
#define SPECDEC_AMX 1
#endif

namespace {

constexpr int64_t kBlock = 32, kTileRows = 16, kMaxRows = 8;

// One row's blocks: q [K] int8 (with 16 bits, its high bytes, and lo [K] its low ones), d [K / 32] and the
// integer sums [K / 32].
void quantize_row(const float* x, int64_t K, int bits, int8_t* q, int8_t* lo, float* d, int32_t* s) {
  const float levels = bits == 16 ? 16256.0f : 127.0f;  // 127 * 128: h and l stay in the ranges above
  for (int64_t b = 0; b < K / kBlock; b++) {
    const float* xb = x + b * kBlock;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // the same steps as the loop below, 16 lanes at a time: a max has no order, and cvtps rounds as nearbyint
    // does (to nearest, ties to even, the default rounding mode)
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const __m512 id = _mm512_set1_ps(amax > 0.0f ? levels / amax : 0.0f);
    const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
    if (bits == 16) {
      const __m512i c = _mm512_set1_epi32(64);
      const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(v0, c), 7), h1 = _mm512_srai_epi32(_mm512_add_epi32(v1, c), 7);
      _mm_storeu_si128((__m128i*)(q + b * kBlock), _mm512_cvtepi32_epi8(h0));
      _mm_storeu_si128((__m128i*)(q + b * kBlock + 16), _mm512_cvtepi32_epi8(h1));
      _mm_storeu_si128((__m128i*)(lo + b * kBlock), _mm512_cvtepi32_epi8(_mm512_sub_epi32(v0, _mm512_slli_epi32(h0, 7))));
      _mm_storeu_si128((__m128i*)(lo + b * kBlock + 16), _mm512_cvtepi32_epi8(_mm512_sub_epi32(v1, _mm512_slli_epi32(h1, 7))));
    } else {
      _mm_storeu_si128((__m128i*)(q + b * kBlock), _mm512_cvtepi32_epi8(v0));
      _mm_storeu_si128((__m128i*)(q + b * kBlock + 16), _mm512_cvtepi32_epi8(v1));
    }
    d[b] = amax / levels;
    s[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
#else
    float amax = 0.0f;
    for (int i = 0; i < kBlock; i++) amax = std::fmax(amax, std::fabs(xb[i]));
    const float id = amax > 0.0f ? levels / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; i++) {
      const int32_t v = (int32_t)std::nearbyint(xb[i] * id);  // the default rounding: to nearest, ties to even
      if (bits == 16) {
        const int32_t h = (v + 64) >> 7;  // arithmetic shift: floor
        q[b * kBlock + i] = (int8_t)h;
        lo[b * kBlock + i] = (int8_t)(v - h * 128);
      } else {
        q[b * kBlock + i] = (int8_t)v;
      }
      sum += v;
    }
    d[b] = amax / levels;
    s[b] = sum;
#endif
  }
}

// A pass's rows of x quantized: q (and lo) [M, K], d, s and d * float(s) [M, K / 32]. A product runs 120 times a
// pass on the embedded target, so the buffers are the calling thread's, reused, not tensors allocated each time.
struct Quantized {
  std::vector<int8_t> q, lo;
  std::vector<float> d, ds;
  std::vector<int32_t> s;
};

void quantize_into(const float* x, int64_t M, int64_t K, int bits, Quantized& out) {
  const int64_t blocks = K / kBlock;
  out.q.resize(M * K);
  out.lo.resize(bits == 16 ? M * K : 0);
  out.d.resize(M * blocks);
  out.ds.resize(M * blocks);
  out.s.resize(M * blocks);
  for (int64_t m = 0; m < M; m++) {
    int8_t* lo = bits == 16 ? out.lo.data() + m * K : nullptr;
    quantize_row(x + m * K, K, bits, out.q.data() + m * K, lo, out.d.data() + m * blocks, out.s.data() + m * blocks);
    for (int64_t b = m * blocks; b < (m + 1) * blocks; b++) out.ds[b] = out.d[b] * (float)out.s[b];
  }
}

enum class Format { Q4_1, Q8_0 };
enum class Isa { Amx, Avx512Vnni, AvxVnni, Avx2 };

// What one tile's products read: per block, the weights' bytes, 16 scales (fp16 or float32), and either 16
// minimums (Q4_1) or 16 corrections 128 * sum_k qw (Q8_0).
struct Tile {
  const uint8_t* w;
  const void* d;
  const void* extra;
  bool half;  // scales and minimums as fp16 (a GGUF file's own), else float32
  int64_t w_block_bytes;
};

// Rows x of a tile-row's quantized x, row-major with K / 32 blocks a row.
struct Rows {
  const int8_t* q;
  const int8_t* lo;  // 16-bit x: the low bytes (q the high ones); else null
  const float* d;
  const int32_t* s;
  const float* ds;  // d * float(s): a block's minimum term's factor
  int64_t K;

  Rows from(int64_t m0) const {  // the rows from m0 on
    const int64_t b = m0 * (K / kBlock);
    return {q + m0 * K, lo ? lo + m0 * K : nullptr, d + b, s + b, ds + b, K};
  }
};

constexpr int64_t kAhead = 4;  // blocks a tile's sweep prefetches ahead, in each of its streams

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
inline __m512 scales16(const void* p, bool half, int64_t b) {
  return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + b * 16)))
              : _mm512_loadu_ps((const float*)p + b * 16);
}

// One block of a tile: the 16 rows' integer sums sum_k qw qx for the 32 bytes of x at x4 (exact).
template <Format F>
inline __m512i block_dot512(const __m512i* w, const int32_t* x4, __m512i correction) {
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  __m512i s[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  if (F == Format::Q4_1) {  // unsigned nibbles times signed x
    for (int g = 0; g < 8; g++) s[g % 4] = _mm512_dpbusd_epi32(s[g % 4], w[g], _mm512_set1_epi32(x4[g]));
  } else {  // unsigned x + 128 times signed w, less 128 * sum_k qw
    for (int g = 0; g < 8; g++)
      s[g % 4] = _mm512_dpbusd_epi32(s[g % 4], _mm512_xor_si512(_mm512_set1_epi32(x4[g]), flip), w[g]);
    s[0] = _mm512_sub_epi32(s[0], correction);
  }
  return _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
}

template <int M, Format F, bool Wide>
void tile_avx512(const Rows& x, const Tile& t, float* y, int64_t N, int64_t valid) {
  const int64_t blocks = x.K / kBlock;
  __m512 acc[M];
  for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const int64_t scale_bytes = 16 * (t.half ? 2 : 4);
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* wb = t.w + b * t.w_block_bytes;
    for (int64_t line = 0; line < t.w_block_bytes; line += 64) __builtin_prefetch(wb + kAhead * t.w_block_bytes + line, 0, 3);
    __builtin_prefetch((const char*)t.d + (b + kAhead) * scale_bytes, 0, 3);
    __builtin_prefetch((const char*)t.extra + (b + kAhead) * scale_bytes, 0, 3);
    __m512i w[8];
    if (F == Format::Q4_1) {
      for (int g = 0; g < 4; g++) {
        const __m512i p = _mm512_loadu_si512(wb + g * 64);
        w[g] = _mm512_and_si512(p, nibble);
        w[g + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nibble);
      }
    } else {
      for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(wb + g * 64);
    }
    const __m512 dw = scales16(t.d, t.half, b);
    const __m512 mw = F == Format::Q4_1 ? scales16(t.extra, t.half, b) : _mm512_setzero_ps();
    const __m512i correction = F == Format::Q8_0 ? _mm512_loadu_si512((const int32_t*)t.extra + b * 16)
                                                 : _mm512_setzero_si512();
    for (int m = 0; m < M; m++) {
      const int64_t at = m * x.K + b * kBlock;
      __m512i sum = block_dot512<F>(w, (const int32_t*)(x.q + at), correction);
      if (Wide)  // q = 128 h + l
        sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 7), block_dot512<F>(w, (const int32_t*)(x.lo + at), correction));
      const float dx = x.d[m * blocks + b];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[m]);
      if (F == Format::Q4_1) acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.ds[m * blocks + b]), acc[m]);
    }
  }
  const __mmask16 keep = valid >= 16 ? 0xffff : (__mmask16)((1u << valid) - 1);
  for (int m = 0; m < M; m++) _mm512_mask_storeu_ps(y + m * N, keep, acc[m]);
}
#endif

#ifdef SPECDEC_AMX
constexpr int64_t kAmxRows = 16;  // a tile's rows

// Linux gives a process the tiles' 8 KB of register state only when it asks, once for all its threads.
bool amx_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// Where the tiles pay, measured in whole passes of the embedded target (docs/performance.md, item 33): Q8_0
// products of 8,192 output rows or more (what was measured: its output layer, 49,152 rows), in chunks of 4 rows
// or more. A tile of sums costs about as much to move to memory as 4 rows' dot products in AVX-512, and the first
// tile instruction after a pause about 3 us. A layer's Q4_1 products on the tiles (nibbles widened to bytes
// first), faster at 8-16 rows when called back to back, made whole passes slower at 5-32 rows: those stay on
// AVX-512. Returns how many of M rows the tiles take: whole chunks of 16, and a last one of 4 rows or more.
constexpr int64_t kAmxMinRows = 4, kAmxMinOutputs = 8192;
int64_t amx_rows(Format f, int64_t N, int64_t K, int64_t M) {
  if (f != Format::Q8_0 || N < kAmxMinOutputs || K < kBlock || !amx_permitted()) return 0;
  const int64_t rest = M % kAmxRows;
  return rest == 0 || rest >= kAmxMinRows ? M : M - rest;
}

// tmm0 and tmm1: the rows' bytes of x for a block (16-bit x: the high and the low ones), rows x 32 bytes;
// tmm2: the block's weights, 8 groups of [16 rows][4] bytes; tmm3 and tmm4: the sums, rows x 16 int32.
void amx_configure(int rows) {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } c{};
  c.palette = 1;
  c.rows[0] = c.rows[1] = c.rows[3] = c.rows[4] = (uint8_t)rows;
  c.colsb[0] = c.colsb[1] = 32;
  c.rows[2] = 8;
  c.colsb[2] = c.colsb[3] = c.colsb[4] = 64;
  asm volatile("" ::: "memory");  // the intrinsic tells the compiler it reads 8 of the 64 bytes: all are written
  _tile_loadconfig(&c);
}

// A tile of Q8_0 weights for `rows` rows of x (configured): a block's dot products on the tiles (signed bytes
// by signed bytes: no correction), its float steps one block behind, while the next block's tiles run.
template <bool Wide>
void tile_amx(const Rows& x, int rows, const Tile& t, float* y, int64_t N, int64_t valid) {
  const int64_t blocks = x.K / kBlock, w_bytes = t.w_block_bytes;
  alignas(64) int32_t sums[2][2][kAmxRows * 16];
  __m512 acc[kAmxRows];
  for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
  const int64_t scale_bytes = 16 * (t.half ? 2 : 4);
  auto issue = [&](int64_t b) {
    // an output layer comes cold from memory: ask for it ahead as the AVX-512 form does (a whole pass of the
    // embedded target at 8 rows spent 1.7 ms in its head on the tiles without this, 1.2 with it)
    for (int64_t line = 0; line < w_bytes; line += 64) __builtin_prefetch(t.w + (b + kAhead) * w_bytes + line, 0, 3);
    __builtin_prefetch((const char*)t.d + (b + kAhead) * scale_bytes, 0, 3);
    _tile_loadd(2, t.w + b * w_bytes, 64);
    _tile_loadd(0, x.q + b * kBlock, x.K);
    _tile_zero(3);
    _tile_dpbssd(3, 0, 2);
    _tile_stored(3, sums[b & 1][0], 64);
    if (Wide) {
      _tile_loadd(1, x.lo + b * kBlock, x.K);
      _tile_zero(4);
      _tile_dpbssd(4, 1, 2);
      _tile_stored(4, sums[b & 1][1], 64);
    }
  };
  auto finish = [&](int64_t b) {
    const __m512 dw = scales16(t.d, t.half, b);
    for (int m = 0; m < rows; m++) {
      __m512i sum = _mm512_load_si512(sums[b & 1][0] + m * 16);
      if (Wide) sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 7), _mm512_load_si512(sums[b & 1][1] + m * 16));
      const float dx = x.d[m * blocks + b];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[m]);
    }
  };
  issue(0);
  for (int64_t b = 1; b < blocks; b++) {
    issue(b);
    finish(b - 1);
  }
  finish(blocks - 1);
  const __mmask16 keep = valid >= 16 ? 0xffff : (__mmask16)((1u << valid) - 1);
  for (int m = 0; m < rows; m++) _mm512_mask_storeu_ps(y + m * N, keep, acc[m]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline __m256 scales8(const void* p, bool half, int64_t b, int h) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + b * 16 + h * 8)))
              : _mm256_loadu_ps((const float*)p + b * 16 + h * 8);
}

#ifdef __AVXVNNI__
// AVX-VNNI (256-bit dot products, Alder Lake on): one block of 8 of a tile's rows (h: which half), their integer
// sums sum_k qw qx for the 32 bytes of x at xp.
template <Format F>
inline __m256i block_dot_vnni256(const __m256i* w, const int8_t* xp, const Tile& t, int64_t b, int h) {
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  int32_t x4[8];
  std::memcpy(x4, xp, sizeof x4);
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  for (int g = 0; g < 8; g++) {
    const __m256i xb = _mm256_set1_epi32(x4[g]);
    const __m256i part = F == Format::Q4_1
                             ? _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w[g], xb)
                             : _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_xor_si256(xb, flip), w[g]);
    if (g % 2) s1 = _mm256_add_epi32(s1, part);
    else s0 = _mm256_add_epi32(s0, part);
  }
  if (F == Format::Q8_0)
    s0 = _mm256_sub_epi32(s0, _mm256_loadu_si256((const __m256i*)((const int32_t*)t.extra + b * 16 + h * 8)));
  return _mm256_add_epi32(s0, s1);
}

// 8 of a tile's 16 rows (h: which half) in AVX-VNNI's dot products.
template <int M, Format F, bool Wide>
void half_tile_vnni256(const Rows& x, const Tile& t, float* y, int64_t N, int64_t valid, int h) {
  const int64_t blocks = x.K / kBlock;
  __m256 acc[M];
  for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* wb = t.w + b * t.w_block_bytes + h * 32;
    __builtin_prefetch(wb + 4 * t.w_block_bytes, 0, 3);
    __m256i w[8];
    if (F == Format::Q4_1) {
      for (int g = 0; g < 4; g++) {
        const __m256i p = _mm256_loadu_si256((const __m256i*)(wb + g * 64));
        w[g] = _mm256_and_si256(p, nibble);
        w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), nibble);
      }
    } else {
      for (int g = 0; g < 8; g++) w[g] = _mm256_loadu_si256((const __m256i*)(wb + g * 64));
    }
    const __m256 dw = scales8(t.d, t.half, b, h);
    for (int m = 0; m < M; m++) {
      const int64_t at = m * x.K + b * kBlock;
      __m256i sum = block_dot_vnni256<F>(w, x.q + at, t, b, h);
      if (Wide)  // q = 128 h + l
        sum = _mm256_add_epi32(_mm256_slli_epi32(sum, 7), block_dot_vnni256<F>(w, x.lo + at, t, b, h));
      const float dx = x.d[m * blocks + b];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[m]);
      if (F == Format::Q4_1) acc[m] = _mm256_fmadd_ps(scales8(t.extra, t.half, b, h), _mm256_set1_ps(x.ds[m * blocks + b]), acc[m]);
    }
  }
  for (int m = 0; m < M; m++) {
    float out[8];
    _mm256_storeu_ps(out, acc[m]);
    for (int r = 0; r < 8 && h * 8 + r < valid; r++) y[m * N + h * 8 + r] = out[r];
  }
}
#endif

// AVX2 without VNNI: maddubs (pairs of u8 x s8 to 16 bits) and madd (to 32). R rows of x at a time, their partial
// sums and accumulators in registers (AVX2 has 16), each group of weights loaded (and for Q4_1 split into nibbles)
// once for the R rows, one group at a time: holding a block's 8 groups for every row, as the AVX-VNNI form does,
// GCC spilled the groups and the accumulators to the stack. The same integer sums and the same float steps, so the
// products equal every other form's bit for bit.
template <int R, Format F, bool Wide>
void rows_maddubs(const Rows& x, const Tile& t, float* y, int64_t N, int64_t valid, int h) {
  const int64_t blocks = x.K / kBlock;
  const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  auto x4 = [&](const int8_t* q, int r, int64_t b, int k) {  // x's 4 bytes k..k+3 of block b, row r, in every lane
    int32_t v;
    std::memcpy(&v, q + r * x.K + b * kBlock + k, sizeof v);
    return _mm256_set1_epi32(v);
  };
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* wb = t.w + b * t.w_block_bytes + h * 32;
    __builtin_prefetch(wb + 4 * t.w_block_bytes, 0, 3);
    __m256i high[R], low[R];  // sum_k qw qx over x's high (or only) bytes and its low bytes
    for (int r = 0; r < R; r++) high[r] = low[r] = _mm256_setzero_si256();
    if (F == Format::Q4_1) {
      // 16-bit sums: a maddubs pair of 4-bit w and |x| <= 127 is at most 3,810, and a lane adds 8 of them
#pragma GCC unroll 1
      for (int g = 0; g < 4; g++) {
        const __m256i p = _mm256_loadu_si256((const __m256i*)(wb + g * 64));
        const __m256i w0 = _mm256_and_si256(p, nibble), w1 = _mm256_and_si256(_mm256_srli_epi16(p, 4), nibble);
        for (int r = 0; r < R; r++) {
          high[r] = _mm256_add_epi16(high[r], _mm256_maddubs_epi16(w0, x4(x.q, r, b, 4 * g)));
          high[r] = _mm256_add_epi16(high[r], _mm256_maddubs_epi16(w1, x4(x.q, r, b, 16 + 4 * g)));
          if (Wide) {
            low[r] = _mm256_add_epi16(low[r], _mm256_maddubs_epi16(w0, x4(x.lo, r, b, 4 * g)));
            low[r] = _mm256_add_epi16(low[r], _mm256_maddubs_epi16(w1, x4(x.lo, r, b, 16 + 4 * g)));
          }
        }
      }
      for (int r = 0; r < R; r++) {
        high[r] = _mm256_madd_epi16(high[r], ones);
        if (Wide) low[r] = _mm256_madd_epi16(low[r], ones);
      }
    } else {
      // signed w: the sign trick, |w| times x with w's sign, and each group's pairs widened to 32 bits
#pragma GCC unroll 2
      for (int g = 0; g < 8; g++) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(wb + g * 64)), aw = _mm256_abs_epi8(w);
        for (int r = 0; r < R; r++) {
          const __m256i hx = _mm256_sign_epi8(x4(x.q, r, b, 4 * g), w);
          high[r] = _mm256_add_epi32(high[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, hx), ones));
          if (Wide) {
            const __m256i lx = _mm256_sign_epi8(x4(x.lo, r, b, 4 * g), w);
            low[r] = _mm256_add_epi32(low[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, lx), ones));
          }
        }
      }
    }
    const __m256 dw = scales8(t.d, t.half, b, h);
    for (int r = 0; r < R; r++) {
      const __m256i sum = Wide ? _mm256_add_epi32(_mm256_slli_epi32(high[r], 7), low[r]) : high[r];  // q = 128 h + l
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[r * blocks + b])), acc[r]);
      if (F == Format::Q4_1)
        acc[r] = _mm256_fmadd_ps(scales8(t.extra, t.half, b, h), _mm256_set1_ps(x.ds[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    float out[8];
    _mm256_storeu_ps(out, acc[r]);
    for (int c = 0; c < 8 && h * 8 + c < valid; c++) y[r * N + h * 8 + c] = out[c];
  }
}

// M rows of a tile's half h, R at a time: as many as fit AVX2's 16 registers, two sums and an accumulator a row
// with 16-bit x, else one and one.
template <int M, Format F, bool Wide>
void half_tile_maddubs(const Rows& x, const Tile& t, float* y, int64_t N, int64_t valid, int h) {
  constexpr int R = Wide ? 3 : 4;
  rows_maddubs<(M < R ? M : R), F, Wide>(x, t, y, N, valid, h);
  if constexpr (M > R) half_tile_maddubs<M - R, F, Wide>(x.from(R), t, y + R * N, N, valid, h);
}
#endif

template <int M, Format F, bool Wide>
void tile(Isa isa, const Rows& x, const Tile& t, float* y, int64_t N, int64_t valid) {
  switch (isa) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    case Isa::Avx512Vnni: return tile_avx512<M, F, Wide>(x, t, y, N, valid);
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#ifdef __AVXVNNI__
    case Isa::AvxVnni:
      for (int h = 0; h < 2 && h * 8 < valid; h++) half_tile_vnni256<M, F, Wide>(x, t, y, N, valid, h);
      return;
#endif
    case Isa::Avx2:
      for (int h = 0; h < 2 && h * 8 < valid; h++) half_tile_maddubs<M, F, Wide>(x, t, y, N, valid, h);
      return;
#endif
    default: TORCH_CHECK(false, "q8 products: this instruction set was not built here");
  }
}

template <int M>
void tile_of(Format f, int bits, Isa isa, const Rows& x, const Tile& t, float* y, int64_t N, int64_t valid) {
  if (f == Format::Q4_1) {
    if (bits == 16) tile<M, Format::Q4_1, true>(isa, x, t, y, N, valid);
    else tile<M, Format::Q4_1, false>(isa, x, t, y, N, valid);
  } else {
    if (bits == 16) tile<M, Format::Q8_0, true>(isa, x, t, y, N, valid);
    else tile<M, Format::Q8_0, false>(isa, x, t, y, N, valid);
  }
}

#ifdef SPECDEC_AMX
// x's first amx_rows rows through the tiles begin..end, 16 rows at a time; returns the first row left to the
// AVX-512 form.
template <class TileAt>
int64_t amx_sweep(Format f, int bits, const Rows& x, int64_t M, int64_t begin, int64_t end, TileAt tile_at,
                  float* y, int64_t N) {
  const int64_t tiled = amx_rows(f, N, x.K, M);
  for (int64_t m0 = 0; m0 < tiled; m0 += kAmxRows) {
    const int rows = (int)std::min<int64_t>(kAmxRows, M - m0);
    const Rows chunk = x.from(m0);
    amx_configure(rows);  // a tile configuration costs about 45 ns: once a chunk, not once a tile
    for (int64_t t = begin; t < end; t++) {
      const Tile w = tile_at(t);
      const int64_t valid = std::min<int64_t>(kTileRows, N - t * kTileRows);
      float* yt = y + m0 * N + t * kTileRows;
      if (bits == 16) tile_amx<true>(chunk, rows, w, yt, N, valid);
      else tile_amx<false>(chunk, rows, w, yt, N, valid);
    }
    _tile_release();
  }
  return tiled;
}
#endif

Isa parse_isa(const std::string& name) {
#ifdef SPECDEC_AMX
  if (name == "amx") return amx_permitted() ? Isa::Amx : Isa::Avx512Vnni;  // the same products, bit for bit
#endif
  if (name == "avx512-vnni") return Isa::Avx512Vnni;
  if (name == "avx-vnni") return Isa::AvxVnni;
  if (name == "avx2") return Isa::Avx2;
  TORCH_CHECK(false, "q8 products: isa amx, avx512-vnni, avx-vnni or avx2 where this CPU has it, not ", name);
}

}  // namespace

// The instruction-set forms this build runs, best first (CPU and compiler both: -march=native).
std::vector<std::string> q8_isas() {
  std::vector<std::string> out;
#ifdef SPECDEC_AMX
  if (amx_permitted()) out.push_back("amx");
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  out.push_back("avx512-vnni");
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#ifdef __AVXVNNI__
  out.push_back("avx-vnni");
#endif
  out.push_back("avx2");
#endif
  return out;
}

// How many of `rows` rows of x the AMX form multiplies on the tiles for n output rows of this format and k inputs;
// the AVX-512 form takes the rest. 0 where this CPU or its kernel gives no tiles.
int64_t q8_amx_rows(const std::string& format, int64_t n, int64_t k, int64_t rows) {
#ifdef SPECDEC_AMX
  return amx_rows(format == "Q8_0" ? Format::Q8_0 : Format::Q4_1, n, k, rows);
#else
  return 0;
#endif
}

// x [M, K] float32 -> (q [M, K], d float32 [M, K / 32], sums int32 [M, K / 32]); K a multiple of 32. q is int8 for
// 8-bit x, and for 16-bit x int16, the value 128 h + l the kernel multiplies as its two bytes.
std::vector<torch::Tensor> quantize_q8(torch::Tensor x, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu() && x.size(1) % kBlock == 0,
              "quantize_q8: float32 x [M, K] on CPU, K a multiple of 32");
  TORCH_CHECK(bits == 8 || bits == 16, "quantize_q8: 8 or 16 bits, not ", bits);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  Quantized q;
  quantize_into(x.data_ptr<float>(), M, K, (int)bits, q);
  auto opts = x.options();
  auto out_q = torch::from_blob(q.q.data(), {M, K}, opts.dtype(torch::kChar)).clone();
  if (bits == 16)
    out_q = out_q.to(torch::kShort) * 128 + torch::from_blob(q.lo.data(), {M, K}, opts.dtype(torch::kChar)).to(torch::kShort);
  auto out_d = torch::from_blob(q.d.data(), {M, K / kBlock}, opts).clone();
  auto out_s = torch::from_blob(q.s.data(), {M, K / kBlock}, opts.dtype(torch::kInt)).clone();
  return {out_q, out_d, out_s};
}

// w [T, K / 32, bytes] (uint8 for Q4_1, int8 for Q8_0), d [T, K / 32, 16] fp16 or float32, extra: the minimums
// (Q4_1, as d) or 128 * sum_k qw (Q8_0, int32 [T, K / 32, 16]); N output rows of the T * 16 packed.
torch::Tensor few_rows_q8(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor extra,
                          const std::string& format, int64_t N, const std::string& isa_name, int64_t bits) {
  TORCH_CHECK(format == "Q4_1" || format == "Q8_0", "few_rows_q8: format Q4_1 or Q8_0, not ", format);
  TORCH_CHECK(bits == 8 || bits == 16, "few_rows_q8: x in 8 or 16 bits, not ", bits);
  const Format f = format == "Q4_1" ? Format::Q4_1 : Format::Q8_0;
  const Isa isa = parse_isa(isa_name);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu() && w.dim() == 3,
              "few_rows_q8: float32 x [M, K] on CPU");
  const int64_t blocks = w.size(1), K = blocks * kBlock, T = w.size(0);
  TORCH_CHECK(x.size(1) <= K && x.size(1) > K - kBlock, "few_rows_q8: x's width ", x.size(1), " is not the weights' ",
              K, " less a block's padding");
  // the weights' inputs past x's width are zeros: so are x's there, which leaves every block's scale as it was
  if (x.size(1) < K) x = torch::constant_pad_nd(x, {0, K - x.size(1)});
  const int64_t w_block_bytes = f == Format::Q4_1 ? 256 : 512;
  TORCH_CHECK(w.size(2) == w_block_bytes && w.is_contiguous() &&
              d.dim() == 3 && d.size(0) == T && d.size(1) == blocks && d.size(2) == 16 && d.is_contiguous() &&
              extra.sizes() == d.sizes() && extra.is_contiguous() && N <= T * kTileRows && N > (T - 1) * kTileRows,
              "few_rows_q8: ", format, " tiles do not match x's width ", K, " and ", N, " rows");
  const bool half = d.scalar_type() == torch::kHalf;
  TORCH_CHECK(half || d.scalar_type() == torch::kFloat, "few_rows_q8: scales fp16 or float32");
  TORCH_CHECK(f == Format::Q8_0 ? extra.scalar_type() == torch::kInt : extra.scalar_type() == d.scalar_type(),
              "few_rows_q8: Q4_1 minimums as its scales, Q8_0 corrections int32");
  x = x.contiguous();
  const int64_t M = x.size(0);
  thread_local Quantized buffer;  // the calling thread's; the workers below read it through these pointers
  quantize_into(x.data_ptr<float>(), M, K, (int)bits, buffer);
  const int8_t *xq = buffer.q.data(), *xlo = bits == 16 ? buffer.lo.data() : nullptr;
  const float *xd = buffer.d.data(), *xds = buffer.ds.data();
  const int32_t* xs = buffer.s.data();
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = (const uint8_t*)w.data_ptr();
  const char* dp = (const char*)d.data_ptr();
  const char* ep = (const char*)extra.data_ptr();
  const int64_t d_tile = blocks * 16 * d.element_size(), e_tile = blocks * 16 * extra.element_size();
  float* yp = y.data_ptr<float>();
  const Rows all{xq, xlo, xd, xs, xds, K};
  auto tile_at = [&](int64_t t) {
    return Tile{wp + t * blocks * w_block_bytes, dp + t * d_tile, ep + t * e_tile, half, w_block_bytes};
  };
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    int64_t first = 0;  // the first row of x the tiles leave to the vector forms
#ifdef SPECDEC_AMX
    if (isa == Isa::Amx) first = amx_sweep(f, (int)bits, all, M, begin, end, tile_at, yp, N);
#endif
    const Isa vector_isa = isa == Isa::Amx ? Isa::Avx512Vnni : isa;
    for (int64_t t = begin; t < end; t++) {
      const Tile tile_w = tile_at(t);
      const int64_t valid = std::min<int64_t>(kTileRows, N - t * kTileRows);
      for (int64_t m0 = first; m0 < M; m0 += kMaxRows) {
        const Rows rows = all.from(m0);
        float* yt = yp + m0 * N + t * kTileRows;
        switch (std::min<int64_t>(kMaxRows, M - m0)) {
#define ROWS(m)                                                  \
  case m:                                                        \
    tile_of<m>(f, (int)bits, vector_isa, rows, tile_w, yt, N, valid); \
    break;
          ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
      }
    }
  });
  return y;
}
