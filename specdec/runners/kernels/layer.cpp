// The work of a decoder layer between its products, for a step or a verify pass (a few rows), in
// float32 on CPU: RMS norm, rotary embedding + KV-cache write + causal attention, SiLU gate. The KV cache is
// float32 or float16: a float16 cache stores each key and value rounded to the nearest half (IEEE, ties to even)
// and attention reads them widened back to float32, so the arithmetic is the float32 cache's on those values.
//
// In eager PyTorch this glue is ~90 small ops a layer, each a few microseconds of dispatch for
// nanoseconds of arithmetic: 7-9 ms of the embedded target's 26-29 ms pass, and most of a small
// draft's step. Here it is three calls a layer. Same arithmetic as the torch functions in
// specdec/lean_llama.py (the reference the tests hold these to), summed in another order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <array>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstring>
#include <vector>

#include "layer.h"
#include "vec.h"

static void check_cpu_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(),
              name, " must be a contiguous float32 tensor on CPU");
}

// A KV cache's tensor: float32 or float16, contiguous, on CPU.
static void check_cache(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kHalf) &&
              t.is_contiguous(), name, " must be a contiguous float32 or float16 tensor on CPU");
}

// 16 cached float16 values widened to float32 at out, in one conversion where the CPU has one (exact: every half
// is a float). Stored straight from the conversions: a 16-float vec built from AVX2's two halves went through the
// stack.
static inline void widen16(const at::Half* p, float* out) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(out, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
#else
  for (int i = 0; i < 16; i++) out[i] = static_cast<float>(p[i]);
#endif
}

// n values into a cache: copied, or rounded to float16 (c10's conversion, ties to even).
static inline void put(float* to, const float* from, int64_t n) { std::memcpy(to, from, n * sizeof(float)); }
static inline void put(at::Half* to, const float* from, int64_t n) {
  for (int64_t i = 0; i < n; i++) to[i] = at::Half(from[i]);
}

// x [n, D], w [D] -> x / rms(x) * w
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  x = x.contiguous();
  check_cpu_float(x, "rms_norm: x");
  check_cpu_float(w, "rms_norm: w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "rms_norm: x [n, D] and w [D]");
  const int64_t n = x.size(0), D = x.size(1), D16 = D - D % 16;
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0; i < n; i++) {
    const float* r = xp + i * D;
    float* o = yp + i * D;
    vec acc{};
    for (int64_t k = 0; k < D16; k += 16) acc += load(r + k) * load(r + k);
    float s = lane_sum(acc);
    for (int64_t k = D16; k < D; k++) s += r[k] * r[k];
    const float inv = 1.0f / std::sqrt(s / D + (float)eps);
    for (int64_t k = 0; k < D16; k += 16) store(o + k, load(r + k) * inv * load(wp + k));
    for (int64_t k = D16; k < D; k++) o[k] = r[k] * inv * wp[k];
  }
  return y;
}

// Llama's rotary embedding of one head's vector (rotate_half form): out = x cos + rotate_half(x) sin.
static inline void rope(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i++) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
  }
}

// One key's products with a scaled query, per lane: lane_sum of it is the score.
template <int DV>
static inline vec key_products(const vec* qv, const float* k) {
  vec a = qv[0] * load(k);
#pragma GCC unroll 8
  for (int c = 1; c < DV; c++) a += qv[c] * load(k + 16 * c);
  return a;
}

// The scores of 16 keys (16 * DV floats apart) against one scaled query: lane u is key u's, summed as lane_sum
// sums one key's products. Written out level by level so that the compiler keeps every partial in registers.
template <int DV>
static inline vec scores16(const vec* qv, const float* K) {
  constexpr int S = 16 * DV;
  vec a[8], b[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; i++)
    a[i] = sums_level1(key_products<DV>(qv, K + 2 * i * S), key_products<DV>(qv, K + (2 * i + 1) * S));
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++) b[i] = sums_level2(a[2 * i], a[2 * i + 1]);
  return sums_level4(sums_level3(b[0], b[1]), sums_level3(b[2], b[3]));
}

