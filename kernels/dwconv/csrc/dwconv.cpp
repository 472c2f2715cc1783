// The 3x3 depthwise op on a CPU, on token rows: dwconv and dwconv_weight_grad (the official mixer's depthwise
// branch, and the block's CPE nodes, kernels/block/csrc/cpe.cpp), and the branch's TTT step
// built on them, dwconv_ttt_forward / dwconv_ttt_backward (the step between them is vit3_cpu.h's; the whole-mixer
// op, kernels/mix/csrc/mix.cpp, calls them directly). Built with the SwiGLU op (kernels/swiglu/csrc/swiglu.cpp)
// and the whole-mixer op into one extension, vit3_cpu (kernels/cpp.py): ops torch.ops.vit3_cpu.dwconv*. The same stages in PyTorch are kernels/dwconv/eager.py; the op's reference is
// kernels/dwconv/reference.py.

#include "vit3_cpu.h"

namespace {

using namespace vit3_cpu;

// The official mixer's depthwise 3x3 branch on token rows: x, out [B, N, C] (N = h * w in raster order) with
// unit stride along C and any other strides (views of the mixer's qkv projection, output and gradient);
// per-sample taps [1|B, 9, C] contiguous, tap (di, dj) at 3 (di + 1) + dj + 1. Each (sample, channel vector)
// walks the grid once, with zero padding, without oneDNN's fixed cost per call (docs/design/kernels.md).

// A [B, N, C] token tensor with unit stride along C: first element and the sample and token strides.
template <typename T>
struct Map {
  T* ptr;
  int64_t sb, sn;
  T* at(int64_t b, int64_t p) const { return ptr + b * sb + p * sn; }
};

template <typename T>
Map<T> map_of(const Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1)};
}

// Calls f(b, c0, lanes) over every (sample, channel vector) unit, spread over ATen's threads.
template <typename F>
void for_channel_vectors(int64_t B, int64_t C, int64_t W, F f) {
  const int64_t chunks = (C + W - 1) / W;
  at::parallel_for(0, B * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t c0 = (u % chunks) * W;
      f(u / chunks, c0, std::min(W, C - c0));
    }
  });
}

// Output columns per register block of the depthwise loops: each input vector is loaded once per block row and
// feeds up to three accumulators held in registers (one vector per output column), where a loop over the 9 taps
// per output would chain 9 dependent FMAs and reload every input 3 times per row.
constexpr int kCols = 8;

