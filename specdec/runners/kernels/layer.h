// The layers of a Llama pass in one call (layer.cpp).
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

// A product with quantized activations (q8_products.cpp), parsed once from its form "q8:FORMAT:ISA:N:BITS"; n < 0:
// another form.
struct Q8Form {
  std::string format, isa;
  int64_t n = -1, bits = 8;
};

class LayerStack {
 public:
  LayerStack(std::vector<torch::Tensor> norms, std::vector<std::vector<torch::Tensor>> weights,
             std::vector<std::string> forms, int64_t heads, double eps);
  torch::Tensor forward(torch::Tensor x, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                        int64_t start) const;
  torch::Tensor forward_batch(torch::Tensor x, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                              torch::Tensor cos, torch::Tensor sin, std::vector<int64_t> starts,
                              std::vector<int64_t> ns) const;

 private:
  torch::Tensor product(const torch::Tensor& x, size_t i) const;
  std::vector<torch::Tensor> norms_;
  std::vector<std::vector<torch::Tensor>> weights_;
  std::vector<std::string> forms_;
  std::vector<Q8Form> q8_;
  int64_t heads_;
  double eps_;
};
