// A server's per-pass work on its logits rows, in float32 on CPU: greedy's argmax, and sampling's
// distribution (temperature, min-p, top-k, top-p, softmax) over the whole vocabulary.
//
// In eager PyTorch the distribution of one 49,152-token row took 0.37 ms (most of it top-k searches
// for the nucleus) and an argmax 0.07 ms, several times that in the services where the row is cold: a
// draft sampling K tokens pays it K times a round, a verify once per row. Here each is a few passes
// over the row. Same transform as specdec.sampling.logits_to_probs_torch, the reference the tests
// hold this to, summed in another order. A sampled row's nonzero tokens are a few hundred at most: the
// scans that look for them (the nucleus, support_rows) test 16 columns at once and skip empty blocks.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "vec.h"

static const float kInf = std::numeric_limits<float>::infinity();

// e^x of a shifted score x <= 0, and 0 where expf underflows to (nearly) nothing: below -87.3 expf gives
// a denormal that no float sum notices, and a token that is not in a distribution must have exactly 0.
static inline float exp_shifted(float x) { return x < -87.3f ? 0.0f : std::exp(x); }

// Calls at(i) for each column i of x [V] in a block of 16 where some lane passes hit (a vector test), and for each
// column past the last whole block; at tests the column itself. A sampled row's few hundred nonzero tokens are so
// found without looking at 49,152 columns one by one.
template <class Hit, class At>
static inline void scan_blocks(const float* x, int64_t V, Hit hit, At at) {
  const int64_t V16 = V - V % 16;
  for (int64_t i = 0; i < V16; i += 16)
    if (any16(hit(load16(x + i))))
      for (int j = 0; j < 16; j++) at(i + j);
  for (int64_t i = V16; i < V; i++) at(i);
}

// One row: out = softmax of (logits / temperature) over the kept tokens, 0 elsewhere. Top-k keeps every
// token tied with the k-th; top-p keeps a token while the mass of the tokens more likely than it is below
// top_p (so the smallest set of most likely tokens whose mass reaches top_p).
static void row_probs(const float* logits, float* out, int64_t V, float temperature, int64_t top_k, float top_p,
                      float min_p_floor, std::vector<float>& scratch, std::vector<std::pair<float, int64_t>>& found) {
  const int64_t V16 = V - V % 16;
  f16 mv = splat16(-kInf);
  const f16 tv = splat16(temperature);
  for (int64_t i = 0; i < V16; i += 16) {
    const f16 x = load16(logits + i) / tv;
    store16(out + i, x);
    mv = max16(x, mv);
  }
  float mx = lane_max(mv);
  for (int64_t i = V16; i < V; i++) {
    out[i] = logits[i] / temperature;
    mx = std::max(mx, out[i]);
  }
  // Scores below the floor are dropped; -inf scores always are. Min-p: below the best by more than log(min_p)
  // (min_p_floor, from specdec.sampling.min_p_floor: the same float32 the reference adds).
  float floor = min_p_floor > -kInf ? mx + min_p_floor : -kInf;
  if (top_k > 0 && top_k < V) {
    scratch.assign(out, out + V);
    std::nth_element(scratch.begin(), scratch.begin() + (top_k - 1), scratch.end(), std::greater<float>());
    floor = std::max(floor, scratch[top_k - 1]);
  }
  // e = exp(x - max) where kept, else 0; the row's maximum has e = 1
  f16 sv = splat16(0.0f);
  const f16 fv = splat16(floor), ninf = splat16(-kInf), under = splat16(-87.3f), zero = splat16(0.0f);
  const f16 mxv = splat16(mx);
  for (int64_t i = 0; i < V16; i += 16) {
    const f16 x = load16(out + i), d = x - mxv;
    const f16 e = select16((x >= fv) & (x > ninf) & (d >= under), exp16(d), zero);
    store16(out + i, e);
    sv = sv + e;
  }
  float sum = lane_sum(sv);
  for (int64_t i = V16; i < V; i++) {
    const float x = out[i];
    out[i] = x >= floor && x > -kInf ? exp_shifted(x - mx) : 0.0f;
    sum += out[i];
  }
  if (top_p < 1.0f) {
    // The nucleus is a prefix of the row sorted by probability. Gather the tokens above a threshold; once
    // their mass reaches top_p the prefix lies among them (every token left out is less likely than every
    // one gathered), so only they are sorted. Most rows need one gathering of a few dozen tokens.
    const double target = (double)top_p * sum;  // in units of e; sums of many tokens in double
    for (float t = 1.0f / 1024;; t /= 64) {
      if (t < 1e-30f) t = 0.0f;
      found.clear();
      double mass = 0.0;
      const f16 tv = splat16(t), zero = splat16(0.0f);
      scan_blocks(out, V, [&](f16 x) { return (x > zero) & (x >= tv); }, [&](int64_t i) {
        if (out[i] > 0.0f && out[i] >= t) {
          found.emplace_back(out[i], i);
          mass += out[i];
        }
      });
      if (mass >= target || t == 0.0f) break;
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    std::fill(out, out + V, 0.0f);
    double before = 0.0;
    size_t kept = 0;
    for (const auto& [e, i] : found) {
      if (before >= target) break;
      before += e;
      kept++;
    }
    const float inv = 1.0f / (float)before;  // the nucleus alone is normalized: every other token is 0
    if (kept == 0) std::fill(out, out + V, 0.0f * inv);  // a row of -inf: NaN, as softmax gives it
    for (size_t k = 0; k < kept; k++) out[found[k].second] = found[k].first * inv;
    return;
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < V16; i += 16) store(out + i, load(out + i) * inv);
  for (int64_t i = V16; i < V; i++) out[i] *= inv;
}

// logits [n, V] -> probs [n, V]; temperature > 0, top_k 0 (off) or more, top_p in (0, 1], min_p_floor log(min_p)
// (-inf: off).
torch::Tensor sampling_probs(torch::Tensor logits, double temperature, int64_t top_k, double top_p,
                             double min_p_floor) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.device().is_cpu(),
              "sampling_probs: logits must be a float32 [n, vocab] tensor on CPU");
  TORCH_CHECK(temperature > 0 && top_k >= 0 && top_p > 0 && top_p <= 1 && min_p_floor <= 0,
              "sampling_probs: temperature > 0, top_k >= 0, top_p in (0, 1] and min_p_floor <= 0");
  logits = logits.contiguous();
  const int64_t n = logits.size(0), V = logits.size(1);
  auto probs = torch::empty_like(logits);
  const float* lp = logits.data_ptr<float>();
  float* pp = probs.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<std::pair<float, int64_t>> found;
    for (int64_t r = begin; r < end; r++)
      row_probs(lp + r * V, pp + r * V, V, (float)temperature, top_k, (float)top_p, (float)min_p_floor, scratch,
                found);
  });
  return probs;
}

