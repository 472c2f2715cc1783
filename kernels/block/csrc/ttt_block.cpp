// The plain ViT³ block as one op: vit3_cpu::ttt_block, the layers of vit3/layers/blocks.py's TTTBlock.forward in
// their order, each through its own op, so one Python call runs a whole block. The memory-lean block (lean):
//
//   t, n = cpe_norm(x)                              t = x + dwconv3x3(x), n = LN1(t)
//   t = t + keep1 * proj(mix(qkv(n)))                the mixer (vit3_cpu::mix on the settled call's route)
//   out = t + keep2 * lean_mlp(t)                    fc2(GELU(fc1(LN2(t))))
//
// and the saving one (recompute="never" in training) with the CPE's node (vit3_cpu::cpe) then LN1, and LN2, fc1,
// GELU, fc2 as ATen ops. keep1 / keep2 are the drop-path scales [B, 1, 1, 1] that timm's drop_path draws (absent:
// no drop path). The op is CompositeImplicitAutograd: autograd records the nodes of the ops it calls, as the
// layer-by-layer call does, so the values and every gradient are the same bits (tests/layers/test_block_one_op.py); what it
// removes is the Python between them, and the caches that Python evicts (docs/design/kernels.md). Built into the
// extension vit3_cpu (kernels/cpp.py).

#include "vit3_cpu.h"

namespace {

using at::Tensor;
using vit3_cpu::op_of;
using OptTensor = std::optional<Tensor>;

using Cpe = Tensor(const Tensor&, const Tensor&, const OptTensor&);
using CpeNorm = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                           const OptTensor&, double);
using Mix = Tensor(const Tensor&, at::TensorList, at::IntArrayRef, int64_t, int64_t, double, double, bool, double,
                   bool, bool);
using LeanMlp = Tensor(const Tensor&, const OptTensor&, const OptTensor&, std::optional<double>, const Tensor&,
                       const OptTensor&, const Tensor&, const OptTensor&, c10::string_view);

// y scaled by the drop-path keep scale [B, 1, 1, 1] where there is one (timm's drop_path: y * random_tensor).
Tensor dropped(const Tensor& y, const OptTensor& keep) { return keep.has_value() ? y * *keep : y; }

Tensor ttt_block(const Tensor& x, bool lean, const Tensor& cpe_w, const OptTensor& cpe_b, const OptTensor& n1_w,
                 const OptTensor& n1_b, double eps1, const Tensor& qkv_w, const OptTensor& qkv_b,
                 at::TensorList weights, at::IntArrayRef spec, int64_t gh, int64_t gw, double scale, double lr,
                 bool grad_norm, double rope_base, bool recompute, bool dense, const Tensor& proj_w,
                 const OptTensor& proj_b, const OptTensor& n2_w, const OptTensor& n2_b, double eps2,
                 const Tensor& fc1_w, const OptTensor& fc1_b, const Tensor& fc2_w, const OptTensor& fc2_b,
                 c10::string_view approximate, const OptTensor& keep1, const OptTensor& keep2) {
  // through the dispatcher, each op's autograd kernel first, as a Python call takes it
  static const auto cpe = op_of<Cpe>("vit3_cpu::cpe");
  static const auto cpe_norm = op_of<CpeNorm>("vit3_cpu::cpe_norm");
  static const auto mix = op_of<Mix>("vit3_cpu::mix");
  static const auto lean_mlp = op_of<LeanMlp>("vit3_cpu::lean_mlp");
  TORCH_CHECK(x.dim() == 4 && x.size(1) == gh && x.size(2) == gw, "vit3_cpu.ttt_block: x [B, ", gh, ", ", gw,
              ", C] for the spec's grid, got ", x.sizes());
  const int64_t b = x.size(0), c = x.size(3);
  Tensor t, n;
  if (lean) {
    std::tie(t, n) = cpe_norm.call(x, cpe_w, cpe_b, n1_w, n1_b, eps1);
  } else {
    t = cpe.call(x, cpe_w, cpe_b);
    n = at::layer_norm(t, {c}, n1_w, n1_b, eps1);
  }
  const Tensor qkv = at::linear(n.reshape({b, gh * gw, c}), qkv_w, qkv_b);  // [B, N, 3 * sum(widths)]
  const Tensor mixed = mix.call(qkv, weights, spec, gh, gw, scale, lr, grad_norm, rope_base, recompute, dense);
  t = t + dropped(at::linear(mixed, proj_w, proj_b).reshape({b, gh, gw, c}), keep1);
  const Tensor ffn = lean ? lean_mlp.call(t, n2_w, n2_b, eps2, fc1_w, fc1_b, fc2_w, fc2_b, approximate)
                         : at::linear(at::gelu(at::linear(at::layer_norm(t, {c}, n2_w, n2_b, eps2), fc1_w, fc1_b),
                                               approximate),
                                      fc2_w, fc2_b);
  return t + dropped(ffn, keep2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vit3_cpu, m) {
  m.def(
      "ttt_block(Tensor x, bool lean, Tensor cpe_w, Tensor? cpe_b, Tensor? n1_w, Tensor? n1_b, float eps1, Tensor qkv_w, "
      "Tensor? qkv_b, Tensor[] weights, int[] spec, int gh, int gw, float scale, float lr, bool grad_norm, "
      "float rope_base, bool recompute, bool dense, Tensor proj_w, Tensor? proj_b, Tensor? n2_w, Tensor? n2_b, "
      "float eps2, Tensor fc1_w, Tensor? fc1_b, Tensor fc2_w, Tensor? fc2_b, str approximate, Tensor? keep1, "
      "Tensor? keep2) -> Tensor");
}

TORCH_LIBRARY_IMPL(vit3_cpu, CompositeImplicitAutograd, m) {
  m.impl("ttt_block", &ttt_block);
}