// The cache's keys and values come from memory once a pass (at a context of 1,800, 40 MB of the embedded
// target's), so each block of 16 prefetches the one kAttendAhead blocks on: in the target's whole pass at that
// context, 4.9 -> 4.3 ms for a step and 9.5 -> 7.5 ms for 4 rows (1 and 4 blocks ahead did the same or less).
constexpr int64_t kAttendAhead = 2;
template <typename T>
static inline void prefetch_block(const T* base, int64_t u0, int64_t last, int64_t d) {
  const int64_t ahead = u0 + 16 * kAttendAhead;
  constexpr int64_t line = 64 / sizeof(T);  // a cache line's values
  if (ahead + 16 <= last)
    for (int64_t l = 0; l < 16 * d; l += line) __builtin_prefetch(base + ahead * d + l, 0, 3);
}

// Keys or values u0 .. u0 + 15 of a cache of cap, as float32 for all of a task's queries: a float32 cache's own
// memory where the block is whole; else a copy in buf, widened from a float16 cache's halves (once a block, not
// once a query: a verify's 4 rows are 12 queries of a KV head) and zeros past the cache's end (keys past a query's
// own are never used).
static inline const float* block_of(const float* base, int64_t u0, int64_t cap, int64_t D, float* buf) {
  if (u0 + 16 <= cap) return base + u0 * D;
  std::memcpy(buf, base + u0 * D, (cap - u0) * D * sizeof(float));
  std::memset(buf + (cap - u0) * D, 0, (16 - (cap - u0)) * D * sizeof(float));
  return buf;
}
static inline const float* block_of(const at::Half* base, int64_t u0, int64_t cap, int64_t D, float* buf) {
  const int64_t n = std::min<int64_t>(16, cap - u0) * D;  // a multiple of 16, as D is
  for (int64_t i = 0; i < n; i += 16) widen16(base + u0 * D + i, buf + i);
  std::memset(buf + n, 0, (16 * D - n) * sizeof(float));
  return buf;
}

