// The whole CPU mixer call as one op: vit3_cpu::mix (the inner loops of all branches of TTTMixer.mix, between the
// two projections), with one C++ autograd node, so a settled mixer call runs no Python between its two projections.
// Its two directions, mix_forward and mix_backward, are also the CPU kernels of the mixer op vit3::mix
// (vit3/layers/fused_mix.py, through kernels/mix/cpp.py), which the Python node and torch.compile run; the branches'
// steps are the SwiGLU and depthwise ops' (swiglu.cpp, dwconv.cpp, declared in vit3_cpu.h), called directly.
//
// q, k, v of each branch are strided views of qkv [B, N, 3 * sum(widths)] (branch by branch [q | k | v]); RoPE
// rotates q and k (rope_2d, bit for bit vit3/layers/rope.py's apply_rope_2d); the read-outs are written into one
// output [B, N, sum(widths)] and the backward writes dq, dk, dv into one qkv gradient. What the forward saves never
// aliases qkv (the backward takes qkv and views it again), and its layout does not depend on sizes: per branch its
// step's statistics. A RoPE branch's rotated q, k are not saved: the backward rotates them again.
//
// The spec is a flat int list, kFields per branch: op code (0 SwiGLU, 1 depthwise), offset in qkv, heads, head dim,
// RoPE (0/1), the SwiGLU kernel's token block. Ops: mix (autograd: one node), mix_forward / mix_backward (its two
// directions, CPU), rope_2d.

#include "vit3_cpu.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <mutex>
#include <tuple>

