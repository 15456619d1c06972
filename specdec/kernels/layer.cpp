// The work of a decoder layer between its products, for a step or a verify pass (a few rows), in
// float32 on CPU: RMS norm, rotary embedding + KV-cache write + causal attention, SiLU gate.
//
// In eager PyTorch this glue is ~90 small ops a layer, each a few microseconds of dispatch for
// nanoseconds of arithmetic: 7-9 ms of the embedded target's 26-29 ms pass, and most of a small
// draft's step. Here it is three calls a layer. Same arithmetic as the torch functions in
// specdec/lean_llama.py (the reference the tests hold these to), summed in another order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "layer.h"
#include "vec.h"

static void check_cpu_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(),
              name, " must be a contiguous float32 tensor on CPU");
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

// One query row of one head against keys 0 .. len-1: out = softmax(q k^T / sqrt(d)) v. DV = d / 16.
template <int DV>
static void attend_row(const float* q, const float* K, const float* V, int64_t len, float scale, float* s,
                       float* out) {
  vec qv[DV], ov[DV];
  for (int c = 0; c < DV; c++) qv[c] = load(q + 16 * c) * scale, ov[c] = vec{};
  float mx = -INFINITY;
  for (int64_t u = 0; u < len; u++) {
    const float* k = K + u * 16 * DV;
    vec acc = qv[0] * load(k);
    for (int c = 1; c < DV; c++) acc += qv[c] * load(k + 16 * c);
    s[u] = lane_sum(acc);
    mx = s[u] > mx ? s[u] : mx;
  }
  int64_t u = 0;
  vec total{};
  for (; u + 16 <= len; u += 16) {
    const vec e = exp_nonpositive(load(s + u) - mx);
    store(s + u, e);
    total += e;
  }
  float sum = lane_sum(total);
  for (; u < len; u++) sum += (s[u] = std::exp(s[u] - mx));
  for (int64_t u = 0; u < len; u++) {
    const float* v = V + u * 16 * DV;
    for (int c = 0; c < DV; c++) ov[c] += s[u] * load(v + 16 * c);
  }
  const float inv = 1.0f / sum;
  for (int c = 0; c < DV; c++) store(out + 16 * c, ov[c] * inv);
}

static void attend_row_any(const float* q, const float* K, const float* V, int64_t len, int64_t d, float scale,
                           float* s, float* out) {
  float mx = -INFINITY;
  for (int64_t u = 0; u < len; u++) {
    float acc = 0;
    for (int64_t c = 0; c < d; c++) acc += q[c] * K[u * d + c];
    s[u] = acc * scale;
    mx = s[u] > mx ? s[u] : mx;
  }
  float sum = 0;
  for (int64_t u = 0; u < len; u++) sum += (s[u] = std::exp(s[u] - mx));
  for (int64_t c = 0; c < d; c++) out[c] = 0;
  for (int64_t u = 0; u < len; u++)
    for (int64_t c = 0; c < d; c++) out[c] += s[u] * V[u * d + c];
  for (int64_t c = 0; c < d; c++) out[c] /= sum;
}

// qkv [n, (h + 2 kv) d]: the new tokens' projections; k, v [kv, capacity, d]: one layer of the cache,
// holding `start` tokens; cos, sin [n, d]: the new positions' rotary tables. Writes the new keys
// (rotated) and values at start .. start + n - 1 and returns the attention of the rotated queries,
// each new token seeing every earlier one and itself: [n, h d]. Query head a reads KV head a / (h / kv).
torch::Tensor attend(torch::Tensor qkv, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                     int64_t start, int64_t h) {
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  for (auto [t, name] : {std::pair{&qkv, "attend: qkv"}, {&k, "attend: k"}, {&v, "attend: v"},
                         {&cos, "attend: cos"}, {&sin, "attend: sin"}})
    check_cpu_float(*t, name);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "attend: k and v [kv, capacity, d]");
  const int64_t n = qkv.size(0), kv = k.size(0), cap = k.size(1), d = k.size(2), end = start + n;
  TORCH_CHECK(h % kv == 0 && qkv.size(1) == (h + 2 * kv) * d && cos.size(0) == n && cos.size(1) == d &&
              sin.sizes() == cos.sizes() && d % 2 == 0, "attend: shapes do not match");
  TORCH_CHECK(start >= 0 && end <= cap, "attend: ", end, " tokens exceed the cache's capacity of ", cap);
  const int64_t group = h / kv, width = (h + 2 * kv) * d;
  const float *x = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t j = 0; j < n; j++)
    for (int64_t b = 0; b < kv; b++) {
      float* row = kp + (b * cap + start + j) * d;
      rope(x + j * width + (h + b) * d, cp + j * d, sp + j * d, row, d);
      std::memcpy(vp + (b * cap + start + j) * d, x + j * width + (h + kv + b) * d, d * sizeof(float));
    }
  auto out = torch::empty({n, h * d}, qkv.options());
  float* op = out.data_ptr<float>();
  const float scale = 1.0f / std::sqrt((float)d);
  auto work = [&](int64_t lo, int64_t hi) {
    std::vector<float> q(d), s(end);
    for (int64_t t = lo; t < hi; t++) {
      const int64_t a = t / n, j = t % n, b = a / group, len = start + j + 1;
      rope(x + j * width + a * d, cp + j * d, sp + j * d, q.data(), d);
      const float *K = kp + b * cap * d, *V = vp + b * cap * d;
      float* o = op + j * h * d + a * d;
      switch (d % 16 ? 0 : d / 16) {
#define DV(c) case c: attend_row<c>(q.data(), K, V, len, scale, s.data(), o); break;
        DV(1) DV(2) DV(3) DV(4) DV(5) DV(6) DV(7) DV(8)
#undef DV
        default: attend_row_any(q.data(), K, V, len, d, scale, s.data(), o);
      }
    }
  };
  // A short context is a few microseconds of work: waking the other threads would cost more.
  if (h * n * end * d < (1 << 16)) work(0, h * n);
  else at::parallel_for(0, h * n, 1, work);
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