// Queries q0 .. q1 - 1 of the ones that read one KV head, query i being row j_i = i / group of the pass, seeing
// keys 0 .. start + j_i; qs: each query's rotated vector, times 1 / sqrt(d); K, V: the head's cache, cap keys of
// 16 DV floats or halves (T); s: scratch, a row of stride `stride` per query; out(i): where query i's output goes.
//
// A verify pass's rows and a group's query heads read the same keys and values. Reading them per query made
// attention bound by the L2's bandwidth (a 4-row pass at a context of 2,000: 144 us a layer, 5x a step's); here
// each block of 16 keys is read from memory once for all of a task's queries, and each query's scores come
// 16 keys at a time (lane_sums16 in place of a horizontal sum per key). Each query's arithmetic is its own, in
// the same order whatever else the task holds: a verify's row j equals the step at that position, bit for bit
// (greedy exactness needs that), and equals the query-at-a-time loop this replaced.
template <int DV, typename T, typename Out>
static void attend_queries(const float* qs, const T* K, const T* V, int64_t cap, int64_t start,
                           int64_t group, int64_t q0, int64_t q1, float* s, int64_t stride, Out out) {
  constexpr int D = 16 * DV;
  const int64_t last = start + (q1 - 1) / group + 1;  // the longest query's keys
  alignas(64) float buf[16 * D];
  for (int64_t u0 = 0; u0 < last; u0 += 16) {
    prefetch_block(K, u0, last, D);
    const float* block = block_of(K, u0, cap, D, buf);
    for (int64_t i = q0; i < q1; i++) {
      if (u0 >= start + i / group + 1) continue;
      vec qv[DV];
      for (int c = 0; c < DV; c++) qv[c] = load(qs + (i - q0) * D + 16 * c);
      store(s + (i - q0) * stride + u0, scores16<DV>(qv, block));  // lanes past the query's keys: unused
    }
  }
  std::vector<float> inv(q1 - q0);
  for (int64_t i = q0; i < q1; i++) {  // softmax: e^(score - max) in place, and 1 / their sum
    float* si = s + (i - q0) * stride;
    const int64_t len = start + i / group + 1;
    float mx = -INFINITY;
    int64_t u = 0;
    if (len >= 16) {
      f16 top = load16(si);
      for (u = 16; u + 16 <= len; u += 16) top = max16(load16(si + u), top);
      mx = lane_max(top);
    }
    for (; u < len; u++) mx = si[u] > mx ? si[u] : mx;
    f16 total = splat16(0.0f);
    const f16 mxv = splat16(mx);
    for (u = 0; u + 16 <= len; u += 16) {
      const f16 e = exp16(load16(si + u) - mxv);
      store16(si + u, e);
      total = total + e;
    }
    float sum = lane_sum(total);
    for (; u < len; u++) sum += (si[u] = std::exp(si[u] - mx));
    inv[i - q0] = 1.0f / sum;
  }
  std::vector<vec> acc((q1 - q0) * DV, vec{});
  for (int64_t u0 = 0; u0 < last; u0 += 16) {  // a block of 16 values, read once for every query
    prefetch_block(V, u0, last, D);
    const float* block = block_of(V, u0, cap, D, buf);
    for (int64_t i = q0; i < q1; i++) {
      const int64_t stop = std::min<int64_t>(u0 + 16, start + i / group + 1);
      if (stop <= u0) continue;
      const float* si = s + (i - q0) * stride;
#ifdef __AVX512F__
      vec ov[DV];
      for (int c = 0; c < DV; c++) ov[c] = acc[(i - q0) * DV + c];
      for (int64_t u = u0; u < stop; u++) {
        const float* v = block + (u - u0) * D;
        for (int c = 0; c < DV; c++) ov[c] += si[u] * load(v + 16 * c);
      }
      for (int c = 0; c < DV; c++) acc[(i - q0) * DV + c] = ov[c];
#else
      // The same multiply-add per lane in 8-float vectors: without AVX-512, GCC builds a 16-float splat of si[u]
      // through 16 stores to the stack and keeps the accumulators there, so AVX2 takes this form (the same bits)
      vec8 ov[2 * DV];
      std::memcpy(ov, &acc[(i - q0) * DV], sizeof ov);
      for (int64_t u = u0; u < stop; u++) {
        const float* v = block + (u - u0) * D;
        const float w = si[u];
        const vec8 wv = {w, w, w, w, w, w, w, w};
        for (int c = 0; c < 2 * DV; c++) ov[c] += wv * load8(v + 8 * c);
      }
      std::memcpy(&acc[(i - q0) * DV], ov, sizeof ov);
#endif
    }
  }
  for (int64_t i = q0; i < q1; i++)
    for (int c = 0; c < DV; c++) store(out(i) + 16 * c, acc[(i - q0) * DV + c] * inv[i - q0]);
}

template <typename T>
static void attend_row_any(const float* q, const T* K, const T* V, int64_t len, int64_t d, float scale,
                           float* s, float* out) {
  float mx = -INFINITY;
  for (int64_t u = 0; u < len; u++) {
    float acc = 0;
    for (int64_t c = 0; c < d; c++) acc += q[c] * static_cast<float>(K[u * d + c]);
    s[u] = acc * scale;
    mx = s[u] > mx ? s[u] : mx;
  }
  float sum = 0;
  for (int64_t u = 0; u < len; u++) sum += (s[u] = std::exp(s[u] - mx));
  for (int64_t c = 0; c < d; c++) out[c] = 0;
  for (int64_t u = 0; u < len; u++)
    for (int64_t c = 0; c < d; c++) out[c] += s[u] * static_cast<float>(V[u * d + c]);
  for (int64_t c = 0; c < d; c++) out[c] /= sum;
}

// One session's rows in a pass: rows row .. row + n - 1 of qkv, its cache layer (k, v: [kv, cap, d], of type T)
// holding `start` tokens.
template <typename T>
struct Segment {
  int64_t row, n, start, cap;
  T *k, *v;
};