namespace {

using namespace vit3_cpu;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum OpCode : int64_t { kSwiGLU = 0, kDwconv = 1 };  // each op's MIX_CODE (kernels/<op>/cpp.py)
constexpr int64_t kFields = 6;
// What a SwiGLU branch's step saves (w, g, norm, w_new, and z, y unless the backward recomputes them) and a
// depthwise one's (g, norm, w_new).
constexpr int64_t kSwiGLUSaved = 4, kDwconvSaved = 3;

struct Branch {
  int64_t op, offset, heads, head_dim;
  bool rope;
  int64_t block;
  int64_t width() const { return heads * head_dim; }
  int64_t weights() const { return op == kSwiGLU ? 2 : 1; }
  int64_t saved(bool recompute) const {
    return op == kSwiGLU ? kSwiGLUSaved + (recompute ? 0 : 2) : kDwconvSaved;
  }
};

std::vector<Branch> branches_of(at::IntArrayRef spec) {
  TORCH_CHECK(!spec.empty() && spec.size() % kFields == 0, "vit3_cpu.mix: the spec holds ", kFields,
              " ints per branch, got ", spec.size());
  std::vector<Branch> out;
  for (size_t i = 0; i < spec.size(); i += kFields) {
    const Branch br{spec[i], spec[i + 1], spec[i + 2], spec[i + 3], spec[i + 4] != 0, spec[i + 5]};
    TORCH_CHECK(br.op == kSwiGLU || br.op == kDwconv, "vit3_cpu.mix: branch op 0 (SwiGLU) or 1 (depthwise), got ",
                br.op);
    TORCH_CHECK(br.offset >= 0 && br.heads > 0 && br.head_dim > 0 && br.block > 0,
                "vit3_cpu.mix: bad branch (offset ", br.offset, ", heads ", br.heads, ", head dim ", br.head_dim,
                ", block ", br.block, ")");
    TORCH_CHECK(!br.rope || br.width() % 4 == 0, "vit3_cpu.mix: RoPE needs branch widths divisible by 4, got ",
                br.width());
    out.push_back(br);
  }
  return out;
}

int64_t total_width(const std::vector<Branch>& brs) {
  int64_t total = 0;
  for (const auto& br : brs) total += br.width();
  return total;
}

// Channels [offset, offset + width) of t [B, N, *] as tokens [B, N, width] (a view).
Tensor tokens_view(const Tensor& t, int64_t offset, int64_t width) {
  return t.as_strided({t.size(0), t.size(1), width}, {t.stride(0), t.stride(1), t.stride(2)},
                      t.storage_offset() + offset * t.stride(2));
}

// Tokens [B, N, H*d] as heads [B, H, N, d] (a view).
Tensor heads_view(const Tensor& t, int64_t heads, int64_t d) {
  return t.as_strided({t.size(0), heads, t.size(1), d}, {t.stride(0), d * t.stride(2), t.stride(1), t.stride(2)},
                      t.storage_offset());
}

// The cos and sin of the rotation angles [h, w, 2, dim / 4], made by the ops and in the order of
// vit3/layers/rope.py (_frequencies, _grid_angles), so the same kernels give the same bits; kept per (grid, dim,
// base, dtype): a model has a few.
std::pair<Tensor, Tensor> rope_tables(int64_t gh, int64_t gw, int64_t dim, double base, at::ScalarType dtype) {
  using Key = std::tuple<int64_t, int64_t, int64_t, double, int>;
  static std::mutex mutex;
  static std::map<Key, std::pair<Tensor, Tensor>> cache;
  const Key key{gh, gw, dim, base, static_cast<int>(dtype)};
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  const auto opts = at::TensorOptions().dtype(dtype);
  const int64_t k_max = dim / 4;
  const Tensor theta = at::pow(base, at::arange(k_max, opts).div(k_max).neg());  // [k_max]
  const Tensor zero = at::zeros_like(theta);
  const Tensor rows = at::arange(gh, opts).view({gh, 1, 1, 1}) * at::stack({theta, zero});  // [h, 1, 2, k_max]
  const Tensor cols = at::arange(gw, opts).view({1, gw, 1, 1}) * at::stack({zero, theta});  // [1, w, 2, k_max]
  const Tensor angles = rows + cols;
  if (cache.size() >= 64) cache.clear();
  return cache[key] = {angles.cos(), angles.sin()};
}

// v, rounded to T where it stands: the compiler cannot contract the product it holds into a following sum (an FMA
// rounds once, the elementwise ops of apply_rope_2d twice).
template <typename T>
inline T rounded(T v) {
  asm volatile("" : "+m"(v));
  return v;
}

// The rotation of apply_rope_2d on tokens [begin, end) of B x N: pairs (2j, 2j + 1) of every token, out = (re cos -
// im sin, re sin + im cos), sin negated for the inverse, each product and sum rounded apart.
template <typename T>
void rotate_tokens(const Tensor& x, const T* cos, const T* sin, const Tensor& out, T sign, int64_t begin,
                   int64_t end) {
  const int64_t N = x.size(1), pairs = x.size(2) / 2;
  const T* X = x.data_ptr<T>();
  T* O = out.data_ptr<T>();
  for (int64_t u = begin; u < end; ++u) {
    const int64_t b = u / N, p = u % N;
    const T* xr = X + b * x.stride(0) + p * x.stride(1);
    T* o = O + b * out.stride(0) + p * out.stride(1);
    const T *cr = cos + p * pairs, *sr = sin + p * pairs;
    for (int64_t j = 0; j < pairs; ++j) {
      const T re = xr[2 * j], im = xr[2 * j + 1], c = cr[j], s = sr[j] * sign;
      o[2 * j] = rounded(re * c) - rounded(im * s);
      o[2 * j + 1] = rounded(re * s) + rounded(im * c);
    }
  }
}

template <typename T>
void rotate_impl(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& out, bool inverse) {
  const T *cs = cos.data_ptr<T>(), *sn = sin.data_ptr<T>(), sign = inverse ? T(-1) : T(1);
  at::parallel_for(0, x.size(0) * x.size(1), 256,
                   [&](int64_t begin, int64_t end) { rotate_tokens<T>(x, cs, sn, out, sign, begin, end); });
}

// Rotates tokens x [B, N, C] (unit stride along C) by their position on the gh x gw grid into out (the same).
void rotate(const Tensor& x, const Tensor& out, int64_t gh, int64_t gw, double base, bool inverse) {
  const auto [cos, sin] = rope_tables(gh, gw, x.size(2), base, x.scalar_type());
  VIT3_DISPATCH(x, rotate_impl, x, cos, sin, out, inverse);
}

// Tokens x [B, N, C] (unit stride along C) rotated by their position on the gh x gw grid, as a new [B, N, C].
Tensor rotated(const Tensor& x, int64_t gh, int64_t gw, double base) {
  Tensor out = at::empty(x.sizes(), x.options());
  rotate(x, out, gh, gw, base, false);
  return out;
}

void check_tokens(const Tensor& t, int64_t gh, int64_t gw, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "vit3_cpu.mix: ", name, " must be a CPU tensor");
  check_float(t);
  TORCH_CHECK(t.dim() == 3, "vit3_cpu.mix: ", name, " must be [B, N, C], got ", t.sizes());
  TORCH_CHECK(gh > 0 && gw > 0 && gh * gw == t.size(1), "vit3_cpu.mix: grid ", gh, "x", gw, " does not fit N=",
              t.size(1));
}

