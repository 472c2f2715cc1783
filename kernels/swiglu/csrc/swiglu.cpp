// The official SwiGLU inner model's TTT step on a CPU (dot loss, one full-batch step): ttt_forward and
// ttt_backward, one op each, so a mixer branch costs one call per direction. Each runs two passes over the
// tokens that walk every (sample, head) problem, small problems grouped, large ones in token blocks of about
// a MiB, and the small per-(sample, head) step between them (W' = W - lr G / (||G|| + 1) and its backward,
// kernels/common.py's step, in vit3_cpu.h). Built with the depthwise op (kernels/dwconv/csrc/dwconv.cpp) and the
// whole-mixer op (kernels/mix/csrc/mix.cpp, which calls ttt_forward / ttt_backward directly: vit3_cpu.h) into one
// extension, vit3_cpu (kernels/cpp.py): ops torch.ops.vit3_cpu.ttt_forward / ttt_backward.
//
// The passes do every N-sized matmul (ATen, i.e. MKL) and fuse each elementwise chain between two matmuls
// into one loop over a block that is still in cache. The same passes in PyTorch are the tiled path of
// kernels/swiglu/eager.py; the op's reference is kernels/swiglu/reference.py.
//
// Layouts: q, k, v [B, H, N, d] with unit stride along d; the two weights side by side, [W1 | W2]
// [B, H, d, 2d] contiguous, so each product with both (k [W1 | W2], kᵀ [P1 | P2], dY [W1' | W2']ᵀ ...) is one
// matmul twice as wide; Z = k W and Y = q W' [B, H, N, 2d] when saved (else recomputed in the backward, the
// memory-lean mode); destinations (out, dq, dk, dv, d_out) [B, H, N, d] with unit stride along d and any
// other strides (views of the mixer's qkv gradient and output).
//
// Small problems: the heads of one sample whose tokens fit a block form a group, and each matmul of a group
// is one batched call (bmm), each elementwise chain one loop over the group: a few ATen calls per group
// instead of a dozen per (sample, head).
//
// Threads: the groups are spread over ATen's threads, each walking its own blocks with its own scratch, so
// matmuls run single-threaded on cache-resident blocks; with fewer groups than threads the groups run one
// after another and every op is parallel inside.

#include "vit3_cpu.h"

namespace {

using namespace vit3_cpu;

// exp in the vector unit: ATen's fast float exp where the CPU has one, else the element-wise std::exp.
template <typename T>
inline Vec<T> vexp(const Vec<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.map([](T a) { return std::exp(a); });
  }
}

// One unit of work: heads [h0, h0 + gh) of sample b, tokens [n0, n0 + n). Small problems are grouped (gh > 1,
// all their tokens: the matmuls of a group are one batched call each), large ones walked in token blocks.
struct Group {
  int64_t b, h0, gh, n0, n;
};

// Heads and tokens of a group of a [B, H, N, c] tensor: [gh, n, c] (a view: one as_strided, where select and
// two narrows cost three dispatched ops; a mixer call makes a few dozen such views).
inline Tensor tokens_of(const Tensor& t, const Group& g) {
  const auto s = t.strides();
  return t.as_strided({g.gh, g.n, t.size(3)}, {s[1], s[2], s[3]},
                      t.storage_offset() + g.b * s[0] + g.h0 * s[1] + g.n0 * s[2]);
}

// Heads of a group of a [B, H, r, c] weight tensor: [gh, r, c] (a view).
inline Tensor weights_of(const Tensor& t, const Group& g) {
  const auto s = t.strides();
  return t.as_strided({g.gh, t.size(2), t.size(3)}, {s[1], s[2], s[3]}, t.storage_offset() + g.b * s[0] + g.h0 * s[1]);
}

// A [groups, rows, d] block: first element, group and row strides (elements).
template <typename T>
struct Rows {
  T* ptr;
  int64_t s0, s1;
  T* row(int64_t i, int64_t r) const { return ptr + i * s0 + r * s1; }
};