// The attention of every segment's rows over its own cache, after writing their keys (rotated) and values there.
// x: qkv [rows, (h + 2 kv) d]; cos, sin [rows, d]; out [rows, h d]. One parallel region for all segments, so a
// batched pass pays one fork and join a layer, not one per session. Each query's arithmetic is its own, in the
// same order whatever the segments around it and however the tasks split: a session's rows get in a batched
// pass exactly what they get alone, and a verify row exactly the step at its position.
template <typename T>
static void attend_segments(const float* x, const float* cp, const float* sp, const std::vector<Segment<T>>& segs,
                            int64_t h, int64_t kv, int64_t d, float* op) {
  const int64_t group = h / kv, width = (h + 2 * kv) * d;
  int64_t work = 0;
  std::vector<float> key(d);
  for (const auto& g : segs) {
    TORCH_CHECK(g.start >= 0 && g.start + g.n <= g.cap, "attend: ", g.start + g.n,
                " tokens exceed the cache's capacity of ", g.cap);
    for (int64_t j = 0; j < g.n; j++) {
      const int64_t r = g.row + j;
      for (int64_t b = 0; b < kv; b++) {
        rope(x + r * width + (h + b) * d, cp + r * d, sp + r * d, key.data(), d);
        put(g.k + (b * g.cap + g.start + j) * d, key.data(), d);
        put(g.v + (b * g.cap + g.start + j) * d, x + r * width + (h + kv + b) * d, d);
      }
    }
    work += h * g.n * (g.start + g.n) * d;
  }
  const float scale = 1.0f / std::sqrt((float)d);
  // A short context is a few microseconds of work: waking the other threads would cost more.
  const bool serial = work < (1 << 16);
  const int64_t threads = serial ? 1 : at::get_num_threads();
  if (d % 16 || d / 16 > 8) {  // no vector path: each (segment, head, row) on its own
    std::vector<std::array<int64_t, 3>> tasks;
    for (int64_t g = 0; g < (int64_t)segs.size(); g++)
      for (int64_t a = 0; a < h; a++)
        for (int64_t j = 0; j < segs[g].n; j++) tasks.push_back({g, a, j});
    auto run = [&](int64_t lo, int64_t hi) {
      std::vector<float> q(d), s;
      for (int64_t t = lo; t < hi; t++) {
        const auto [gi, a, j] = tasks[t];
        const Segment<T>& g = segs[gi];
        const int64_t r = g.row + j, b = a / group, len = g.start + j + 1;
        s.resize(len);
        rope(x + r * width + a * d, cp + r * d, sp + r * d, q.data(), d);
        attend_row_any(q.data(), g.k + b * g.cap * d, g.v + b * g.cap * d, len, d, scale, s.data(), op + r * h * d + a * d);
      }
    };
    if (serial) run(0, tasks.size());
    else at::parallel_for(0, tasks.size(), 1, run);
    return;
  }
  // Tasks: a KV head's queries of one segment (group heads x its rows, row-major), in runs enough for every
  // thread to have work where there are fewer (segment, KV head) pairs than threads. The split changes no
  // query's arithmetic.
  struct Task { int64_t seg, b, q0, q1; };
  std::vector<Task> tasks;
  const int64_t pairs = (int64_t)segs.size() * kv;
  for (int64_t gi = 0; gi < (int64_t)segs.size(); gi++) {
    const int64_t queries = group * segs[gi].n;
    const int64_t chunks = std::min<int64_t>(queries, std::max<int64_t>(1, (2 * threads + pairs - 1) / pairs));
    const int64_t per = (queries + chunks - 1) / chunks;
    for (int64_t b = 0; b < kv; b++)
      for (int64_t q0 = 0; q0 < queries; q0 += per) tasks.push_back({gi, b, q0, std::min(q0 + per, queries)});
  }
  auto run = [&](int64_t lo, int64_t hi) {
    std::vector<float> qs, s;
    for (int64_t t = lo; t < hi; t++) {
      const auto [gi, b, q0, q1] = tasks[t];
      const Segment<T>& g = segs[gi];
      const int64_t stride = (g.start + g.n + 15) / 16 * 16;
      qs.resize((q1 - q0) * d);
      s.resize((q1 - q0) * stride);
      for (int64_t i = q0; i < q1; i++) {  // query i: row i / group, head b * group + i % group
        const int64_t r = g.row + i / group, a = b * group + i % group;
        float* q = qs.data() + (i - q0) * d;
        rope(x + r * width + a * d, cp + r * d, sp + r * d, q, d);
        for (int64_t c = 0; c < d; c++) q[c] *= scale;
      }
      auto to = [&](int64_t i) { return op + (g.row + i / group) * h * d + (b * group + i % group) * d; };
      const T *K = g.k + b * g.cap * d, *V = g.v + b * g.cap * d;
      switch (d / 16) {
#define DV(c) case c: attend_queries<c>(qs.data(), K, V, g.cap, g.start, group, q0, q1, s.data(), stride, to); break;
        DV(1) DV(2) DV(3) DV(4) DV(5) DV(6) DV(7) DV(8)
#undef DV
      }
    }
  };
  if (serial) run(0, tasks.size());
  else at::parallel_for(0, tasks.size(), 1, run);
}

