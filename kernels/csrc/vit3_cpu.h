// What the ops of the C++ CPU extension vit3_cpu share (kernels/cpp.py builds every op's csrc/*.cpp into it, listed in
// its FILES; ops torch.ops.vit3_cpu.*): the vector type,
// the inner step and its backward (kernels/common.py's step, on the small per-(sample, head) problems), the
// float32/float64 checks, and each op's step functions, which the whole-mixer op (mix.cpp) calls directly.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace vit3_cpu {

using at::Tensor;

// Whether a call of a C++ autograd node would record one: gradients enabled and some input requiring one
// (an absent optional input is an undefined tensor).
inline bool records_grad(std::initializer_list<Tensor> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const auto& t : inputs) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

// The handle of an op of this library (vit3_cpu::<name>) as typed by Signature; a caller keeps it in a static.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op_of(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The gradients of a once-differentiable C++ node's backward, as Python's @once_differentiable: where the backward
// runs with create_graph=True they come back attached to a node whose own backward raises, naming `node`.
inline std::vector<Tensor> once_differentiable(std::vector<Tensor> grads, bool create_graph, const std::string& node) {
  if (!create_graph) return grads;
  for (auto& g : grads) {
    if (g.defined()) g = g.detach().requires_grad_(true);
  }
  return torch::autograd::DelayedError(node + " is once differentiable: no second backward through it", grads.size())
      .apply(std::move(grads));
}

template <typename T>
using Vec = at::vec::Vectorized<T>;

// The inner step on problems of [rows, cols] (contiguous, one after another): G <- -c G (the -c of E = -c v),
// n_j = ||G[:, j]||, W' = W - lr G / (n + 1), or W - lr G without the normalisation (n = 0 then). Tiny next to
// the passes; here so that a step costs no Python and no ATen calls. The formula is kernels/common.py's step.
template <typename T>
inline void step_impl(const Tensor& g, const Tensor& w, const Tensor& w_new, const Tensor& norm, int64_t rows, T c, T lr, bool grad_norm) {
  const int64_t cols = g.size(-1), problems = g.numel() / (rows * cols);
  T *G = g.data_ptr<T>(), *Wn = w_new.data_ptr<T>(), *Nm = norm.data_ptr<T>();
  const T* W = w.data_ptr<T>();
  for (int64_t p = 0; p < problems; ++p) {
    T *gp = G + p * rows * cols, *wn = Wn + p * rows * cols, *n = Nm + p * cols;
    const T* wp = W + p * rows * cols;
    for (int64_t j = 0; j < cols; ++j) n[j] = T(0);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const T v = gp[i * cols + j] * -c;
        gp[i * cols + j] = v;
        n[j] += v * v;
      }
    }
    for (int64_t j = 0; j < cols; ++j) n[j] = grad_norm ? std::sqrt(n[j]) : T(0);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const T gv = gp[i * cols + j];
        wn[i * cols + j] = wp[i * cols + j] - lr * (grad_norm ? gv / (n[j] + T(1)) : gv);
      }
    }
  }
}

// dL/dG from dL/dW' through step_impl, times -c, into out (row stride out_cols, first column 0):
// dĜ = -lr dW'; dG = dĜ / (n + 1) - G (G·dĜ)_j / (n_j (n_j + 1)²) (the second term vanishes with G where n = 0).
template <typename T>
inline void step_backward_impl(
    const Tensor& dw, const Tensor& g, const Tensor& norm, T* out, int64_t out_cols, int64_t rows, T c, T lr, bool grad_norm) {
  const int64_t cols = g.size(-1), problems = g.numel() / (rows * cols);
  const T *DW = dw.data_ptr<T>(), *G = g.data_ptr<T>(), *Nm = norm.data_ptr<T>();
  std::vector<T> coef(cols), inv(cols);  // inv: n + 1
  for (int64_t p = 0; p < problems; ++p) {
    const T *dwp = DW + p * rows * cols, *gp = G + p * rows * cols, *n = Nm + p * cols;
    T* op = out + p * rows * out_cols;
    for (int64_t j = 0; j < cols; ++j) coef[j] = T(0);
    if (grad_norm) {
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) coef[j] += gp[i * cols + j] * (dwp[i * cols + j] * -lr);
      }
      for (int64_t j = 0; j < cols; ++j) {
        const T n1 = n[j] + T(1);
        inv[j] = n1;
        coef[j] = coef[j] / (std::max(n[j], T(1e-30)) * (n1 * n1));
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const T dg_hat = dwp[i * cols + j] * -lr;
        const T dg = grad_norm ? dg_hat / inv[j] - gp[i * cols + j] * coef[j] : dg_hat;
        op[i * out_cols + j] = dg * -c;
      }
    }
  }
}

#define VIT3_DISPATCH(t, name, ...)                                  \
  if ((t).scalar_type() == at::kFloat) {                             \
    name<float>(__VA_ARGS__);                                        \
  } else if ((t).scalar_type() == at::kDouble) {                     \
    name<double>(__VA_ARGS__);                                       \
  } else {                                                           \
    TORCH_CHECK(false, "vit3_cpu: float32 or float64, got ", (t).scalar_type()); \
  }

inline void check_float(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "vit3_cpu: float32 or float64, got ",
              t.scalar_type());
}

// The SwiGLU op's step (swiglu.cpp; the ops ttt_forward / ttt_backward): q, k, v [B, H, N, d] with unit stride
// along d, w1, w2 [1|B, H, d, d]; returns w = [W1 | W2], G, the column norms and W'; the backward returns dW
// [B, H, d, 2d] per sample and writes dq, dk, dv.
std::vector<Tensor> ttt_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& w1, const Tensor& w2,
                                Tensor out, const std::optional<Tensor>& z, const std::optional<Tensor>& y, double c,
                                double lr, bool grad_norm, int64_t block);
Tensor ttt_backward(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v,
                    const std::optional<Tensor>& z, const std::optional<Tensor>& y, const Tensor& w, const Tensor& g,
                    const Tensor& norm, const Tensor& w_new, Tensor dq, Tensor dk, Tensor dv, double c, double lr,
                    bool grad_norm, int64_t block);

// The 3x3 depthwise convolution on token rows (dwconv.cpp; the ops dwconv / dwconv_weight_grad): x, out [B, N, C]
// with unit stride along C on an gh x gw grid, taps w [1|B, 9, C] or a weight [C, 1, 3, 3]; out = dwconv(x) (+ bias)
// (+ x where residual); the taps' gradient per sample [B, 9, C] into gw_out.
void dwconv(const Tensor& x, const Tensor& w, Tensor out, int64_t gh, int64_t gw, const std::optional<Tensor>& bias,
            bool residual);
void dwconv_weight_grad(const Tensor& g, const Tensor& x, Tensor gw_out, int64_t gh, int64_t gw);

// The depthwise op's step on token rows (dwconv.cpp; the ops dwconv_ttt_forward / dwconv_ttt_backward): q, k, v
// [B, N, C] with unit stride along C, weight [1|B, C, 3, 3]; returns G, the norms and W' (taps [B, 9, C]); the
// backward returns dW' [B, 9, C] (taps) per sample and writes dq, dk, dv.
std::vector<Tensor> dwconv_ttt_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& weight,
                                       Tensor out, int64_t gh, int64_t gw, double c, double lr, bool grad_norm);
Tensor dwconv_ttt_backward(const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                           const Tensor& norm, const Tensor& w_new, Tensor dq, Tensor dk, Tensor dv, int64_t gh,
                           int64_t gw, double c, double lr, bool grad_norm);

}  // namespace vit3_cpu