// Columns [c0, c0 + d) of a [groups, rows, cols] tensor with unit stride along cols.
template <typename T>
Rows<T> cols(const Tensor& t, int64_t c0 = 0) {
  return {t.data_ptr<T>() + c0, t.stride(0), t.stride(1)};
}

// Where an element-wise chain reads and writes in a [groups, rows, d] block: row r of group i from column c,
// as V = Vec<T> (the vector lanes from c) or V = T (column c alone, the tail). A chain written once over `auto`
// values is the vector loop and its scalar tail both.
template <typename T, typename V>
struct Lane {
  int64_t i, r, c;
  static constexpr bool kScalar = std::is_same_v<V, T>;

  V operator()(const Rows<T>& x) const {
    if constexpr (kScalar) {
      return x.row(i, r)[c];
    } else {
      return V::loadu(x.row(i, r) + c);
    }
  }
  void store(const Rows<T>& x, const V& v) const {
    if constexpr (kScalar) {
      x.row(i, r)[c] = v;
    } else {
      v.store(x.row(i, r) + c);
    }
  }
  // The constant a, and 1 / (1 + exp(-x)) (in the vector unit with vexp), as V.
  static V of(T a) { return V(a); }
  static V sigmoid(const V& x) {
    if constexpr (kScalar) {
      return T(1) / (T(1) + std::exp(-x));
    } else {
      const V one(T(1));
      return one / (one + vexp(x.neg()));
    }
  }
};

// Applies f(Lane) over a [groups, rows, d] block in vector lane groups, with a scalar tail.
template <typename T, typename F>
inline void each(const Group& g, int64_t d, F f) {
  constexpr int64_t W = Vec<T>::size();
  for (int64_t i = 0; i < g.gh; ++i) {
    for (int64_t r = 0; r < g.n; ++r) {
      int64_t c = 0;
      for (; c + W <= d; c += W) f(Lane<T, Vec<T>>{i, r, c});
      for (; c < d; ++c) f(Lane<T, T>{i, r, c});
    }
  }
}

// Runs body(group, scratch) over tokens [B, H, N, d] cut into groups (see Group) of at most `block` rows
// (gh * n), in token order within a head (accumulations stay per head). When a head's tokens fit a block,
// heads of one sample are grouped, as many as fill kGroupRows but no fewer groups than threads, the heads
// split evenly; else each head is walked in blocks of `block` tokens. Groups are spread across threads when there
// are enough of them, else run one after another (every op then parallel inside). scratch: `slots` buffers of
// block * `width` elements per thread; `view(scratch, slot, group, c)` shapes one as [gh, n, c].
// Rows (heads x tokens) a group of small problems grows to: larger groups leave the core's cache
// (docs/design/kernels.md).
constexpr int64_t kGroupRows = 1024;

template <typename F>
void for_groups(const Tensor& tokens, int64_t block, int64_t slots, int64_t width, F body) {
  const int64_t B = tokens.size(0), H = tokens.size(1), N = tokens.size(2);
  const int64_t threads = at::get_num_threads();
  int64_t gh = 1, nb = std::min(block, N);
  if (N <= block) {
    // as few groups per sample as fill kGroupRows, but no fewer groups than threads, heads split evenly
    const int64_t most = std::max<int64_t>(1, std::min(H, std::min(block, kGroupRows) / N));
    const int64_t per_sample = std::min(H, std::max((H + most - 1) / most, (threads + B - 1) / B));
    gh = (H + per_sample - 1) / per_sample;
  }
  std::vector<Group> groups;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h0 = 0; h0 < H; h0 += gh) {
      for (int64_t n0 = 0; n0 < N; n0 += nb) {
        groups.push_back({b, h0, std::min(gh, H - h0), n0, std::min(nb, N - n0)});
      }
    }
  }
  const int64_t per_head = (N + nb - 1) / nb;  // consecutive groups of one head (n0 = 0, nb, ...)
  const int64_t units = static_cast<int64_t>(groups.size()) / per_head;
  const bool spread = threads > 1 && units >= threads;
  Tensor scratch = at::empty({spread ? threads : 1, slots, gh * nb * width}, tokens.options());
  auto run = [&](int64_t begin, int64_t end, const Tensor& s) {
    for (int64_t u = begin; u < end; ++u) {
      for (int64_t j = 0; j < per_head; ++j) body(groups[u * per_head + j], s);
    }
  };
  if (!spread) {
    run(0, units, scratch[0]);
    return;
  }
  // Worker threads start with default thread-local state (grad mode on, autograd keys active): give them ours.
  const at::ThreadLocalState state;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard guard(state);
    run(begin, end, scratch[at::get_thread_num()]);
  });
}