static void attend_caches(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& ns, int64_t layer,
                          int64_t h, torch::Tensor& out);

static void check_rows(torch::Tensor& qkv, torch::Tensor& cos, torch::Tensor& sin) {
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  for (auto [t, name] : {std::pair{&qkv, "attend: qkv"}, {&cos, "attend: cos"}, {&sin, "attend: sin"}})
    check_cpu_float(*t, name);
}

// qkv [n, (h + 2 kv) d]: the new tokens' projections; k, v [kv, capacity, d]: one layer of the cache,
// holding `start` tokens; cos, sin [n, d]: the new positions' rotary tables. Writes the new keys
// (rotated) and values at start .. start + n - 1 and returns the attention of the rotated queries,
// each new token seeing every earlier one and itself: [n, h d]. Query head a reads KV head a / (h / kv).
torch::Tensor attend(torch::Tensor qkv, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                     int64_t start, int64_t h) {
  check_rows(qkv, cos, sin);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "attend: k and v [kv, capacity, d]");
  const int64_t n = qkv.size(0), kv = k.size(0), d = k.size(2);
  TORCH_CHECK(h % kv == 0 && qkv.size(1) == (h + 2 * kv) * d && cos.size(0) == n && cos.size(1) == d &&
              sin.sizes() == cos.sizes() && d % 2 == 0, "attend: shapes do not match");
  auto out = torch::empty({n, h * d}, qkv.options());
  attend_caches(qkv, cos, sin, {k}, {v}, {start}, {n}, 0, h, out);
  return out;
}

// The segments of a batched pass: session i holds rows rows_before + 0 .. ns[i] - 1, its cache ks[i], vs[i]
// ([layers, kv, capacity, d], or [kv, capacity, d] for a single layer) at `starts[i]` tokens.
template <typename T>
static std::vector<Segment<T>> segments(const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                                        const std::vector<int64_t>& starts, const std::vector<int64_t>& ns,
                                        int64_t rows, int64_t layer) {
  TORCH_CHECK(ks.size() == vs.size() && ks.size() == starts.size() && ks.size() == ns.size(),
              "attend: one cache, start and row count per segment");
  std::vector<Segment<T>> segs;
  int64_t row = 0;
  for (size_t i = 0; i < ks.size(); i++) {
    const auto& k = ks[i];
    check_cache(k, "attend: k");
    TORCH_CHECK(vs[i].sizes() == k.sizes() && vs[i].scalar_type() == k.scalar_type() &&
                k.scalar_type() == ks[0].scalar_type() && vs[i].is_contiguous() && ns[i] >= 1,
                "attend: k and v of a segment differ, a pass's caches differ in type, or a segment has no rows");
    const int64_t cap = k.size(-2), per_layer = k.size(-3) * cap * k.size(-1);
    segs.push_back({row, ns[i], starts[i], cap, k.data_ptr<T>() + layer * per_layer,
                    vs[i].data_ptr<T>() + layer * per_layer});
    row += ns[i];
  }
  TORCH_CHECK(row == rows, "attend: the segments hold ", row, " rows, the pass ", rows);
  return segs;
}