// All the layers of a Llama pass in one call, with every product in specdec's kernels: the operations of
// LeanLlamaRunner.forward's Python loop, in the same order, so the same values bit for bit, without its ten
// Python calls a layer. Those are cheap warm (3% of a draft step) and not in the services, where each model
// runs cold after the other's passes: there a draft step went from 1.04-1.12 to 0.93-0.95 ms, a target step
// from 7.30-7.47 to 6.75-7.06 ms (2-core VM).
// norms: ln1 and ln2 of each layer; weights and forms: each layer's four products (QKV, O, gate/up, down),
// a product's tensors and its form: "fewrow" (w), "int8" (w, scale) or a GGUF block format (q, scales).
LayerStack::LayerStack(std::vector<torch::Tensor> norms, std::vector<std::vector<torch::Tensor>> weights,
                       std::vector<std::string> forms, int64_t heads, double eps)
    : norms_(std::move(norms)), weights_(std::move(weights)), forms_(std::move(forms)), heads_(heads), eps_(eps) {
  TORCH_CHECK(norms_.size() % 2 == 0 && weights_.size() == 2 * norms_.size() && forms_.size() == weights_.size(),
              "LayerStack: two norms and four products a layer");
  for (size_t i = 0; i < forms_.size(); i++) {
    const auto& f = forms_[i];
    const size_t n = f == "fewrow" ? 1 : 2;
    TORCH_CHECK(f == "fewrow" || f == "int8" || f == "Q4_1" || f == "Q8_0", "LayerStack: unknown form ", f);
    TORCH_CHECK(weights_[i].size() == n, "LayerStack: form ", f, " takes ", n, " tensors");
  }
}

torch::Tensor LayerStack::product(const torch::Tensor& x, size_t i) const {
  const auto& w = weights_[i];
  const auto& f = forms_[i];
  if (f == "fewrow") return few_rows(x, w[0]);
  if (f == "int8") return few_rows_int8(x, w[0], w[1]);
  return few_rows_gguf(x, w[0], w[1], f);
}

// x [n, hidden]: the new tokens' embeddings; k, v [layers, kv, capacity, d]: the session's cache holding
// `start` tokens, written at start .. start + n - 1; cos, sin [n, d]. Returns the last layer's output [n, hidden].
torch::Tensor LayerStack::forward(torch::Tensor x, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                                  torch::Tensor sin, int64_t start) const {
  const size_t layers = norms_.size() / 2;
  TORCH_CHECK(k.dim() == 4 && k.size(0) == (int64_t)layers && v.sizes() == k.sizes(),
              "LayerStack: k and v [layers, kv, capacity, d]");
  for (size_t i = 0; i < layers; i++) {
    auto att = attend(product(rms_norm(x, norms_[2 * i], eps_), 4 * i), k.select(0, i), v.select(0, i), cos, sin,
                      start, heads_);
    x = x + product(att, 4 * i + 1);
    x = x + product(silu_mul(product(rms_norm(x, norms_[2 * i + 1], eps_), 4 * i + 2)), 4 * i + 3);
  }
  return x;
}