// Scratch slot `slot` of one thread ([slots, size], contiguous) as a dense [gh, n, c] tensor for group g.
inline Tensor view(const Tensor& s, int64_t slot, const Group& g, int64_t c) {
  return s.as_strided({g.gh, g.n, c}, {g.n * c, c, 1}, s.storage_offset() + slot * s.stride(0));
}

// dense: contiguous buffers (weights, saved pre-activations); views: [B, H, N, d] tensors with unit stride along
// d. All share the first view's dtype.
void check_inputs(const std::vector<Tensor>& dense, const std::vector<Tensor>& views) {
  const auto dtype = views.front().scalar_type();
  for (const auto& t : dense) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, "vit3_cpu: CPU tensors of one dtype only");
    TORCH_CHECK(t.is_contiguous(), "vit3_cpu: weights and saved buffers must be contiguous");
  }
  const auto shape = views.front().sizes();
  for (const auto& t : views) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, "vit3_cpu: CPU tensors of one dtype only");
    TORCH_CHECK(t.dim() == 4 && t.sizes() == shape, "vit3_cpu: tokens must all be [B, H, N, d] of one shape");
    TORCH_CHECK(t.stride(-1) == 1, "vit3_cpu: tokens need unit stride along d");
  }
}

// [B, H, rows, cols] with the given rows and cols (a weight pair [d, 2d], a saved pre-activation [N, 2d], ...).
void check_shape(const Tensor& t, const Tensor& tokens, int64_t rows, int64_t width, const char* name) {
  TORCH_CHECK(
      t.dim() == 4 && t.size(0) == tokens.size(0) && t.size(1) == tokens.size(1) && t.size(2) == rows &&
          t.size(3) == width,
      "vit3_cpu: ", name, " must be [B, H, ", rows, ", ", width, "], got ", t.sizes());
}

// Pass 1 of the forward: Z = k [W1 | W2], P = [v ⊙ A | v ⊙ Z1 ⊙ A'] (A = silu(Z2), A' = σ + A (1 - σ)),
// G += kᵀ P. w, g [B, H, d, 2d] (g accumulates, zeroed by the caller); z [B, H, N, 2d] or undefined.
template <typename T>
void inner_grad_impl(
    const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& g, const Tensor& z, int64_t block) {
  const int64_t d = k.size(3);
  for_groups(k, block, 2, 2 * d, [&](const Group& gr, const Tensor& s) {
    const Tensor kt = tokens_of(k, gr);
    Tensor zt = z.defined() ? tokens_of(z, gr) : view(s, 0, gr, 2 * d);
    const Tensor p = view(s, 1, gr, 2 * d);
    at::bmm_out(zt, kt, weights_of(w, gr));
    auto Z1 = cols<T>(zt), Z2 = cols<T>(zt, d), V = cols<T>(tokens_of(v, gr));
    auto P1 = cols<T>(p), P2 = cols<T>(p, d);
    each<T>(gr, d, [&](const auto& e) {
      const auto z2 = e(Z2), vv = e(V), sig = e.sigmoid(z2), a = z2 * sig;
      e.store(P1, a * vv);
      e.store(P2, (sig + a * (e.of(1) - sig)) * e(Z1) * vv);
    });
    weights_of(g, gr).baddbmm_(kt.transpose(1, 2), p);
  });
}