// Calls f(std::integral_constant<int, n>) for a block of n = 1..kCols columns (the block loops unroll on n).
template <typename F>
inline void with_cols(int64_t n, F f) {
  switch (n) {
    case 8: f(std::integral_constant<int, 8>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    default: f(std::integral_constant<int, 1>()); break;
  }
}
static_assert(kCols == 8, "with_cols covers 1..8 columns");

// `lanes` lanes from / to p; Full: all of them (plain vector moves, no mask and no test).
template <typename T, bool Full>
inline Vec<T> load_lanes(const T* p, int64_t lanes) {
  if constexpr (Full) {
    return Vec<T>::loadu(p);
  } else {
    return Vec<T>::loadu(p, lanes);
  }
}

template <typename T, bool Full>
inline void store_lanes(const Vec<T>& v, T* p, int64_t lanes) {
  if constexpr (Full) {
    v.store(p);
  } else {
    v.store(p, lanes);
  }
}

// One input row's contribution to output columns [j0, j0 + NJ) of one channel vector: acc[o] += Σ_dj kr[dj + 1] ⊙
// x[j0 + o + dj] (zero padding), x the row's first token (token stride sn), kr the row's three taps.
template <typename T, int NJ, bool Full>
inline void conv_row(const T* x, int64_t sn, const Vec<T>* kr, int64_t j0, int64_t gw, int64_t lanes, Vec<T>* acc) {
#pragma GCC unroll 10
  for (int t = 0; t < NJ + 2; ++t) {  // input column j0 - 1 + t feeds outputs t (tap 0), t - 1 (1), t - 2 (2)
    const int64_t j = j0 - 1 + t;
    if (j < 0 || j >= gw) continue;
    const Vec<T> xv = load_lanes<T, Full>(x + j * sn, lanes);
    if (t < NJ) acc[t] = at::vec::fmadd(kr[0], xv, acc[t]);
    if (t >= 1 && t - 1 < NJ) acc[t - 1] = at::vec::fmadd(kr[1], xv, acc[t - 1]);
    if (t >= 2) acc[t - 2] = at::vec::fmadd(kr[2], xv, acc[t - 2]);
  }
}

// One input row's contribution to the three taps kr of one channel vector from output columns [j0, j0 + NJ):
// acc[dj + 1] += Σ_o g[o] ⊙ x[j0 + o + dj], g the block's output gradient vectors.
template <typename T, int NJ, bool Full>
inline void weight_grad_row(const T* x, int64_t sn, const Vec<T>* g, int64_t j0, int64_t gw, int64_t lanes, Vec<T>* acc) {
#pragma GCC unroll 10
  for (int t = 0; t < NJ + 2; ++t) {
    const int64_t j = j0 - 1 + t;
    if (j < 0 || j >= gw) continue;
    const Vec<T> xv = load_lanes<T, Full>(x + j * sn, lanes);
    if (t < NJ) acc[0] = at::vec::fmadd(g[t], xv, acc[0]);
    if (t >= 1 && t - 1 < NJ) acc[1] = at::vec::fmadd(g[t - 1], xv, acc[1]);
    if (t >= 2) acc[2] = at::vec::fmadd(g[t - 2], xv, acc[2]);
  }
}

// One (sample, channel vector) unit of dwconv_impl over the whole grid: x, o its first input and output token (token
// strides sn, osn), k its nine taps. Its values are locals and the taps a local copy, so that they stay in
// registers (through the closure's references a compiler reloads them after every store to the output).
template <typename T, bool Full>
void dwconv_unit(const T* x, int64_t sn, T* o, int64_t osn, const Vec<T>* taps, const Vec<T> start, bool residual,
                 int64_t gh, int64_t gw, int64_t lanes) {
  Vec<T> k[9];
  for (int t = 0; t < 9; ++t) k[t] = taps[t];
  for (int64_t i = 0; i < gh; ++i) {
    const T* row = x + i * gw * sn;
    T* orow = o + i * gw * osn;
    for (int64_t j0 = 0; j0 < gw; j0 += kCols) {
      with_cols(std::min<int64_t>(kCols, gw - j0), [&](auto cols) {
        constexpr int NJ = decltype(cols)::value;
        Vec<T> acc[NJ];
        for (int c = 0; c < NJ; ++c) {
          acc[c] = residual ? start + load_lanes<T, Full>(row + (j0 + c) * sn, lanes) : start;
        }
        if (i > 0) conv_row<T, NJ, Full>(row - gw * sn, sn, k, j0, gw, lanes, acc);
        conv_row<T, NJ, Full>(row, sn, k + 3, j0, gw, lanes, acc);
        if (i + 1 < gh) conv_row<T, NJ, Full>(row + gw * sn, sn, k + 6, j0, gw, lanes, acc);
        for (int c = 0; c < NJ; ++c) store_lanes<T, Full>(acc[c], orow + (j0 + c) * osn, lanes);
      });
    }
  }
}

// out[b, p] = Σ_δ w[b, δ] ⊙ x[b, p + δ] (a per-sample depthwise 3x3 conv, cross-correlation as torch's),
// + bias [C] when defined, + x[b, p] when residual (ConvPosEnc: x + dwconv(x)).
template <typename T>
void dwconv_impl(
    const Tensor& x, const Tensor& w, const Tensor& out, int64_t gh, int64_t gw, const Tensor& bias, bool residual) {
  const int64_t B = x.size(0), C = x.size(2), ws = w.size(0) == 1 ? 0 : 9 * C;
  constexpr int64_t W = Vec<T>::size();
  const auto X = map_of<T>(x), O = map_of<T>(out);
  const T* taps = w.data_ptr<T>();
  const bool conv_layout = w.dim() == 4;  // a shared conv weight [C, 1, 3, 3]: tap t of channel c at 9 c + t
  for_channel_vectors(B, C, W, [&](int64_t b, int64_t c0, int64_t lanes) {
    Vec<T> k[9];
    if (conv_layout) {
      T buf[W];
      for (int64_t t = 0; t < 9; ++t) {
        for (int64_t l = 0; l < lanes; ++l) buf[l] = taps[(c0 + l) * 9 + t];
        k[t] = Vec<T>::loadu(buf, lanes);
      }
    } else {
      for (int64_t t = 0; t < 9; ++t) k[t] = Vec<T>::loadu(taps + b * ws + c0 + t * C, lanes);
    }
    const Vec<T> start = bias.defined() ? Vec<T>::loadu(bias.data_ptr<T>() + c0, lanes) : Vec<T>(T(0));
    const T* xs = X.at(b, 0) + c0;
    T* os = O.at(b, 0) + c0;
    if (lanes == W) {
      dwconv_unit<T, true>(xs, X.sn, os, O.sn, k, start, residual, gh, gw, lanes);
    } else {
      dwconv_unit<T, false>(xs, X.sn, os, O.sn, k, start, residual, gh, gw, lanes);
    }
  });
}

// One (sample, channel vector) unit of dwconv_weight_grad_impl: the nine taps' gradients into out (tap stride
// os), from g, x's first token of the unit (token strides gsn, xsn); values local, as dwconv_unit's.
template <typename T, bool Full>
void weight_grad_unit(const T* g, int64_t gsn, const T* x, int64_t xsn, T* out, int64_t os, int64_t gh, int64_t gw,
                      int64_t lanes) {
  Vec<T> acc[9];
  for (int t = 0; t < 9; ++t) acc[t] = Vec<T>(T(0));
  for (int64_t i = 0; i < gh; ++i) {
    const T* row = x + i * gw * xsn;
    const T* grow = g + i * gw * gsn;
    for (int64_t j0 = 0; j0 < gw; j0 += kCols) {
      with_cols(std::min<int64_t>(kCols, gw - j0), [&](auto cols) {
        constexpr int NJ = decltype(cols)::value;
        Vec<T> gv[NJ];
        for (int c = 0; c < NJ; ++c) gv[c] = load_lanes<T, Full>(grow + (j0 + c) * gsn, lanes);
        // the three rows spelled out: acc stays in registers with constant tap indices
        if (i > 0) weight_grad_row<T, NJ, Full>(row - gw * xsn, xsn, gv, j0, gw, lanes, acc);
        weight_grad_row<T, NJ, Full>(row, xsn, gv, j0, gw, lanes, acc + 3);
        if (i + 1 < gh) weight_grad_row<T, NJ, Full>(row + gw * xsn, xsn, gv, j0, gw, lanes, acc + 6);
      });
    }
  }
  for (int t = 0; t < 9; ++t) store_lanes<T, Full>(acc[t], out + t * os, lanes);
}

// g_w[b, δ] = Σ_p g[b, p] ⊙ x[b, p + δ] (the weight gradient of dwconv with output gradient g), g_w [B, 9, C].
template <typename T>
void dwconv_weight_grad_impl(const Tensor& g, const Tensor& x, const Tensor& gw_out, int64_t gh, int64_t gw) {
  const int64_t B = x.size(0), C = x.size(2);
  constexpr int64_t W = Vec<T>::size();
  const auto G = map_of<T>(g), X = map_of<T>(x);
  T* out = gw_out.data_ptr<T>();
  for_channel_vectors(B, C, W, [&](int64_t b, int64_t c0, int64_t lanes) {
    const T *gs = G.at(b, 0) + c0, *xs = X.at(b, 0) + c0;
    T* os = out + b * 9 * C + c0;
    if (lanes == W) {
      weight_grad_unit<T, true>(gs, G.sn, xs, X.sn, os, C, gh, gw, lanes);
    } else {
      weight_grad_unit<T, false>(gs, G.sn, xs, X.sn, os, C, gh, gw, lanes);
    }
  });
}

void check_maps(const std::vector<Tensor>& maps, int64_t gh, int64_t gw) {
  const auto& first = maps.front();
  for (const auto& t : maps) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == first.scalar_type(), "vit3_cpu: CPU tensors of one dtype only");
    TORCH_CHECK(t.dim() == 3 && t.sizes() == first.sizes(), "vit3_cpu: maps must all be [B, N, C] of one shape");
    TORCH_CHECK(t.stride(-1) == 1, "vit3_cpu: maps need unit stride along C");
  }
  TORCH_CHECK(gh > 0 && gw > 0 && gh * gw == first.size(1), "vit3_cpu: grid ", gh, "x", gw, " does not fit N=", first.size(1));
}