// 2-D RoPE of tokens [B, N, C] on a gh x gw grid (raster order), float32/float64: apply_rope_2d bit for bit.
Tensor rope_2d(const Tensor& x, int64_t gh, int64_t gw, double base, bool inverse) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_tokens(x, gh, gw, "x");
  TORCH_CHECK(x.size(2) % 4 == 0, "vit3_cpu.rope_2d: 2-D RoPE needs channels divisible by 4, got ", x.size(2));
  const Tensor xx = x.stride(2) == 1 ? x : x.contiguous();
  Tensor out = at::empty(x.sizes(), x.options());
  rotate(xx, out, gh, gw, base, inverse);
  return out;
}

// A depthwise weight as the op takes it, [1|B, C, 3, 3]: a conv weight as stored, [C, 1, 3, 3], viewed [1, C, 3, 3].
Tensor taps_layout(const Tensor& w, int64_t C) {
  const bool conv = w.dim() == 4 && w.size(0) == C && w.size(1) == 1 && w.size(2) == 3 && w.size(3) == 3;
  return conv ? w.view({1, C, 3, 3}) : w;
}

// The gradient of an initial weight of shape `shape` from the per-sample one dw [B, ...]: summed over samples for a
// shared weight (leading size 1, or a conv weight [C, 1, 3, 3] as taps_layout views it), then in that shape.
Tensor weight_grad(const Tensor& dw, at::IntArrayRef shape, int64_t C, bool depthwise) {
  const bool shared = shape[0] == 1 || (depthwise && shape[0] == C && shape[1] == 1);
  const Tensor g = shared && dw.size(0) != 1 ? dw.sum(0, true) : dw;
  return g.sizes() == shape ? g : g.reshape(shape);
}

// That `t` (`what`) is a CPU [B, N, channels] tensor of like's B, N and dtype, with unit channel stride where `unit`.
void check_buffer(const Tensor& t, const Tensor& like, int64_t channels, const char* what, bool unit = true) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == like.scalar_type() && t.dim() == 3 &&
                  t.size(0) == like.size(0) && t.size(1) == like.size(1) && t.size(2) == channels &&
                  (!unit || t.stride(2) == 1),
              "vit3_cpu.mix: ", what, " must be a CPU ", like.scalar_type(), " [", like.size(0), ", ", like.size(1), ", ",
              channels, "] tensor", unit ? " with unit channel stride" : "", ", got ", t.scalar_type(), " ", t.sizes());
}

// A SwiGLU branch's q, k, v tokens [B, N, H*d] as its step takes them, heads [B, H, N, d]: views, or dense copies.
std::tuple<Tensor, Tensor, Tensor> swiglu_inputs(const Tensor& q, const Tensor& k, const Tensor& v, int64_t H,
                                                 int64_t d, bool dense) {
  const Tensor qh = heads_view(q, H, d), kh = heads_view(k, H, d), vh = heads_view(v, H, d);
  if (!dense) return {qh, kh, vh};
  return {qh.contiguous(), kh.contiguous(), vh.contiguous()};
}

// qkv as the branches read it: with unit channel stride (a dense copy where it has none, and then dense inputs).
Tensor unit_channels(const Tensor& qkv, bool& dense) {
  if (qkv.stride(2) == 1) return qkv;
  dense = true;
  return qkv.contiguous();
}