// Pass 2 of the forward: Y = q [W1' | W2'], out = Y1 ⊙ silu(Y2). y [B, H, N, 2d] or undefined.
template <typename T>
void readout_impl(const Tensor& q, const Tensor& w_new, const Tensor& out, const Tensor& y, int64_t block) {
  const int64_t d = q.size(3);
  for_groups(q, block, 1, 2 * d, [&](const Group& gr, const Tensor& s) {
    Tensor yt = y.defined() ? tokens_of(y, gr) : view(s, 0, gr, 2 * d);
    at::bmm_out(yt, tokens_of(q, gr), weights_of(w_new, gr));
    auto Y1 = cols<T>(yt), Y2 = cols<T>(yt, d), O = cols<T>(tokens_of(out, gr));
    each<T>(gr, d, [&](const auto& e) {
      const auto y2 = e(Y2);
      e.store(O, e(Y1) * y2 * e.sigmoid(y2));
    });
  });
}

// Pass 1 of the backward: dY = [dO ⊙ silu(Y2) | dO ⊙ Y1 ⊙ silu'(Y2)], dq = dY [W1' | W2']ᵀ, dW' += qᵀ dY
// (dw [B, H, d, 2d], zeroed by the caller). y: the saved Y = q W' [B, H, N, 2d], or undefined: recomputed.
template <typename T>
void readout_backward_impl(const Tensor& d_out, const Tensor& q, const Tensor& y, const Tensor& w_new,
                           const Tensor& dq, const Tensor& dw, int64_t block) {
  const int64_t d = q.size(3);
  for_groups(q, block, 2, 2 * d, [&](const Group& gr, const Tensor& s) {
    const Tensor qt = tokens_of(q, gr), wt = weights_of(w_new, gr), dy = view(s, 0, gr, 2 * d);
    Tensor yt = y.defined() ? tokens_of(y, gr) : view(s, 1, gr, 2 * d);
    if (!y.defined()) at::bmm_out(yt, qt, wt);
    auto Y1 = cols<T>(yt), Y2 = cols<T>(yt, d), DO = cols<T>(tokens_of(d_out, gr));
    auto D1 = cols<T>(dy), D2 = cols<T>(dy, d);
    each<T>(gr, d, [&](const auto& e) {
      const auto y2 = e(Y2), dout = e(DO), sig = e.sigmoid(y2), one = e.of(1);
      e.store(D1, dout * y2 * sig);
      e.store(D2, dout * e(Y1) * sig * (one + y2 * (one - sig)));
    });
    Tensor dqt = tokens_of(dq, gr);
    at::bmm_out(dqt, dy, wt.transpose(1, 2));
    weights_of(dw, gr).baddbmm_(qt.transpose(1, 2), dy);
  });
}