// attend_segments over the caches' layer `layer`, in their type (float32 or float16; all of one): out [rows, h d].
static void attend_caches(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                          const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& ns, int64_t layer,
                          int64_t h, torch::Tensor& out) {
  const int64_t rows = qkv.size(0), kv = ks[0].size(-3), d = ks[0].size(-1);
  const float *x = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  if (ks[0].scalar_type() == torch::kHalf)
    attend_segments(x, cp, sp, segments<at::Half>(ks, vs, starts, ns, rows, layer), h, kv, d, out.data_ptr<float>());
  else
    attend_segments(x, cp, sp, segments<float>(ks, vs, starts, ns, rows, layer), h, kv, d, out.data_ptr<float>());
}

// attend for several sessions' rows in one call: qkv [rows, ...], the segments as `segments` reads them (single
// layers). Returns [rows, h d], each session's rows what attend gives them alone.
torch::Tensor attend_batch(torch::Tensor qkv, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                           torch::Tensor cos, torch::Tensor sin, std::vector<int64_t> starts, std::vector<int64_t> ns,
                           int64_t h) {
  check_rows(qkv, cos, sin);
  TORCH_CHECK(!ks.empty() && ks[0].dim() == 3, "attend_batch: k and v [kv, capacity, d] per segment");
  const int64_t kv = ks[0].size(0), d = ks[0].size(2);
  for (const auto& k : ks) TORCH_CHECK(k.dim() == 3 && k.size(0) == kv && k.size(2) == d, "attend_batch: caches differ in shape");
  TORCH_CHECK(h % kv == 0 && qkv.size(1) == (h + 2 * kv) * d && cos.size(0) == qkv.size(0) && cos.size(1) == d &&
              sin.sizes() == cos.sizes() && d % 2 == 0, "attend_batch: shapes do not match");
  auto out = torch::empty({qkv.size(0), h * d}, qkv.options());
  attend_caches(qkv, cos, sin, ks, vs, starts, ns, 0, h, out);
  return out;
}

// gu [n, 2 I]: gate and up projections side by side -> silu(gate) * up [n, I]
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "silu_mul: gu [n, 2 I]");
  const int64_t half = gu.size(1) / 2;
  return at::silu(gu.narrow(1, 0, half)).mul_(gu.narrow(1, half, half));
}

torch::Tensor few_rows(torch::Tensor x, torch::Tensor w);
torch::Tensor few_rows_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale);
torch::Tensor few_rows_gguf(torch::Tensor x, torch::Tensor q, torch::Tensor scales, const std::string& format);
torch::Tensor few_rows_q8(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor extra,
                          const std::string& format, int64_t N, const std::string& isa, int64_t bits);

// A product with quantized activations is named "q8:FORMAT:ISA:N:BITS" (q8_blocks.Q8Weights.stacked): its block
// format, the instruction-set form that runs it, its output rows and x's bits (8 or 16).
static bool parse_q8(const std::string& f, Q8Form& out) {
  if (f.rfind("q8:", 0) != 0) return false;
  std::vector<std::string> parts;
  for (size_t at = 3, next; ; at = next + 1) {
    next = f.find(':', at);
    parts.push_back(f.substr(at, next == std::string::npos ? next : next - at));
    if (next == std::string::npos) break;
  }
  TORCH_CHECK(parts.size() == 4, "LayerStack: a q8 form is q8:FORMAT:ISA:N:BITS, not ", f);
  out = {parts[0], parts[1], std::stoll(parts[2]), std::stoll(parts[3])};
  return true;
}