// Each row's nonzero entries, ids ascending, as sampling.support gives them: [n, V] float32 -> n pairs (ids int64,
// probs float64). A sampled row's support is its nucleus, tens to hundreds of tokens of 49,152 (scan_blocks).
// torch.nonzero and the gather after it took 60 us a row warm and 120 cold, a verify's K + 1 rows and a draft's
// every step each paying it.
std::vector<std::pair<torch::Tensor, torch::Tensor>> support_rows(torch::Tensor probs) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat && probs.device().is_cpu(),
              "support_rows: probs must be a float32 [n, vocab] tensor on CPU");
  probs = probs.contiguous();
  const int64_t n = probs.size(0), V = probs.size(1);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  std::vector<int64_t> ids;
  const f16 zero = splat16(0.0f);
  for (int64_t r = 0; r < n; r++) {
    const float* x = probs.data_ptr<float>() + r * V;
    ids.clear();
    scan_blocks(x, V, [&](f16 v) { return v != zero; }, [&](int64_t i) {
      if (x[i] != 0.0f) ids.push_back(i);
    });
    const int64_t m = (int64_t)ids.size();
    auto id_t = torch::empty({m}, torch::kLong);
    auto p_t = torch::empty({m}, torch::kDouble);
    int64_t* ip = id_t.data_ptr<int64_t>();
    double* pp = p_t.data_ptr<double>();
    for (int64_t k = 0; k < m; k++) {
      ip[k] = ids[k];
      pp[k] = (double)x[ids[k]];
    }
    out.emplace_back(id_t, p_t);
  }
  return out;
}