// Pass 2 of the backward. dgw = [dG1 | dG2 | W1 | W2] [B, H, d, 4d] (dG with the -c of E = -c v folded in):
// dP = k dG, dv = dP1 ⊙ A + dP2 ⊙ Z1 ⊙ A', dZ1 = v ⊙ dP2 ⊙ A', dZ2 = v ⊙ (dP1 ⊙ A' + dP2 ⊙ Z1 ⊙ A''),
// dk = [P1 | P2 | dZ1 | dZ2] [dG1 | dG2 | W1 | W2]ᵀ (one matmul), dW += kᵀ dZ. z: the saved Z = k W
// [B, H, N, 2d], or undefined: recomputed.
template <typename T>
void inner_backward_impl(const Tensor& k, const Tensor& v, const Tensor& z, const Tensor& dgw, const Tensor& dk,
                         const Tensor& dv, const Tensor& dw, int64_t block) {
  const int64_t d = k.size(3);
  for_groups(k, block, 2, 4 * d, [&](const Group& gr, const Tensor& s) {
    const Tensor kt = tokens_of(k, gr), mt = weights_of(dgw, gr);
    // dP = k dG and, when Z was not saved, Z = k W: then one matmul k [dG | W] = [dP | Z], twice as wide.
    Tensor dp, zt;
    if (z.defined()) {
      dp = view(s, 0, gr, 2 * d);
      at::bmm_out(dp, kt, mt.narrow(2, 0, 2 * d));
      zt = tokens_of(z, gr);
    } else {
      Tensor dpz = view(s, 0, gr, 4 * d);
      at::bmm_out(dpz, kt, mt);
      dp = dpz.narrow(2, 0, 2 * d);
      zt = dpz.narrow(2, 2 * d, 2 * d);
    }
    Tensor pz = view(s, 1, gr, 4 * d);  // [P1 | P2 | dZ1 | dZ2]
    auto Z1 = cols<T>(zt), Z2 = cols<T>(zt, d), V = cols<T>(tokens_of(v, gr)), DV = cols<T>(tokens_of(dv, gr));
    auto DP1 = cols<T>(dp), DP2 = cols<T>(dp, d);
    auto P1 = cols<T>(pz), P2 = cols<T>(pz, d), DZ1 = cols<T>(pz, 2 * d), DZ2 = cols<T>(pz, 3 * d);
    each<T>(gr, d, [&](const auto& e) {
      const auto one = e.of(1), two = e.of(2), z1 = e(Z1), z2 = e(Z2), vv = e(V), dp1 = e(DP1), dp2 = e(DP2);
      const auto sig = e.sigmoid(z2), a = z2 * sig, u = sig * (one - sig);
      const auto a1 = sig + z2 * u, a2 = u * (two + z2 - two * a);
      const auto rr = dp2 * z1, va = vv * a1;
      e.store(DV, dp1 * a + rr * a1);
      e.store(DZ1, dp2 * va);
      e.store(DZ2, dp1 * va + rr * vv * a2);
      e.store(P1, a * vv);
      e.store(P2, va * z1);
    });
    Tensor dkt = tokens_of(dk, gr);
    at::bmm_out(dkt, pz, mt.transpose(1, 2));
    weights_of(dw, gr).baddbmm_(kt.transpose(1, 2), pz.narrow(2, 2 * d, 2 * d));
  });
}

void check_block(int64_t block) {
  TORCH_CHECK(block > 0, "vit3_cpu: block must be a positive number of tokens, got ", block);
}

// An optional saved pre-activation buffer (Z or Y, [B, H, N, 2d] like q's tokens), checked; undefined if absent.
Tensor saved_buffer(const std::optional<Tensor>& t, const Tensor& q) {
  if (!t.has_value()) return Tensor();
  check_inputs({*t}, {q});
  check_shape(*t, q, q.size(2), 2 * q.size(3), "z and y");
  return *t;
}

}  // namespace

