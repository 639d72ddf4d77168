// y = x @ w.T through cuBLASLt with an algorithm the caller chose, for bf16 row-major x [m, k], w [n, k], y [m, n].
//
// torch's F.linear asks cuBLAS for its one heuristic pick per shape. For the skinny shapes of decode steps
// (a few hundred rows against a projection's weights) that pick can leave SMs idle: bench/gemm_algos.py times
// every candidate cuBLASLt's heuristic lists against it. An algorithm is 64 opaque bytes
// (cublasLtMatmulAlgo_t): it travels as 8 int64s in a CPU tensor.
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>
#include <torch/extension.h>

#include <cstring>
#include <vector>

#define LT_CHECK(expr)                                                                                  \
  do {                                                                                                  \
    cublasStatus_t status_ = (expr);                                                                    \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, #expr " failed: ", cublasLtGetStatusString(status_)); \
  } while (0)

namespace {

// The descriptors of one problem in cuBLASLt's column-major terms: y.T [n, m] = w [k, n].T @ x.T [k, m].
struct Problem {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;

  Problem(int64_t m, int64_t n, int64_t k) {
    LT_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t transpose = CUBLAS_OP_T;
    LT_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
    LT_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, k, n, k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, k, m, k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, n, m, n));
  }
  ~Problem() {
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatmulDescDestroy(op);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;
};

constexpr int64_t kAlgoWords = sizeof(cublasLtMatmulAlgo_t) / sizeof(int64_t);
static_assert(sizeof(cublasLtMatmulAlgo_t) % sizeof(int64_t) == 0, "an algorithm is whole int64 words");

// Up to `count` candidates for the shape, best first by cuBLASLt's estimate: rows of the algorithm's words,
// then the workspace bytes it needs.
torch::Tensor candidates(int64_t m, int64_t n, int64_t k, int64_t count, int64_t workspace_bytes) {
  TORCH_CHECK(m > 0 && n > 0 && k > 0, "shape must be positive, got m=", m, " n=", n, " k=", k);
  TORCH_CHECK(count > 0, "count must be positive, got ", count);
  Problem problem(m, n, k);
  cublasLtMatmulPreference_t preference;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  uint64_t workspace = static_cast<uint64_t>(workspace_bytes);
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                sizeof(workspace)));
  std::vector<cublasLtMatmulHeuristicResult_t> results(count);
  int found = 0;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), problem.op, problem.a,
                                                         problem.b, problem.c, problem.c, preference, count,
                                                         results.data(), &found);
  cublasLtMatmulPreferenceDestroy(preference);
  LT_CHECK(status);
  auto out = torch::zeros({found, kAlgoWords + 1}, torch::kInt64);
  for (int i = 0; i < found; ++i) {
    std::memcpy(out[i].data_ptr<int64_t>(), &results[i].algo, sizeof(cublasLtMatmulAlgo_t));
    out[i][kAlgoWords] = static_cast<int64_t>(results[i].workspaceSize);
  }
  return out;
}

void matmul(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y, const torch::Tensor& algo,
            torch::Tensor& workspace) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D bf16 CUDA tensor");
  TORCH_CHECK(w.is_cuda() && w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "w must be a contiguous 2-D bf16 CUDA tensor");
  TORCH_CHECK(y.is_cuda() && y.scalar_type() == torch::kBFloat16 && y.is_contiguous(), "y must be contiguous bf16");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.size(1) == k, "x is [", m, ", ", k, "] but w is [", n, ", ", w.size(1), "]");
  TORCH_CHECK(y.size(0) == m && y.size(1) == n, "y must be [", m, ", ", n, "]");
  TORCH_CHECK(!algo.is_cuda() && algo.scalar_type() == torch::kInt64 && algo.numel() >= kAlgoWords,
              "algo must be a CPU int64 tensor of at least ", kAlgoWords, " words");
  TORCH_CHECK(workspace.is_cuda() && workspace.is_contiguous(), "workspace must be a contiguous CUDA tensor");
  Problem problem(m, n, k);
  cublasLtMatmulAlgo_t chosen;
  std::memcpy(&chosen, algo.contiguous().data_ptr<int64_t>(), sizeof(chosen));
  const float alpha = 1.0f, beta = 0.0f;
  LT_CHECK(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), problem.op, &alpha, w.data_ptr(), problem.a,
                          x.data_ptr(), problem.b, &beta, y.data_ptr(), problem.c, y.data_ptr(), problem.c, &chosen,
                          workspace.data_ptr(), workspace.nbytes(), at::cuda::getCurrentCUDAStream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("candidates", &candidates, "cuBLASLt's candidate algorithms for y = x @ w.T (bf16, [m,k] x [n,k])");
  m.def("matmul", &matmul, "y = x @ w.T with a chosen cuBLASLt algorithm");
}