// taps [B, 9, C] (with broadcast also [1, 9, C] or a shared conv weight [C, 1, 3, 3]), contiguous, the maps' dtype.
void check_taps(const Tensor& w, const Tensor& x, bool broadcast) {
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous(), "vit3_cpu: taps must be contiguous, of the maps' dtype");
  const int64_t C = x.size(2);
  const bool conv = broadcast && w.dim() == 4 && w.size(0) == C && w.size(1) == 1 && w.size(2) == 3 && w.size(3) == 3;
  TORCH_CHECK(
      conv || (w.dim() == 3 && (w.size(0) == x.size(0) || (broadcast && w.size(0) == 1)) && w.size(1) == 9 && w.size(2) == C),
      "vit3_cpu: taps must be [", broadcast ? "1|" : "", "B, 9, C]", broadcast ? " or a weight [C, 1, 3, 3]" : "", ", got ",
      w.sizes());
}

}  // namespace

namespace vit3_cpu {

void dwconv(
    const Tensor& x, const Tensor& w, Tensor out, int64_t gh, int64_t gw, const std::optional<Tensor>& bias,
    bool residual) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_maps({x, out}, gh, gw);
  check_taps(w, x, true);
  const Tensor bb = bias.has_value() ? *bias : Tensor();
  if (bb.defined()) {
    TORCH_CHECK(bb.scalar_type() == x.scalar_type() && bb.is_contiguous() && bb.numel() == x.size(2),
                "vit3_cpu: bias must be a contiguous [C] of the maps' dtype");
  }
  VIT3_DISPATCH(x, dwconv_impl, x, w, out, gh, gw, bb, residual);
}