namespace vit3_cpu {

// The forward of one step: w = [W1 | W2] per sample, pass 1 (G), the step, pass 2 (the read-out into out).
// Returns w, G (times -c), the column norms [B, H, 1, 2d] and W' [B, H, d, 2d]: what the backward needs.
std::vector<Tensor> ttt_forward(
    const Tensor& q,
    const Tensor& k,
    const Tensor& v,
    const Tensor& w1,
    const Tensor& w2,
    Tensor out,
    const std::optional<Tensor>& z,
    const std::optional<Tensor>& y,
    double c,
    double lr,
    bool grad_norm,
    int64_t block) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // raw kernel: its outputs are plain buffers
  check_inputs({}, {q, k, v, out});
  const int64_t B = q.size(0), H = q.size(1), d = q.size(3);
  for (const auto* wi : {&w1, &w2}) {
    TORCH_CHECK(wi->scalar_type() == q.scalar_type() && wi->dim() == 4 && (wi->size(0) == 1 || wi->size(0) == B) &&
                    wi->size(1) == H && wi->size(2) == d && wi->size(3) == d,
                "vit3_cpu: w1, w2 must be [1|B, H, d, d] = [1|", B, ", ", H, ", ", d, ", ", d, "], got ", wi->sizes());
  }
  const Tensor w = at::cat({w1.expand({B, H, d, d}), w2.expand({B, H, d, d})}, 3);  // [B, H, d, 2d]
  const Tensor zz = saved_buffer(z, q), yy = saved_buffer(y, q);
  check_block(block);
  check_float(q);
  Tensor g = at::zeros_like(w), w_new = at::empty_like(w), norm = at::empty({B, H, 1, 2 * d}, w.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "vit3_cpu_ttt_forward", [&] {
    inner_grad_impl<scalar_t>(k, v, w, g, zz, block);
    step_impl<scalar_t>(g, w, w_new, norm, d, scalar_t(c), scalar_t(lr), grad_norm);
    readout_impl<scalar_t>(q, w_new, out, yy, block);
  });
  return {w, g, norm, w_new};
}

// The backward of ttt_forward from d_out: pass 1 (dq, dW'), the step's backward (dG), pass 2 (dk, dv, kᵀ dZ).
// z, y: the saved pre-activations or None (recomputed). Returns dW [B, H, d, 2d] per sample.
Tensor ttt_backward(
    const Tensor& d_out,
    const Tensor& q,
    const Tensor& k,
    const Tensor& v,
    const std::optional<Tensor>& z,
    const std::optional<Tensor>& y,
    const Tensor& w,
    const Tensor& g,
    const Tensor& norm,
    const Tensor& w_new,
    Tensor dq,
    Tensor dk,
    Tensor dv,
    double c,
    double lr,
    bool grad_norm,
    int64_t block) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_inputs({w, g, norm, w_new}, {d_out, q, k, v, dq, dk, dv});
  const int64_t B = q.size(0), H = q.size(1), d = q.size(3);
  for (const auto* t : {&w, &g, &w_new}) check_shape(*t, q, d, 2 * d, "w, g and w_new");
  check_shape(norm, q, 1, 2 * d, "norm");
  const Tensor zz = saved_buffer(z, q), yy = saved_buffer(y, q);
  check_block(block);
  check_float(q);
  Tensor dw = at::zeros_like(w);
  Tensor dgw = at::empty({B, H, d, 4 * d}, w.options());  // [dG | W]
  dgw.narrow(3, 2 * d, 2 * d).copy_(w);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "vit3_cpu_ttt_backward", [&] {
    readout_backward_impl<scalar_t>(d_out, q, yy, w_new, dq, dw, block);
    // before dw gathers kᵀ dZ below: dW' alone feeds the step's backward
    step_backward_impl<scalar_t>(dw, g, norm, dgw.data_ptr<scalar_t>(), 4 * d, d, scalar_t(c), scalar_t(lr), grad_norm);
    inner_backward_impl<scalar_t>(k, v, zz, dgw, dk, dv, dw, block);
  });
  return dw;
}

}  // namespace vit3_cpu

TORCH_LIBRARY_FRAGMENT(vit3_cpu, m) {
  m.def(
      "ttt_forward(Tensor q, Tensor k, Tensor v, Tensor w1, Tensor w2, Tensor(a!) out, Tensor(b!)? z, "
      "Tensor(c!)? y, float c, float lr, bool grad_norm, int block) -> Tensor[]");
  m.def(
      "ttt_backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor? z, Tensor? y, Tensor w, Tensor g, "
      "Tensor norm, Tensor w_new, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, float c, float lr, "
      "bool grad_norm, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(vit3_cpu, CPU, m) {
  m.impl("ttt_forward", &vit3_cpu::ttt_forward);
  m.impl("ttt_backward", &vit3_cpu::ttt_backward);
}
