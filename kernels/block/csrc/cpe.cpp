// The block's CPE nodes on a CPU: vit3_cpu::cpe, ConvPosEnc's x + dwconv3x3(x) + bias as one C++ autograd node,
// and vit3_cpu::cpe_norm, the CPE and the block's first LayerNorm as one (vit3/layers/blocks.py). Both run on the
// depthwise op's token-row convolution (kernels/dwconv/csrc/dwconv.cpp, declared in vit3_cpu.h). Built into the
// extension vit3_cpu with the block op (ttt_block.cpp) and the lean MLP (lean_mlp.cpp) (kernels/cpp.py).

#include "vit3_cpu.h"

#include <torch/autograd.h>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ConvPosEnc's x + dwconv3x3(x) + bias on a channels-last map x [B, H, W, C] (the weight [C, 1, 3, 3] read as it
// is): the output map and x's token rows [B, N, C] (the backward's input).
std::pair<Tensor, Tensor> cpe_tokens(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  TORCH_CHECK(x.dim() == 4, "vit3_cpu.cpe: x must be a channels-last map [B, H, W, C], got ", x.sizes());
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // in its inputs' dtype
  const int64_t B = x.size(0), gh = x.size(1), gw = x.size(2), C = x.size(3);
  Tensor tokens = x.reshape({B, gh * gw, C});
  if (tokens.stride(-1) != 1) tokens = tokens.contiguous();  // the op reads channel vectors
  Tensor out = at::empty_like(tokens, at::MemoryFormat::Contiguous);
  vit3_cpu::dwconv(tokens, weight.contiguous(), out, gh, gw, bias, true);
  return {out.view({B, gh, gw, C}), tokens};
}

// The gradients of cpe_tokens from the output map's gradient d_out [B, H, W, C] (x's token rows saved): dx, the
// residual plus the correlation with the flipped weight; the weight's, the taps' gradient per sample, summed; the
// bias's (undefined without one).
std::tuple<Tensor, Tensor, Tensor> cpe_backward(const Tensor& d_out, const Tensor& tokens, const Tensor& weight,
                                                bool has_bias, int64_t gh, int64_t gw) {
  const int64_t B = tokens.size(0), N = tokens.size(1), C = tokens.size(2);
  Tensor grad = d_out.reshape({B, N, C});
  if (grad.stride(-1) != 1) grad = grad.contiguous();
  Tensor dx = at::empty_like(tokens, at::MemoryFormat::Contiguous);
  vit3_cpu::dwconv(grad, weight.flip({-2, -1}), dx, gh, gw, std::nullopt, true);
  Tensor dtaps = tokens.new_empty({B, 9, C});
  vit3_cpu::dwconv_weight_grad(grad, tokens, dtaps, gh, gw);
  return {dx.view({B, gh, gw, C}), dtaps.sum(0).t().reshape({C, 1, 3, 3}), has_bias ? grad.sum(at::IntArrayRef{0, 1}) : Tensor()};
}

// ConvPosEnc on the kernel as one node: t = x + dwconv3x3(x) + bias, saving x's token rows and the weight. The
// saving ViT³ block's CPE and the H-ViT³ ConvFFN's depthwise step (vit3/layers/blocks.py); its reference is the
// convolution through autograd (tests/kernels/test_op_dwconv.py).
struct CpeFunction : public torch::autograd::Function<CpeFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                               const std::optional<Tensor>& bias) {
    auto [t, tokens] = cpe_tokens(x, weight, bias);
    ctx->save_for_backward({tokens, weight});
    ctx->saved_data["grid"] = std::vector<int64_t>{x.size(1), x.size(2)};
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    return {t};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    const auto grid = ctx->saved_data["grid"].toIntVector();
    Tensor dx, dweight, dbias;
    {
      at::NoGradGuard no_grad;
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // in the forward's dtype
      std::tie(dx, dweight, dbias) =
          cpe_backward(grad_out[0], s[0], s[1], ctx->saved_data["bias"].toBool(), grid[0], grid[1]);
    }
    return vit3_cpu::once_differentiable({dx, dweight, dbias}, at::GradMode::is_enabled() && grad_out[0].requires_grad(),
                                         "vit3_cpu.cpe (the CPE's C++ node)");
  }
};

Tensor cpe_cpu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  return cpe_tokens(x, weight, bias).first;
}

// The autograd kernel: the node where it records one, else the forward alone (saving nothing).
Tensor cpe_autograd(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias) {
  if (vit3_cpu::records_grad({x, weight, bias.value_or(Tensor())})) return CpeFunction::apply(x, weight, bias)[0];
  static auto op = vit3_cpu::op_of<decltype(cpe_cpu)>("vit3_cpu::cpe");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(x, weight, bias);
}