void dwconv_weight_grad(const Tensor& g, const Tensor& x, Tensor gw_out, int64_t gh, int64_t gw) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_maps({g, x}, gh, gw);
  check_taps(gw_out, x, false);
  VIT3_DISPATCH(x, dwconv_weight_grad_impl, g, x, gw_out, gh, gw);
}


// The depthwise branch's step on token rows (dwconv_impl's layout): G = -c Σ_p v[p] k[p + δ] (taps [B, 9, C]),
// the step over each channel's 9 taps, out = dwconv(q; W'). weight [1|B, C, 3, 3]. Returns G, the norms
// [B, 1, C] and W' (taps): what dwconv_ttt_backward needs.
std::vector<Tensor> dwconv_ttt_forward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& weight, Tensor out, int64_t gh, int64_t gw,
    double c, double lr, bool grad_norm) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_maps({q, k, v, out}, gh, gw);
  check_float(q);
  const int64_t B = q.size(0), C = q.size(2);
  TORCH_CHECK(weight.scalar_type() == q.scalar_type() && weight.dim() == 4 && (weight.size(0) == 1 || weight.size(0) == B) &&
                  weight.size(1) == C && weight.size(2) == 3 && weight.size(3) == 3,
              "vit3_cpu: the depthwise weight must be [1|B, C, 3, 3] = [1|", B, ", ", C, ", 3, 3], got ", weight.sizes());
  const Tensor w = weight.reshape({weight.size(0), C, 9}).transpose(1, 2).expand({B, 9, C}).contiguous();  // taps
  Tensor g = at::empty_like(w), w_new = at::empty_like(w), norm = at::empty({B, 1, C}, w.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "vit3_cpu_dwconv_ttt_forward", [&] {
    dwconv_weight_grad_impl<scalar_t>(v, k, g, gh, gw);
    step_impl<scalar_t>(g, w, w_new, norm, 9, scalar_t(c), scalar_t(lr), grad_norm);
    dwconv_impl<scalar_t>(q, w_new, out, gh, gw, Tensor(), false);
  });
  return {g, norm, w_new};
}