// Every branch's step and read-out written into out [B, N, sum(widths)]; returns (when save) what mix_backward needs
// besides qkv: per branch its step's statistics (Branch::saved). dense: the
// SwiGLU branches read dense copies of q, k, v (fused_mix's rule, decided by the caller).
std::vector<Tensor> mix_forward(const Tensor& qkv_in, at::TensorList weights, at::IntArrayRef spec, int64_t gh,
                                int64_t gw, double scale, double lr, bool grad_norm, double rope_base, bool recompute,
                                bool dense, bool save, const Tensor& out) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // the inner loop's dtype
  const auto brs = branches_of(spec);
  check_tokens(qkv_in, gh, gw, "qkv");
  const int64_t total = total_width(brs);
  TORCH_CHECK(qkv_in.size(2) == 3 * total, "vit3_cpu.mix: qkv has ", qkv_in.size(2), " channels, the branches need ",
              3 * total);
  check_buffer(out, qkv_in, total, "out");
  int64_t count = 0;
  for (const auto& br : brs) count += br.weights();
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == count, "vit3_cpu.mix: the branches take ", count,
              " weights, got ", weights.size());
  for (const auto& w : weights) {
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == qkv_in.scalar_type(),
                "vit3_cpu.mix: weights must be CPU tensors of qkv's dtype ", qkv_in.scalar_type(), ", got ",
                w.scalar_type());
  }
  const Tensor qkv = unit_channels(qkv_in, dense);
  const int64_t B = qkv.size(0), N = qkv.size(1);
  std::vector<Tensor> saved;
  const double c = scale / N;
  int64_t col = 0, wi = 0;
  for (const auto& br : brs) {
    const int64_t W = br.width(), H = br.heads, d = br.head_dim;
    Tensor q = tokens_view(qkv, br.offset, W), k = tokens_view(qkv, br.offset + W, W);
    const Tensor v = tokens_view(qkv, br.offset + 2 * W, W);
    if (br.rope) {
      q = rotated(q, gh, gw, rope_base);
      k = rotated(k, gh, gw, rope_base);
    }
    const Tensor dest = tokens_view(out, col, W);
    if (br.op == kSwiGLU) {
      const auto [qh, kh, vh] = swiglu_inputs(q, k, v, H, d, dense);
      const bool keep = save && !recompute;  // Z = k W and Y = q W' saved, else recomputed by the backward
      Tensor z = keep ? at::empty({B, H, N, 2 * d}, qkv.options()) : Tensor();
      Tensor y = keep ? at::empty({B, H, N, 2 * d}, qkv.options()) : Tensor();
      auto r = ttt_forward(qh, kh, vh, weights[wi], weights[wi + 1], heads_view(dest, H, d),
                           keep ? std::optional<Tensor>(z) : std::nullopt,
                           keep ? std::optional<Tensor>(y) : std::nullopt, c, lr, grad_norm, br.block);
      if (save) saved.insert(saved.end(), r.begin(), r.end());
      if (keep) saved.insert(saved.end(), {z, y});
    } else {
      auto r = dwconv_ttt_forward(q, k, v, taps_layout(weights[wi], W), dest, gh, gw, c, lr, grad_norm);
      if (save) saved.insert(saved.end(), r.begin(), r.end());
    }
    col += W;
    wi += br.weights();
  }
  return saved;
}