// The block's CPE and first LayerNorm as one node: t = x + dwconv3x3(x) + bias and n = LayerNorm(t), saving x's
// token rows (which the CPE's backward needs anyway) and the norm's statistics, not t: the backward recomputes t
// with one kernel call. The memory-lean ViT³ block's (vit3/layers/blocks.py), with no Python in its forward or
// backward; its reference is the CPE then the LayerNorm through autograd (tests/layers/test_blocks_memory.py).
struct CpeNormFunction : public torch::autograd::Function<CpeNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                               const std::optional<Tensor>& bias, const std::optional<Tensor>& ln_w,
                               const std::optional<Tensor>& ln_b, double eps) {
    auto [t, tokens] = cpe_tokens(x, weight, bias);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    auto [n, mean, rstd] = at::native_layer_norm(t, {t.size(-1)}, ln_w, ln_b, eps);
    ctx->save_for_backward({tokens, weight, bias.value_or(Tensor()), mean, rstd, ln_w.value_or(Tensor()),
                            ln_b.value_or(Tensor())});
    ctx->saved_data["grid"] = std::vector<int64_t>{x.size(1), x.size(2)};
    ctx->saved_data["eps"] = eps;
    return {t, n};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    const auto opt = [](const Tensor& v) { return v.defined() ? std::optional<Tensor>(v) : std::nullopt; };
    const Tensor &tokens = s[0], &weight = s[1], &mean = s[3], &rstd = s[4];
    const auto bias = opt(s[2]), ln_w = opt(s[5]), ln_b = opt(s[6]);
    const auto grid = ctx->saved_data["grid"].toIntVector();
    const int64_t B = tokens.size(0), C = tokens.size(2), gh = grid[0], gw = grid[1];
    Tensor dx, dweight, dbias, d_lw, d_lb;
    {
      at::NoGradGuard no_grad;
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // in the forward's dtype
      const Tensor t = cpe_tokens(tokens.view({B, gh, gw, C}), weight, bias).first;  // recomputed
      Tensor d_t;
      std::tie(d_t, d_lw, d_lb) = at::native_layer_norm_backward(
          grad_out[1], t, {C}, mean, rstd, ln_w, ln_b, {true, ln_w.has_value(), ln_b.has_value()});
      std::tie(dx, dweight, dbias) = cpe_backward(d_t.add_(grad_out[0]), tokens, weight, bias.has_value(), gh, gw);
    }
    variable_list grads{dx, dweight, dbias, d_lw, d_lb, Tensor()};
    const bool create_graph = grad_out[0].requires_grad() || grad_out[1].requires_grad();
    return vit3_cpu::once_differentiable(std::move(grads), at::GradMode::is_enabled() && create_graph,
                                         "vit3_cpu.cpe_norm (the block's CPE + norm C++ node)");
  }
};

std::tuple<Tensor, Tensor> cpe_norm_cpu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                                        const std::optional<Tensor>& ln_w, const std::optional<Tensor>& ln_b,
                                        double eps);

// The autograd kernel: the node where it records one, else the forward alone (saving nothing).
std::tuple<Tensor, Tensor> cpe_norm_autograd(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                                             const std::optional<Tensor>& ln_w, const std::optional<Tensor>& ln_b,
                                             double eps) {
  const auto opt = [](const std::optional<Tensor>& t) { return t.value_or(Tensor()); };
  if (vit3_cpu::records_grad({x, weight, opt(bias), opt(ln_w), opt(ln_b)})) {
    const auto out = CpeNormFunction::apply(x, weight, bias, ln_w, ln_b, eps);
    return {out[0], out[1]};
  }
  // through the dispatcher below autograd, to the CPU kernel: dispatch modes and profilers see the op
  static auto op = vit3_cpu::op_of<decltype(cpe_norm_cpu)>("vit3_cpu::cpe_norm");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(x, weight, bias, ln_w, ln_b, eps);
}

// Below autograd (inference mode, tensors without autograd keys): the forward alone.
std::tuple<Tensor, Tensor> cpe_norm_cpu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                                        const std::optional<Tensor>& ln_w, const std::optional<Tensor>& ln_b,
                                        double eps) {
  const Tensor t = cpe_tokens(x, weight, bias).first;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return {t, std::get<0>(at::native_layer_norm(t, {t.size(-1)}, ln_w, ln_b, eps))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vit3_cpu, m) {
  m.def("cpe(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("cpe_norm(Tensor x, Tensor weight, Tensor? bias, Tensor? ln_w, Tensor? ln_b, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vit3_cpu, CPU, m) {
  m.impl("cpe", &cpe_cpu);
  m.impl("cpe_norm", &cpe_norm_cpu);
}

TORCH_LIBRARY_IMPL(vit3_cpu, Autograd, m) {
  m.impl("cpe", &cpe_autograd);
  m.impl("cpe_norm", &cpe_norm_autograd);
}