// All the layers of a Llama pass in one call, with every product in specdec's kernels: the operations of
// LeanLlamaRunner.forward's Python loop, in the same order, so the same values bit for bit, without its ten
// Python calls a layer. Those are cheap warm (3% of a draft step) and not in the services, where each model
// runs cold after the other's passes: there a draft step went from 1.04-1.12 to 0.93-0.95 ms, a target step
// from 7.30-7.47 to 6.75-7.06 ms (2-core VM).
// norms: ln1 and ln2 of each layer; weights and forms: each layer's four products (QKV, O, gate/up, down),
// a product's tensors and its form: "fewrow" (w), "int8" (w, scale), a GGUF block format (q, scales) or
// "q8:FORMAT:ISA:N:BITS" (w, d, extra: q8_blocks.Q8Weights).
LayerStack::LayerStack(std::vector<torch::Tensor> norms, std::vector<std::vector<torch::Tensor>> weights,
                       std::vector<std::string> forms, int64_t heads, double eps)
    : norms_(std::move(norms)), weights_(std::move(weights)), forms_(std::move(forms)), heads_(heads), eps_(eps) {
  TORCH_CHECK(norms_.size() % 2 == 0 && weights_.size() == 2 * norms_.size() && forms_.size() == weights_.size(),
              "LayerStack: two norms and four products a layer");
  for (size_t i = 0; i < forms_.size(); i++) {
    const auto& f = forms_[i];
    Q8Form q8;
    const bool is_q8 = parse_q8(f, q8);
    q8_.push_back(q8);
    const size_t n = f == "fewrow" ? 1 : is_q8 ? 3 : 2;
    TORCH_CHECK(f == "fewrow" || f == "int8" || f == "Q4_1" || f == "Q8_0" || is_q8, "LayerStack: unknown form ", f);
    TORCH_CHECK(weights_[i].size() == n, "LayerStack: form ", f, " takes ", n, " tensors");
  }
}

torch::Tensor LayerStack::product(const torch::Tensor& x, size_t i) const {
  const auto& w = weights_[i];
  const auto& f = forms_[i];
  if (f == "fewrow") return few_rows(x, w[0]);
  if (f == "int8") return few_rows_int8(x, w[0], w[1]);
  const Q8Form& q8 = q8_[i];
  if (q8.n >= 0) return few_rows_q8(x, w[0], w[1], w[2], q8.format, q8.n, q8.isa, q8.bits);
  return few_rows_gguf(x, w[0], w[1], f);
}

// x [n, hidden]: the new tokens' embeddings; k, v [layers, kv, capacity, d]: the session's cache holding
// `start` tokens, written at start .. start + n - 1; cos, sin [n, d]. Returns the last layer's output [n, hidden].
torch::Tensor LayerStack::forward(torch::Tensor x, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                                  torch::Tensor sin, int64_t start) const {
  return forward_batch(x, {k}, {v}, cos, sin, {start}, {x.size(0)});
}

// Several sessions' rows in one pass: x [rows, hidden], session i's rows following session i - 1's, ns[i] of them,
// its cache ks[i], vs[i] [layers, kv, capacity, d] holding starts[i] tokens; cos, sin [rows, d] at each row's own
// position. The products read each weight once for all rows; attention runs per session over its own cache.
torch::Tensor LayerStack::forward_batch(torch::Tensor x, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                                        torch::Tensor cos, torch::Tensor sin, std::vector<int64_t> starts,
                                        std::vector<int64_t> ns) const {
  const size_t layers = norms_.size() / 2;
  for (size_t i = 0; i < ks.size(); i++)
    TORCH_CHECK(ks[i].dim() == 4 && ks[i].size(0) == (int64_t)layers && vs[i].sizes() == ks[i].sizes() &&
                ks[i].size(1) == ks[0].size(1) && ks[i].size(3) == ks[0].size(3),
                "LayerStack: k and v [layers, kv, capacity, d], the same kv and d for every session");
  TORCH_CHECK(!ks.empty(), "LayerStack: a pass needs a session");
  check_rows(x, cos, sin);
  const int64_t rows = x.size(0), kv = ks[0].size(1), d = ks[0].size(3);
  TORCH_CHECK(cos.size(0) == rows && cos.size(1) == d && sin.sizes() == cos.sizes(), "LayerStack: cos and sin [rows, d]");
  for (size_t i = 0; i < layers; i++) {
    auto qkv = product(rms_norm(x, norms_[2 * i], eps_), 4 * i);
    TORCH_CHECK(qkv.size(1) == (heads_ + 2 * kv) * d, "LayerStack: the QKV product does not match the cache");
    auto att = torch::empty({rows, heads_ * d}, x.options());
    attend_caches(qkv, cos, sin, ks, vs, starts, ns, i, heads_, att);
    x = x + product(att, 4 * i + 1);
    x = x + product(silu_mul(product(rms_norm(x, norms_[2 * i + 1], eps_), 4 * i + 2)), 4 * i + 3);
  }
  return x;
}
