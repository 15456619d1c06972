// y = x @ w^T for a few rows of x: [M, K] x [N, K] -> [M, N], float32, row-major, on CPU.
//
// A step or a verify pass multiplies 1 to ~9 rows by every weight matrix, so its cost is reading the
// weights once from memory. BLAS GEMMs switch kernels as M grows and lose that roof at a few rows (on
// an AVX-512 Xeon MKL takes 20 ms over the target's matrices at 1-3 rows, 35-48 ms at 4-9). Here each
// weight row is read once and multiplied into all M rows while it is in registers: R output rows at a
// time share each load of x, and the next R rows are prefetched a cache line per step, so the stream
// from memory never waits on the arithmetic. Same products as F.linear, summed in another order.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec.h"

template <int M, int R>
static inline void block(const float* __restrict x, const float* __restrict w, float* __restrict y,
                         int64_t K, int64_t N, int64_t n, int64_t prefetch_end) {
  vec acc[R][M];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) acc[r][m] = vec{};
  const int64_t K16 = K - K % 16;
  for (int64_t k = 0; k < K16; k += 16) {
    vec wv[R];
    for (int r = 0; r < R; r++) wv[r] = load(w + (n + r) * K + k);
    for (int r = 0; r < R; r++)
      if (n + R + r < prefetch_end) __builtin_prefetch(w + (n + R + r) * K + k, 0, 3);
    for (int m = 0; m < M; m++) {
      vec xv = load(x + m * K + k);
      for (int r = 0; r < R; r++) acc[r][m] += xv * wv[r];
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M; m++) {
      float s = lane_sum(acc[r][m]);
      for (int64_t k = K16; k < K; k++) s += x[m * K + k] * w[(n + r) * K + k];
      y[m * N + n + r] = s;
    }
}

template <int M>
static void rows(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t begin, int64_t end) {
  constexpr int fit = (kRegisters - 1) / (M + 1);  // R * M accumulators, R weight vectors, one of x
  constexpr int R = fit < 1 ? 1 : fit > 4 ? 4 : fit;
  int64_t n = begin;
  for (; n + R <= end; n += R) block<M, R>(x, w, y, K, N, n, end);
  for (; n < end; n++) block<M, 1>(x, w, y, K, N, n, end);
}

// Up to 16 rows at a time; more rows take several sweeps over w (the load-time timing sees that cost).
torch::Tensor few_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "few_rows: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && x.device().is_cpu() &&
              w.device().is_cpu(), "few_rows: float32 tensors on CPU");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* wp = w.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows_now = std::min<int64_t>(16, M - m0);
    const float* xp = x.data_ptr<float>() + m0 * K;
    auto part = rows_now == M ? y : torch::empty({rows_now, N}, x.options());
    float* yp = part.data_ptr<float>();
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      switch (rows_now) {
#define ROWS(m) case m: rows<m>(xp, wp, yp, K, N, begin, end); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
        ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
      }
    });
    if (rows_now != M) y.narrow(0, m0, rows_now).copy_(part);
  }
  return y;
}