// The backward of dwconv_ttt_forward: dq = dwconv(dO; flipped W'), dW' = Σ_p dO[p] q[p + δ], dG through the step,
// dk = dwconv(v; flipped dG) (the input gradient of E = -c v, -c in dG), dv = dwconv(k; dG). Returns dW' [B, 9, C]
// (taps), the per-sample weight gradient.
Tensor dwconv_ttt_backward(
    const Tensor& d_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& norm,
    const Tensor& w_new, Tensor dq, Tensor dk, Tensor dv, int64_t gh, int64_t gw, double c, double lr, bool grad_norm) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_maps({d_out, q, k, v, dq, dk, dv}, gh, gw);
  check_float(q);
  for (const auto* t : {&g, &w_new}) check_taps(*t, q, false);
  const int64_t B = q.size(0), C = q.size(2);
  TORCH_CHECK(norm.sizes() == at::IntArrayRef({B, 1, C}) && norm.is_contiguous(), "vit3_cpu: norm must be [B, 1, C]");
  Tensor dw_new = at::empty_like(g), dg = at::empty_like(g);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "vit3_cpu_dwconv_ttt_backward", [&] {
    dwconv_impl<scalar_t>(d_out, w_new.flip(1), dq, gh, gw, Tensor(), false);
    dwconv_weight_grad_impl<scalar_t>(d_out, q, dw_new, gh, gw);
    step_backward_impl<scalar_t>(dw_new, g, norm, dg.data_ptr<scalar_t>(), C, 9, scalar_t(c), scalar_t(lr), grad_norm);
    dwconv_impl<scalar_t>(v, dg.flip(1), dk, gh, gw, Tensor(), false);
    dwconv_impl<scalar_t>(k, dg, dv, gh, gw, Tensor(), false);
  });
  return dw_new;
}

}  // namespace vit3_cpu

TORCH_LIBRARY_FRAGMENT(vit3_cpu, m) {
  m.def("dwconv(Tensor x, Tensor w, Tensor(a!) out, int gh, int gw, Tensor? bias=None, bool residual=False) -> ()");
  m.def("dwconv_weight_grad(Tensor g, Tensor x, Tensor(a!) gw_out, int gh, int gw) -> ()");
  m.def(
      "dwconv_ttt_forward(Tensor q, Tensor k, Tensor v, Tensor weight, Tensor(a!) out, int gh, int gw, float c, "
      "float lr, bool grad_norm) -> Tensor[]");
  m.def(
      "dwconv_ttt_backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor g, Tensor norm, Tensor w_new, "
      "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, int gh, int gw, float c, float lr, bool grad_norm) -> Tensor");
}

TORCH_LIBRARY_IMPL(vit3_cpu, CPU, m) {
  m.impl("dwconv", &vit3_cpu::dwconv);
  m.impl("dwconv_weight_grad", &vit3_cpu::dwconv_weight_grad);
  m.impl("dwconv_ttt_forward", &vit3_cpu::dwconv_ttt_forward);
  m.impl("dwconv_ttt_backward", &vit3_cpu::dwconv_ttt_backward);
}