// Inverse-CDF draws from one distribution over its columns, as numpy's cumsum in float64 then searchsorted (right)
// give them: for each u, the first column whose sequential float64 running sum exceeds u * total, or the last
// nonzero column where none does. A zero adds nothing to the running sum, so blocks of 16 zeros are skipped and
// the sum after each block is kept; a draw finds its block among those sums and walks that block alone, adding
// the same values in the same order. probs: float32 [V]; u: m draws -> m columns; none where the row is not finite
// and nonnegative with some mass (the caller's numpy answers then).
std::vector<int64_t> inverse_cdf(torch::Tensor probs, const std::vector<double>& u) {
  TORCH_CHECK(probs.dim() == 1 && probs.scalar_type() == torch::kFloat && probs.device().is_cpu(),
              "inverse_cdf: probs must be a float32 [vocab] tensor on CPU");
  probs = probs.contiguous();
  const float* x = probs.data_ptr<float>();
  const int64_t V = probs.size(0), blocks = (V + 15) / 16, m = (int64_t)u.size();
  std::vector<double> ends(blocks);
  double total = 0.0;
  int64_t last = -1;
  bool ok = true;
  const f16 zero = splat16(0.0f);
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t i0 = 16 * b, i1 = std::min(i0 + 16, V);
    if (i1 - i0 == 16 && !any16(load16(x + i0) != zero)) {
      ends[b] = total;
      continue;
    }
    for (int64_t i = i0; i < i1; i++)
      if (x[i] != 0.0f) {
        ok = ok && x[i] > 0.0f && x[i] < kInf;
        total += (double)x[i];
        last = i;
      }
    ends[b] = total;
  }
  if (!ok || last < 0 || !std::isfinite(total)) return {};
  std::vector<int64_t> out(m);
  for (int64_t k = 0; k < m; k++) {
    const double t = u[k] * total;
    const int64_t b = std::upper_bound(ends.begin(), ends.end(), t) - ends.begin();
    if (b == blocks) {  // u * total rounded onto the last step
      out[k] = last;
      continue;
    }
    double c = b ? ends[b - 1] : 0.0;
    int64_t i = 16 * b;
    for (; i < V; i++)
      if (x[i] != 0.0f && (c += (double)x[i]) > t) break;
    out[k] = i;
  }
  return out;
}

// The index of each row's largest value, the first where several tie (as torch.argmax): [n, V] -> [n] int64.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.device().is_cpu() &&
              logits.size(1) > 0, "argmax_rows: logits must be a float32 [n, vocab] tensor on CPU");
  logits = logits.contiguous();
  const int64_t n = logits.size(0), V = logits.size(1), V16 = V - V % 16;
  auto out = torch::empty({n}, logits.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; r++) {
    const float* x = logits.data_ptr<float>() + r * V;
    f16 mv = splat16(-kInf);
    for (int64_t i = 0; i < V16; i += 16) mv = max16(load16(x + i), mv);
    float mx = V16 ? lane_max(mv) : -kInf;
    for (int64_t i = V16; i < V; i++) mx = std::max(mx, x[i]);
    int64_t at = 0;
    while (at < V && !(x[at] == mx)) at++;
    op[r] = at < V ? at : 0;  // a row of NaNs: 0
  }
  return out;
}

// 32 columns under one bitmask word: -inf where its bit is 0. A grammar's mask is mostly whole words of ones
// (skipped) or zeros (filled); a mixed word is a select per lane, which vectorizes (a branch per bit cost 30 us a
// 49,152-token row warm, 45 cold).
static inline void mask_word(float* x, uint32_t b) {
  if (b == 0xFFFFFFFFu) return;
  if (b == 0) {
    for (int j = 0; j < 32; j++) x[j] = -kInf;
    return;
  }
  for (int j = 0; j < 32; j++) x[j] = (b >> j) & 1u ? x[j] : -kInf;
}

// A grammar's mask on the rows, in place: -inf in column c of row r where bit t of bitmask[r] is 0, t the column's
// token (columns[c], or c itself when columns is empty: a full row). llguidance's bitmask: bit j of word w is token
// 32 w + j. Unpacking the row in numpy then masking took 0.06 ms of a 0.3 ms masked row in the services.
void mask_rows(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor columns) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.device().is_cpu() &&
                  logits.is_contiguous(),
              "mask_rows: logits must be a contiguous float32 [n, columns] tensor on CPU");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt && bitmask.size(0) == logits.size(0) &&
                  bitmask.stride(1) == 1,
              "mask_rows: bitmask must be int32 [n, words], one row per logits row");
  const int64_t n = logits.size(0), C = logits.size(1), words = bitmask.size(1);
  const bool full = columns.numel() == 0;
  TORCH_CHECK(full || (columns.scalar_type() == torch::kLong && columns.numel() == C && columns.is_contiguous()),
              "mask_rows: columns must be empty or int64 [columns]");
  const int64_t* ids = full ? nullptr : columns.data_ptr<int64_t>();
  TORCH_CHECK(full ? C <= 32 * words : true, "mask_rows: the bitmask is shorter than the row");
  for (int64_t r = 0; r < n; r++) {
    float* x = logits.data_ptr<float>() + r * C;
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>() + r * bitmask.stride(0));
    if (full) {
      const int64_t whole = C / 32;
      for (int64_t w = 0; w < whole; w++) mask_word(x + w * 32, bits[w]);
      for (int64_t c = whole * 32; c < C; c++)
        if (!((bits[c >> 5] >> (c & 31)) & 1u)) x[c] = -kInf;
    } else {
      for (int64_t c = 0; c < C; c++) {
        const int64_t t = ids[c];
        TORCH_CHECK(t >= 0 && t < 32 * words, "mask_rows: a column's token is outside the bitmask");
        if (!((bits[t >> 5] >> (t & 31)) & 1u)) x[c] = -kInf;
      }
    }
  }
}
