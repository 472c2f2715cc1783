// The plain ViT³ block's memory-lean feed-forward as one op with one C++ autograd node: vit3_cpu::lean_mlp,
// fc2(GELU(fc1(LN(x)))) (the LayerNorm optional) saving x, the norm's statistics and output and h = fc1(LN(x))
// only; the backward recomputes GELU(h). It is the Python node vit3/layers/blocks.py's _LeanMlpFn without Python:
// the same ATen calls in the same order (the same bits, tests/layers/test_blocks_memory.py), without that node's
// Python and its calls' bindings (docs/design/kernels.md). The op's reference is
// LayerNorm then timm's Mlp through autograd. Built into the extension vit3_cpu (kernels/cpp.py).

#include "vit3_cpu.h"

#include <torch/autograd.h>

#include <string>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// fc2(GELU(h)), h = fc1(LN(x)) (x itself without a norm): returns the output, h and the norm's output, mean and
// rstd (undefined without a norm).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> lean_forward(const Tensor& x, const std::optional<Tensor>& ln_w,
                                                        const std::optional<Tensor>& ln_b, std::optional<double> eps,
                                                        const Tensor& w1, const std::optional<Tensor>& b1,
                                                        const Tensor& w2, const std::optional<Tensor>& b2,
                                                        c10::string_view approximate) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // in its inputs' dtype
  Tensor n, mean, rstd;
  if (eps.has_value()) std::tie(n, mean, rstd) = at::native_layer_norm(x, {x.size(-1)}, ln_w, ln_b, *eps);
  Tensor h = at::linear(n.defined() ? n : x, w1, b1);  // [..., hidden]
  Tensor out = at::linear(at::gelu(h, approximate), w2, b2);
  return {out, h, n, mean, rstd};
}

struct LeanMlpFunction : public torch::autograd::Function<LeanMlpFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& ln_w,
                               const std::optional<Tensor>& ln_b, std::optional<double> eps, const Tensor& w1,
                               const std::optional<Tensor>& b1, const Tensor& w2, const std::optional<Tensor>& b2,
                               c10::string_view approximate) {
    auto [out, h, n, mean, rstd] = lean_forward(x, ln_w, ln_b, eps, w1, b1, w2, b2, approximate);
    ctx->save_for_backward({x, h, w1, w2, mean, rstd, ln_w.value_or(Tensor()), ln_b.value_or(Tensor()), n});
    ctx->saved_data["eps"] = eps.has_value() ? c10::IValue(*eps) : c10::IValue();
    ctx->saved_data["approximate"] = std::string(approximate);
    ctx->saved_data["biases"] = std::vector<bool>{b1.has_value() && b1->defined(), b2.has_value() && b2->defined()};
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    const auto s = ctx->get_saved_variables();
    const Tensor &x = s[0], &h = s[1], &w1 = s[2], &w2 = s[3], &mean = s[4], &rstd = s[5];
    const std::optional<Tensor> ln_w = s[6].defined() ? std::optional<Tensor>(s[6]) : std::nullopt;
    const std::optional<Tensor> ln_b = s[7].defined() ? std::optional<Tensor>(s[7]) : std::nullopt;
    const auto eps_value = ctx->saved_data["eps"];
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const auto biases = ctx->saved_data["biases"].toBoolList();
    const bool has_b1 = biases[0], has_b2 = biases[1], norm = !eps_value.isNone();
    const Tensor& dy = grad_out[0];
    Tensor dx, d_lw, d_lb, dw1, db1, dw2, db2;
    {
      at::NoGradGuard no_grad;
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // in the forward's dtype
      const int64_t rows = dy.numel() / dy.size(-1);
      const Tensor dy2 = dy.reshape({rows, -1});                              // [T, C]
      Tensor a = at::gelu(h, approximate).reshape({rows, -1});               // [T, hidden], recomputed
      dw2 = dy2.t().mm(a);
      if (has_b2) db2 = dy2.sum(0);
      a.reset();
      const Tensor dh = at::gelu_backward(dy2.mm(w2), h.reshape({rows, -1}), approximate);
      const Tensor& n = norm ? s[8] : x;
      dw1 = dh.t().mm(n.reshape({rows, -1}));
      if (has_b1) db1 = dh.sum(0);
      const Tensor dn = dh.mm(w1).view(x.sizes()).to(n.scalar_type());  // the norm output's gradient
      if (norm) {
        std::tie(dx, d_lw, d_lb) = at::native_layer_norm_backward(
            dn, x.to(n.scalar_type()), {x.size(-1)}, mean, rstd, ln_w, ln_b, {true, ln_w.has_value(), ln_b.has_value()});
      } else {
        dx = dn;
      }
    }
    variable_list grads{dx, d_lw, d_lb, Tensor(), dw1, db1, dw2, db2, Tensor()};
    return vit3_cpu::once_differentiable(std::move(grads), at::GradMode::is_enabled() && dy.requires_grad(),
                                         "vit3_cpu.lean_mlp (the lean MLP's C++ node)");
  }
};

// The autograd kernel: the node where it records one, else the forward alone (saving nothing).
Tensor lean_mlp_autograd(const Tensor& x, const std::optional<Tensor>& ln_w, const std::optional<Tensor>& ln_b,
                         std::optional<double> eps, const Tensor& w1, const std::optional<Tensor>& b1, const Tensor& w2,
                         const std::optional<Tensor>& b2, c10::string_view approximate) {
  const auto opt = [](const std::optional<Tensor>& t) { return t.value_or(Tensor()); };
  if (vit3_cpu::records_grad({x, opt(ln_w), opt(ln_b), w1, opt(b1), w2, opt(b2)})) {
    return LeanMlpFunction::apply(x, ln_w, ln_b, eps, w1, b1, w2, b2, approximate)[0];
  }
  // through the dispatcher below autograd, to the CPU kernel: dispatch modes and profilers see the op
  static auto op = vit3_cpu::op_of<decltype(lean_mlp_autograd)>("vit3_cpu::lean_mlp");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(x, ln_w, ln_b, eps, w1, b1, w2, b2, approximate);
}

// Below autograd (inference mode, tensors without autograd keys): the forward alone.
Tensor lean_mlp_cpu(const Tensor& x, const std::optional<Tensor>& ln_w, const std::optional<Tensor>& ln_b,
                    std::optional<double> eps, const Tensor& w1, const std::optional<Tensor>& b1, const Tensor& w2,
                    const std::optional<Tensor>& b2, c10::string_view approximate) {
  return std::get<0>(lean_forward(x, ln_w, ln_b, eps, w1, b1, w2, b2, approximate));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vit3_cpu, m) {
  m.def(
      "lean_mlp(Tensor x, Tensor? ln_w, Tensor? ln_b, float? eps, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, "
      "str approximate) -> Tensor");
}

TORCH_LIBRARY_IMPL(vit3_cpu, CPU, m) {
  m.impl("lean_mlp", &lean_mlp_cpu);
}

TORCH_LIBRARY_IMPL(vit3_cpu, Autograd, m) {
  m.impl("lean_mlp", &lean_mlp_autograd);
}