// The backward of mix_forward from d_out [B, N, sum(widths)] on qkv and what the forward saved: dq, dk, dv written
// into dqkv (qkv's shape, unit channel stride); returns the initial weights' gradients in their shapes (weight_shapes:
// 4 sizes per weight, as mix got them).
std::vector<Tensor> mix_backward(const Tensor& d_out_in, const Tensor& qkv_in, at::TensorList saved,
                                 at::IntArrayRef weight_shapes, at::IntArrayRef spec, int64_t gh, int64_t gw,
                                 double scale, double lr, bool grad_norm, double rope_base, bool recompute, bool dense,
                                 const Tensor& dqkv) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto brs = branches_of(spec);
  check_tokens(d_out_in, gh, gw, "d_out");
  const int64_t total = total_width(brs);
  TORCH_CHECK(d_out_in.size(2) == total, "vit3_cpu.mix_backward: d_out has ", d_out_in.size(2),
              " channels, the branches write ", total);
  check_buffer(qkv_in, d_out_in, 3 * total, "qkv", false);
  check_buffer(dqkv, d_out_in, 3 * total, "dqkv");
  int64_t n_saved = 0, n_weights = 0;
  for (const auto& br : brs) {
    n_saved += br.saved(recompute);
    n_weights += br.weights();
  }
  TORCH_CHECK(static_cast<int64_t>(saved.size()) == n_saved && static_cast<int64_t>(weight_shapes.size()) == 4 * n_weights,
              "vit3_cpu.mix_backward: ", n_saved, " saved tensors and ", 4 * n_weights, " weight sizes expected, got ",
              saved.size(), " and ", weight_shapes.size());
  const auto shape = [&](int64_t i) { return weight_shapes.slice(4 * i, 4); };
  const Tensor d_out = d_out_in.stride(2) == 1 ? d_out_in : d_out_in.contiguous();
  const Tensor qkv = unit_channels(qkv_in, dense);
  const int64_t B = d_out.size(0), N = d_out.size(1);
  std::vector<Tensor> grads;
  const double c = scale / N;
  int64_t col = 0, wi = 0, si = 0;
  for (const auto& br : brs) {
    const int64_t W = br.width(), H = br.heads, d = br.head_dim;
    const auto s = saved.slice(si, br.saved(recompute));
    Tensor q = tokens_view(qkv, br.offset, W), k = tokens_view(qkv, br.offset + W, W);
    if (br.rope) {  // rotated again, as the forward did
      q = rotated(q, gh, gw, rope_base);
      k = rotated(k, gh, gw, rope_base);
    }
    const Tensor v = tokens_view(qkv, br.offset + 2 * W, W);
    const Tensor dq = tokens_view(dqkv, br.offset, W), dk = tokens_view(dqkv, br.offset + W, W);
    const Tensor dv = tokens_view(dqkv, br.offset + 2 * W, W), dout = tokens_view(d_out, col, W);
    // RoPE'd branches get dq, dk in the rotated frame first, then rotate them back into place
    const Tensor rq = br.rope ? at::empty({B, N, W}, d_out.options()) : dq;
    const Tensor rk = br.rope ? at::empty({B, N, W}, d_out.options()) : dk;
    if (br.op == kSwiGLU) {
      const auto [qh, kh, vh] = swiglu_inputs(q, k, v, H, d, dense);
      const auto opt = [&](int64_t i) { return recompute ? std::nullopt : std::optional<Tensor>(s[4 + i]); };
      const Tensor dw = ttt_backward(heads_view(dout, H, d), qh, kh, vh, opt(0), opt(1), s[0], s[1], s[2],
                                     s[3], heads_view(rq, H, d), heads_view(rk, H, d), heads_view(dv, H, d), c,
                                     lr, grad_norm, br.block);  // [B, H, d, 2d]
      grads.push_back(weight_grad(dw.narrow(3, 0, d), shape(wi), W, false));
      grads.push_back(weight_grad(dw.narrow(3, d, d), shape(wi + 1), W, false));
    } else {
      const Tensor dw = dwconv_ttt_backward(dout, q, k, v, s[0], s[1], s[2], rq, rk, dv, gh, gw, c, lr,
                                            grad_norm);  // taps [B, 9, C]
      grads.push_back(weight_grad(dw.transpose(1, 2).unflatten(-1, {3, 3}), shape(wi), W, true));
    }
    if (br.rope) {
      rotate(rq, dq, gh, gw, rope_base, true);
      rotate(rk, dk, gh, gw, rope_base, true);
    }
    col += W;
    wi += br.weights();
    si += br.saved(recompute);
  }
  return grads;
}

// The mixer call's autograd node: mix_forward saving for mix_backward, both through the dispatcher (so dispatch
// modes and profilers see them). Once differentiable, as the Python node (@once_differentiable): a backward with
// create_graph=True returns gradients whose own backward raises.
struct MixFunction : public torch::autograd::Function<MixFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& qkv, at::TensorList weights, at::IntArrayRef spec,
                               int64_t gh, int64_t gw, double scale, double lr, bool grad_norm, double rope_base,
                               bool recompute, bool dense) {
    static auto op = vit3_cpu::op_of<decltype(mix_forward)>("vit3_cpu::mix_forward");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto brs = branches_of(spec);
    const Tensor out = at::empty({qkv.size(0), qkv.size(1), total_width(brs)}, qkv.options());
    auto saved = op.call(qkv, weights, spec, gh, gw, scale, lr, grad_norm, rope_base, recompute, dense, true, out);
    // what the forward saved, then qkv and the weights as the models hand them (a depthwise weight [1, C, 3, 3]):
    // the Python node's tensors, which checkpointing compares when a route settles between forward and rerun
    saved.push_back(qkv);
    std::vector<int64_t> shapes;
    int64_t wi = 0;
    for (const auto& br : brs) {
      for (int64_t j = 0; j < br.weights(); ++j, ++wi) {
        const Tensor& w = weights[wi];
        TORCH_CHECK(w.dim() == 4, "vit3_cpu.mix: initial weights are 4-D, got ", w.sizes());
        shapes.insert(shapes.end(), w.sizes().begin(), w.sizes().end());
        Tensor kept = br.op == kDwconv ? taps_layout(w, br.width()) : w;
        if (!kept.is_same(w)) {  // a view made below autograd: it shares w's version, as the Python node's view
          torch::autograd::impl::set_version_counter(kept, torch::autograd::impl::version_counter(w));
        }
        saved.push_back(kept);
      }
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["shapes"] = shapes;
    ctx->saved_data["spec"] = spec.vec();
    ctx->saved_data["grid"] = std::vector<int64_t>{gh, gw};
    ctx->saved_data["hyper"] = std::vector<double>{scale, lr, rope_base};
    ctx->saved_data["flags"] = std::vector<bool>{grad_norm, recompute, dense};
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    static auto op = vit3_cpu::op_of<decltype(mix_backward)>("vit3_cpu::mix_backward");
    auto saved = ctx->get_saved_variables();
    const auto shapes = ctx->saved_data["shapes"].toIntVector();
    const auto spec = ctx->saved_data["spec"].toIntVector();
    const auto grid = ctx->saved_data["grid"].toIntVector();
    const auto hyper = ctx->saved_data["hyper"].toDoubleVector();
    const auto flags = ctx->saved_data["flags"].toBoolList();
    const bool grad_norm = flags[0], recompute = flags[1], dense = flags[2];
    const size_t n_weights = shapes.size() / 4;
    const Tensor qkv = saved[saved.size() - 1 - n_weights];
    saved.resize(saved.size() - 1 - n_weights);
    const Tensor& d_out = grad_out[0];
    std::vector<Tensor> dws;
    Tensor dqkv;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      at::NoGradGuard no_grad;
      dqkv = at::empty(qkv.sizes(), d_out.options());
      dws = op.call(d_out, qkv, saved, shapes, spec, grid[0], grid[1], hyper[0], hyper[1], grad_norm, hyper[2],
                    recompute, dense, dqkv);
    }
    variable_list grads{dqkv};
    grads.insert(grads.end(), dws.begin(), dws.end());
    grads = once_differentiable(std::move(grads), at::GradMode::is_enabled() && d_out.requires_grad(),
                                "vit3_cpu.mix (the mixer's C++ node)");
    grads.resize(grads.size() + 9);  // spec, grid, scale, lr, grad_norm, rope_base, recompute, dense: no gradients
    return grads;
  }
};

