// specdec's CPU kernels, one extension module: products.cpp (few-row products), q8_products.cpp (products with
// x quantized to 8 or 16 bits), layer.cpp (the work
// between them) and sampling.cpp (argmax and sampling distributions of the logits). Built on first use
// by specdec/kernels/__init__.py.
#include <torch/extension.h>

#include "layer.h"

torch::Tensor few_rows(torch::Tensor x, torch::Tensor w);
torch::Tensor few_rows_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale);
torch::Tensor few_rows_gguf(torch::Tensor x, torch::Tensor q, torch::Tensor scales, const std::string& format);
torch::Tensor few_rows_q8(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor extra,
                          const std::string& format, int64_t N, const std::string& isa, int64_t bits);
std::vector<torch::Tensor> quantize_q8(torch::Tensor x, int64_t bits);
std::vector<std::string> q8_isas();
int64_t q8_amx_rows(const std::string& format, int64_t n, int64_t k, int64_t rows);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor attend(torch::Tensor qkv, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                     int64_t start, int64_t h);
torch::Tensor attend_batch(torch::Tensor qkv, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                           torch::Tensor cos, torch::Tensor sin, std::vector<int64_t> starts, std::vector<int64_t> ns,
                           int64_t h);
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor sampling_probs(torch::Tensor logits, double temperature, int64_t top_k, double top_p,
                             double min_p_floor);
torch::Tensor argmax_rows(torch::Tensor logits);
std::vector<std::pair<torch::Tensor, torch::Tensor>> support_rows(torch::Tensor probs);
std::vector<int64_t> inverse_cdf(torch::Tensor probs, const std::vector<double>& u);
void mask_rows(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor columns);

// The products, attention and a pass's layers work on tensors alone and let go of the GIL while they run: the
// server's other threads (gRPC's poller among them) read the requests that arrive meanwhile, and those join
// the next pass. The small calls keep it: taking it back can wait on another thread.
using nogil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("few_rows", &few_rows, "x @ w^T for a few rows of x (float32, CPU)", nogil());
  m.def("few_rows_int8", &few_rows_int8, "x @ (w * scale)^T for a few rows of x, w int8 with a scale per row", nogil());
  m.def("few_rows_gguf", &few_rows_gguf, "x @ w^T for a few rows of x, w a GGUF tensor's Q4_1 or Q8_0 blocks (split_blocks)", nogil());
  m.def("few_rows_q8", &few_rows_q8, "x @ w^T with x quantized to 8 or 16 bits in blocks of 32, w in q8_blocks' tiles",
        py::arg("x"), py::arg("w"), py::arg("d"), py::arg("extra"), py::arg("format"), py::arg("n"), py::arg("isa"),
        py::arg("bits") = 8, nogil());
  m.def("quantize_q8", &quantize_q8, "x's rows in blocks of 32: q (8 or 16 bits), scale d and the integer sum of q",
        py::arg("x"), py::arg("bits") = 8);
  m.def("q8_isas", &q8_isas, "the instruction-set forms of few_rows_q8 this build runs, best first");
  m.def("q8_amx_rows", &q8_amx_rows, "how many of a product's rows the amx form multiplies on the tiles");
  m.def("rms_norm", &rms_norm, "RMS norm of each row of x, times w");
  m.def("attend", &attend, "rotary embedding, KV-cache write and causal attention of a few new tokens", nogil());
  m.def("attend_batch", &attend_batch, "attend for several sessions' rows, each over its own cache, in one call", nogil());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of side-by-side gate and up projections");
  m.def("sampling_probs", &sampling_probs, "temperature, min-p, top-k, top-p and softmax of each row of logits");
  m.def("argmax_rows", &argmax_rows, "the index of each row's largest value, the first of ties");
  m.def("support_rows", &support_rows, "each row's nonzero entries: (ids int64, probs float64), ids ascending");
  m.def("inverse_cdf", &inverse_cdf, "inverse-CDF draws from one distribution, as numpy's float64 cumsum gives them");
  m.def("mask_rows", &mask_rows, "-inf where a grammar's packed bitmask refuses a row's token, in place");
  py::class_<LayerStack>(m, "LayerStack", "all the layers of a Llama pass in one call, products in these kernels")
      .def(py::init<std::vector<torch::Tensor>, std::vector<std::vector<torch::Tensor>>, std::vector<std::string>,
                    int64_t, double>())
      .def("forward", &LayerStack::forward, "x [n, hidden] through every layer, writing the cache at start", nogil())
      .def("forward_batch", &LayerStack::forward_batch,
           "several sessions' rows through every layer, each session's attention over its own cache", nogil());
}