// The forward alone (no saving) through the dispatcher, below autograd.
Tensor mix_inference(const Tensor& qkv, at::TensorList weights, at::IntArrayRef spec, int64_t gh, int64_t gw,
                     double scale, double lr, bool grad_norm, double rope_base, bool recompute, bool dense) {
  static auto op = vit3_cpu::op_of<decltype(mix_forward)>("vit3_cpu::mix_forward");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Tensor out = at::empty({qkv.size(0), qkv.size(1), total_width(branches_of(spec))}, qkv.options());
  op.call(qkv, weights, spec, gh, gw, scale, lr, grad_norm, rope_base, recompute, dense, false, out);
  return out;
}

// The autograd kernel of mix: the node when gradients flow, else the forward saving nothing.
Tensor mix_autograd(const Tensor& qkv, at::TensorList weights, at::IntArrayRef spec, int64_t gh, int64_t gw,
                    double scale, double lr, bool grad_norm, double rope_base, bool recompute, bool dense) {
  bool flows = qkv.requires_grad();
  for (const auto& w : weights) flows = flows || w.requires_grad();
  if (at::GradMode::is_enabled() && flows) {
    return MixFunction::apply(qkv, weights, spec, gh, gw, scale, lr, grad_norm, rope_base, recompute, dense)[0];
  }
  return mix_inference(qkv, weights, spec, gh, gw, scale, lr, grad_norm, rope_base, recompute, dense);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vit3_cpu, m) {
  m.def(
      "mix(Tensor qkv, Tensor[] weights, int[] spec, int gh, int gw, float scale, float lr, bool grad_norm, "
      "float rope_base, bool recompute, bool dense) -> Tensor");
  m.def(
      "mix_forward(Tensor qkv, Tensor[] weights, int[] spec, int gh, int gw, float scale, float lr, bool grad_norm, "
      "float rope_base, bool recompute, bool dense, bool save, Tensor(a!) out) -> Tensor[]");
  m.def(
      "mix_backward(Tensor d_out, Tensor qkv, Tensor[] saved, int[] weight_shapes, int[] spec, int gh, int gw, "
      "float scale, float lr, bool grad_norm, float rope_base, bool recompute, bool dense, Tensor(a!) dqkv) -> Tensor[]");
  m.def("rope_2d(Tensor x, int gh, int gw, float base=10000.0, bool inverse=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(vit3_cpu, CPU, m) {
  m.impl("mix", &mix_inference);
  m.impl("mix_forward", &mix_forward);
  m.impl("mix_backward", &mix_backward);
  m.impl("rope_2d", &rope_2d);
}

TORCH_LIBRARY_IMPL(vit3_cpu, Autograd, m) {
  m.impl("mix", &mix_autograd);
}
