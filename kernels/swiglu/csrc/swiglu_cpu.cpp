// The official SwiGLU inner model's TTT step on a CPU (dot loss, one full-batch step): ttt_forward and
// ttt_backward, one op each, so a mixer branch costs one call per direction. Each runs two passes over the
// tokens that walk every (sample, head) problem, small problems grouped, large ones in token blocks of about
// a MiB, and the small per-(sample, head) step between them (W' = W - lr G / (||G|| + 1) and its backward,
// kernels/common.py's step). The same extension holds the 3x3 depthwise op on token rows (the dwconv branch
// with its step, ConvPosEnc), at the end.
//
// The passes do every N-sized matmul (ATen, i.e. MKL) and fuse each elementwise chain between two matmuls
// into one loop over a block that is still in cache. The same passes in PyTorch are the tiled path of
// vit3/kernels/swiglu/eager.py; the op's reference is vit3/kernels/swiglu/reference.py.
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using at::Tensor;

template <typename T>
using Vec = at::vec::Vectorized<T>;

// exp in the vector unit: ATen's fast float exp where the CPU has one, else the element-wise std::exp.
template <typename T>
inline Vec<T> vexp(const Vec<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.map([](T a) { return std::exp(a); });
  }
}

template <typename T>
inline Vec<T> vsigmoid(const Vec<T>& x) {
  const Vec<T> one(T(1));
  return one / (one + vexp(x.neg()));
}

template <typename T>
inline T ssigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
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

// Applies f(group, row, first column) over a [groups, rows, d] block in vector lane groups, with a scalar tail.
template <typename T, typename FV, typename FS>
inline void each(const Group& g, int64_t d, FV fv, FS fs) {
  constexpr int64_t W = Vec<T>::size();
  for (int64_t i = 0; i < g.gh; ++i) {
    for (int64_t r = 0; r < g.n; ++r) {
      int64_t c = 0;
      for (; c + W <= d; c += W) fv(i, r, c);
      for (; c < d; ++c) fs(i, r, c);
    }
  }
}

// Runs body(group, scratch) over tokens [B, H, N, d] cut into groups (see Group) of at most `block` rows
// (gh * n), in token order within a head (accumulations stay per head). When a head's tokens fit a block,
// heads of one sample are grouped, as many as fill kGroupRows but no fewer groups than threads, the heads
// split evenly; else each head is walked in blocks of `block` tokens. Groups are spread across threads when there
// are enough of them, else run one after another (every op then parallel inside). scratch: `slots` buffers of
// block * `width` elements per thread; `view(scratch, slot, group, c)` shapes one as [gh, n, c].
// Rows (heads x tokens) a group of small problems grows to. Measured on the 2-core VM, one thread, the SwiGLU
// step forward / forward + backward against one head per call: 1.24x / 1.09x at 6 heads x 196 tokens (d = 32),
// 1.7x / 1.3x at 16 x 49; larger groups lose it again in training (0.97x at 4096 rows) and at 784 tokens
// (0.94x), where one head's calls are already long and a group's blocks leave the core's cache.
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
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, "swiglu_cpu: CPU tensors of one dtype only");
    TORCH_CHECK(t.is_contiguous(), "swiglu_cpu: weights and saved buffers must be contiguous");
  }
  const auto shape = views.front().sizes();
  for (const auto& t : views) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, "swiglu_cpu: CPU tensors of one dtype only");
    TORCH_CHECK(t.dim() == 4 && t.sizes() == shape, "swiglu_cpu: tokens must all be [B, H, N, d] of one shape");
    TORCH_CHECK(t.stride(-1) == 1, "swiglu_cpu: tokens need unit stride along d");
  }
}

// [B, H, rows, cols] with the given rows and cols (a weight pair [d, 2d], a saved pre-activation [N, 2d], ...).
void check_shape(const Tensor& t, const Tensor& tokens, int64_t rows, int64_t width, const char* name) {
  TORCH_CHECK(
      t.dim() == 4 && t.size(0) == tokens.size(0) && t.size(1) == tokens.size(1) && t.size(2) == rows &&
          t.size(3) == width,
      "swiglu_cpu: ", name, " must be [B, H, ", rows, ", ", width, "], got ", t.sizes());
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
    each<T>(
        gr, d,
        [&](int64_t i, int64_t r, int64_t c) {
          const Vec<T> z2v = Vec<T>::loadu(Z2.row(i, r) + c), vv = Vec<T>::loadu(V.row(i, r) + c);
          const Vec<T> sig = vsigmoid(z2v), a = z2v * sig;
          (a * vv).store(P1.row(i, r) + c);
          ((sig + a * (Vec<T>(T(1)) - sig)) * Vec<T>::loadu(Z1.row(i, r) + c) * vv).store(P2.row(i, r) + c);
        },
        [&](int64_t i, int64_t r, int64_t c) {
          const T z2s = Z2.row(i, r)[c], vs = V.row(i, r)[c], sig = ssigmoid(z2s), a = z2s * sig;
          P1.row(i, r)[c] = a * vs;
          P2.row(i, r)[c] = (sig + a * (T(1) - sig)) * Z1.row(i, r)[c] * vs;
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
    each<T>(
        gr, d,
        [&](int64_t i, int64_t r, int64_t c) {
          const Vec<T> y2v = Vec<T>::loadu(Y2.row(i, r) + c);
          (Vec<T>::loadu(Y1.row(i, r) + c) * y2v * vsigmoid(y2v)).store(O.row(i, r) + c);
        },
        [&](int64_t i, int64_t r, int64_t c) {
          const T y2s = Y2.row(i, r)[c];
          O.row(i, r)[c] = Y1.row(i, r)[c] * y2s * ssigmoid(y2s);
        });
  });
}

// Pass 1 of the backward: dY = [dO ⊙ silu(Y2) | dO ⊙ Y1 ⊙ silu'(Y2)], dq = dY [W1' | W2']ᵀ, dW' += qᵀ dY
// (dw [B, H, d, 2d], zeroed by the caller). y: the saved Y = q W' [B, H, N, 2d], or undefined: recomputed.
template <typename T>
void readout_backward_impl(
    const Tensor& d_out,
    const Tensor& q,
    const Tensor& y,
    const Tensor& w_new,
    const Tensor& dq,
    const Tensor& dw,
    int64_t block) {
  const int64_t d = q.size(3);
  for_groups(q, block, 2, 2 * d, [&](const Group& gr, const Tensor& s) {
    const Tensor qt = tokens_of(q, gr), wt = weights_of(w_new, gr), dy = view(s, 0, gr, 2 * d);
    Tensor yt = y.defined() ? tokens_of(y, gr) : view(s, 1, gr, 2 * d);
    if (!y.defined()) at::bmm_out(yt, qt, wt);
    auto Y1 = cols<T>(yt), Y2 = cols<T>(yt, d), DO = cols<T>(tokens_of(d_out, gr));
    auto D1 = cols<T>(dy), D2 = cols<T>(dy, d);
    each<T>(
        gr, d,
        [&](int64_t i, int64_t r, int64_t c) {
          const Vec<T> y2v = Vec<T>::loadu(Y2.row(i, r) + c), dov = Vec<T>::loadu(DO.row(i, r) + c);
          const Vec<T> sig = vsigmoid(y2v), one(T(1));
          (dov * y2v * sig).store(D1.row(i, r) + c);
          (dov * Vec<T>::loadu(Y1.row(i, r) + c) * sig * (one + y2v * (one - sig))).store(D2.row(i, r) + c);
        },
        [&](int64_t i, int64_t r, int64_t c) {
          const T y2s = Y2.row(i, r)[c], dos = DO.row(i, r)[c], sig = ssigmoid(y2s);
          D1.row(i, r)[c] = dos * y2s * sig;
          D2.row(i, r)[c] = dos * Y1.row(i, r)[c] * sig * (T(1) + y2s * (T(1) - sig));
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
void inner_backward_impl(
    const Tensor& k,
    const Tensor& v,
    const Tensor& z,
    const Tensor& dgw,
    const Tensor& dk,
    const Tensor& dv,
    const Tensor& dw,
    int64_t block) {
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
    each<T>(
        gr, d,
        [&](int64_t i, int64_t r, int64_t c) {
          const Vec<T> one(T(1)), two(T(2));
          const Vec<T> z1v = Vec<T>::loadu(Z1.row(i, r) + c), z2v = Vec<T>::loadu(Z2.row(i, r) + c);
          const Vec<T> vv = Vec<T>::loadu(V.row(i, r) + c);
          const Vec<T> dp1v = Vec<T>::loadu(DP1.row(i, r) + c), dp2v = Vec<T>::loadu(DP2.row(i, r) + c);
          const Vec<T> sig = vsigmoid(z2v), a = z2v * sig, u = sig * (one - sig);
          const Vec<T> a1 = sig + z2v * u, a2 = u * (two + z2v - two * a);
          const Vec<T> rr = dp2v * z1v, va = vv * a1;
          (dp1v * a + rr * a1).store(DV.row(i, r) + c);
          (dp2v * va).store(DZ1.row(i, r) + c);
          (dp1v * va + rr * vv * a2).store(DZ2.row(i, r) + c);
          (a * vv).store(P1.row(i, r) + c);
          (va * z1v).store(P2.row(i, r) + c);
        },
        [&](int64_t i, int64_t r, int64_t c) {
          const T z1s = Z1.row(i, r)[c], z2s = Z2.row(i, r)[c], vs = V.row(i, r)[c];
          const T dp1s = DP1.row(i, r)[c], dp2s = DP2.row(i, r)[c];
          const T sig = ssigmoid(z2s), a = z2s * sig, u = sig * (T(1) - sig);
          const T a1 = sig + z2s * u, a2 = u * (T(2) + z2s - T(2) * a);
          const T rr = dp2s * z1s, va = vs * a1;
          DV.row(i, r)[c] = dp1s * a + rr * a1;
          DZ1.row(i, r)[c] = dp2s * va;
          DZ2.row(i, r)[c] = dp1s * va + rr * vs * a2;
          P1.row(i, r)[c] = a * vs;
          P2.row(i, r)[c] = va * z1s;
        });
    Tensor dkt = tokens_of(dk, gr);
    at::bmm_out(dkt, pz, mt.transpose(1, 2));
    weights_of(dw, gr).baddbmm_(kt.transpose(1, 2), pz.narrow(2, 2 * d, 2 * d));
  });
}

// The inner step on problems of [rows, cols] (contiguous, one after another): G <- -c G (the -c of E = -c v),
// n_j = ||G[:, j]||, W' = W - lr G / (n + 1), or W - lr G without the normalisation (n = 0 then). Tiny next to
// the passes; here so that a step costs no Python and no ATen calls. The formula is kernels/common.py's step.
template <typename T>
void step_impl(const Tensor& g, const Tensor& w, const Tensor& w_new, const Tensor& norm, int64_t rows, T c, T lr, bool grad_norm) {
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
void step_backward_impl(
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

// The official mixer's depthwise 3x3 branch on token rows: x, out [B, N, C] (N = h * w in raster order) with
// unit stride along C and any other strides (views of the mixer's qkv projection, output and gradient);
// per-sample taps [1|B, 9, C] contiguous, tap (di, dj) at 3 (di + 1) + dj + 1. Each (sample, channel vector)
// walks the grid once, with zero padding; oneDNN's depthwise calls cost ~60-100 µs each at 14x14 here, this
// costs a few.

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

// One input row's contribution to output columns [j0, j0 + NJ) of one channel vector: acc[o] += Σ_dj kr[dj + 1] ⊙
// x[j0 + o + dj] (zero padding), x the row's first token (token stride sn), kr the row's three taps.
template <typename T, int NJ>
inline void conv_row(const T* x, int64_t sn, const Vec<T>* kr, int64_t j0, int64_t gw, int64_t lanes, Vec<T>* acc) {
#pragma GCC unroll 10
  for (int t = 0; t < NJ + 2; ++t) {  // input column j0 - 1 + t feeds outputs t (tap 0), t - 1 (1), t - 2 (2)
    const int64_t j = j0 - 1 + t;
    if (j < 0 || j >= gw) continue;
    const Vec<T> xv = Vec<T>::loadu(x + j * sn, lanes);
    if (t < NJ) acc[t] = at::vec::fmadd(kr[0], xv, acc[t]);
    if (t >= 1 && t - 1 < NJ) acc[t - 1] = at::vec::fmadd(kr[1], xv, acc[t - 1]);
    if (t >= 2) acc[t - 2] = at::vec::fmadd(kr[2], xv, acc[t - 2]);
  }
}

// One input row's contribution to the three taps kr of one channel vector from output columns [j0, j0 + NJ):
// acc[dj + 1] += Σ_o g[o] ⊙ x[j0 + o + dj], g the block's output gradient vectors.
template <typename T, int NJ>
inline void weight_grad_row(const T* x, int64_t sn, const Vec<T>* g, int64_t j0, int64_t gw, int64_t lanes, Vec<T>* acc) {
#pragma GCC unroll 10
  for (int t = 0; t < NJ + 2; ++t) {
    const int64_t j = j0 - 1 + t;
    if (j < 0 || j >= gw) continue;
    const Vec<T> xv = Vec<T>::loadu(x + j * sn, lanes);
    if (t < NJ) acc[0] = at::vec::fmadd(g[t], xv, acc[0]);
    if (t >= 1 && t - 1 < NJ) acc[1] = at::vec::fmadd(g[t - 1], xv, acc[1]);
    if (t >= 2) acc[2] = at::vec::fmadd(g[t - 2], xv, acc[2]);
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
    for (int64_t i = 0; i < gh; ++i) {
      for (int64_t j0 = 0; j0 < gw; j0 += kCols) {
        with_cols(std::min<int64_t>(kCols, gw - j0), [&](auto cols) {
          constexpr int NJ = decltype(cols)::value;
          Vec<T> acc[NJ];
          for (int o = 0; o < NJ; ++o) {
            acc[o] = residual ? start + Vec<T>::loadu(X.at(b, i * gw + j0 + o) + c0, lanes) : start;
          }
          const T* row = X.at(b, i * gw) + c0;
          if (i > 0) conv_row<T, NJ>(row - gw * X.sn, X.sn, k, j0, gw, lanes, acc);
          conv_row<T, NJ>(row, X.sn, k + 3, j0, gw, lanes, acc);
          if (i + 1 < gh) conv_row<T, NJ>(row + gw * X.sn, X.sn, k + 6, j0, gw, lanes, acc);
          for (int o = 0; o < NJ; ++o) acc[o].store(O.at(b, i * gw + j0 + o) + c0, lanes);
        });
      }
    }
  });
}

// g_w[b, δ] = Σ_p g[b, p] ⊙ x[b, p + δ] (the weight gradient of dwconv with output gradient g), g_w [B, 9, C].
template <typename T>
void dwconv_weight_grad_impl(const Tensor& g, const Tensor& x, const Tensor& gw_out, int64_t gh, int64_t gw) {
  const int64_t B = x.size(0), C = x.size(2);
  constexpr int64_t W = Vec<T>::size();
  const auto G = map_of<T>(g), X = map_of<T>(x);
  T* out = gw_out.data_ptr<T>();
  for_channel_vectors(B, C, W, [&](int64_t b, int64_t c0, int64_t lanes) {
    Vec<T> acc[9];
    for (int64_t t = 0; t < 9; ++t) acc[t] = Vec<T>(T(0));
    for (int64_t i = 0; i < gh; ++i) {
      for (int64_t j0 = 0; j0 < gw; j0 += kCols) {
        with_cols(std::min<int64_t>(kCols, gw - j0), [&](auto cols) {
          constexpr int NJ = decltype(cols)::value;
          Vec<T> gv[NJ];
          for (int o = 0; o < NJ; ++o) gv[o] = Vec<T>::loadu(G.at(b, i * gw + j0 + o) + c0, lanes);
          // the three rows spelled out: acc stays in registers with constant tap indices
          const T* row = X.at(b, i * gw) + c0;
          if (i > 0) weight_grad_row<T, NJ>(row - gw * X.sn, X.sn, gv, j0, gw, lanes, acc);
          weight_grad_row<T, NJ>(row, X.sn, gv, j0, gw, lanes, acc + 3);
          if (i + 1 < gh) weight_grad_row<T, NJ>(row + gw * X.sn, X.sn, gv, j0, gw, lanes, acc + 6);
        });
      }
    }
    for (int64_t t = 0; t < 9; ++t) acc[t].store(out + (b * 9 + t) * C + c0, lanes);
  });
}

void check_maps(const std::vector<Tensor>& maps, int64_t gh, int64_t gw) {
  const auto& first = maps.front();
  for (const auto& t : maps) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == first.scalar_type(), "swiglu_cpu: CPU tensors of one dtype only");
    TORCH_CHECK(t.dim() == 3 && t.sizes() == first.sizes(), "swiglu_cpu: maps must all be [B, N, C] of one shape");
    TORCH_CHECK(t.stride(-1) == 1, "swiglu_cpu: maps need unit stride along C");
  }
  TORCH_CHECK(gh > 0 && gw > 0 && gh * gw == first.size(1), "swiglu_cpu: grid ", gh, "x", gw, " does not fit N=", first.size(1));
}

// taps [B, 9, C] (with broadcast also [1, 9, C] or a shared conv weight [C, 1, 3, 3]), contiguous, the maps' dtype.
void check_taps(const Tensor& w, const Tensor& x, bool broadcast) {
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous(), "swiglu_cpu: taps must be contiguous, of the maps' dtype");
  const int64_t C = x.size(2);
  const bool conv = broadcast && w.dim() == 4 && w.size(0) == C && w.size(1) == 1 && w.size(2) == 3 && w.size(3) == 3;
  TORCH_CHECK(
      conv || (w.dim() == 3 && (w.size(0) == x.size(0) || (broadcast && w.size(0) == 1)) && w.size(1) == 9 && w.size(2) == C),
      "swiglu_cpu: taps must be [", broadcast ? "1|" : "", "B, 9, C]", broadcast ? " or a weight [C, 1, 3, 3]" : "", ", got ",
      w.sizes());
}

#define VIT3_DISPATCH(t, name, ...)                                  \
  if ((t).scalar_type() == at::kFloat) {                             \
    name<float>(__VA_ARGS__);                                        \
  } else if ((t).scalar_type() == at::kDouble) {                     \
    name<double>(__VA_ARGS__);                                       \
  } else {                                                           \
    TORCH_CHECK(false, "swiglu_cpu: float32 or float64, got ", (t).scalar_type()); \
  }

void check_float(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, "swiglu_cpu: float32 or float64, got ",
              t.scalar_type());
}

void check_block(int64_t block) {
  TORCH_CHECK(block > 0, "swiglu_cpu: block must be a positive number of tokens, got ", block);
}

// An optional saved pre-activation buffer (Z or Y, [B, H, N, 2d] like q's tokens), checked; undefined if absent.
Tensor saved_buffer(const std::optional<Tensor>& t, const Tensor& q) {
  if (!t.has_value()) return Tensor();
  check_inputs({*t}, {q});
  check_shape(*t, q, q.size(2), 2 * q.size(3), "z and y");
  return *t;
}

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
                "swiglu_cpu: w1, w2 must be [1|B, H, d, d] = [1|", B, ", ", H, ", ", d, ", ", d, "], got ", wi->sizes());
  }
  const Tensor w = at::cat({w1.expand({B, H, d, d}), w2.expand({B, H, d, d})}, 3);  // [B, H, d, 2d]
  const Tensor zz = saved_buffer(z, q), yy = saved_buffer(y, q);
  check_block(block);
  check_float(q);
  Tensor g = at::zeros_like(w), w_new = at::empty_like(w), norm = at::empty({B, H, 1, 2 * d}, w.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "swiglu_cpu_ttt_forward", [&] {
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
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "swiglu_cpu_ttt_backward", [&] {
    readout_backward_impl<scalar_t>(d_out, q, yy, w_new, dq, dw, block);
    // before dw gathers kᵀ dZ below: dW' alone feeds the step's backward
    step_backward_impl<scalar_t>(dw, g, norm, dgw.data_ptr<scalar_t>(), 4 * d, d, scalar_t(c), scalar_t(lr), grad_norm);
    inner_backward_impl<scalar_t>(k, v, zz, dgw, dk, dv, dw, block);
  });
  return dw;
}

void dwconv(
    const Tensor& x, const Tensor& w, Tensor out, int64_t gh, int64_t gw, const std::optional<Tensor>& bias,
    bool residual) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_maps({x, out}, gh, gw);
  check_taps(w, x, true);
  const Tensor bb = bias.has_value() ? *bias : Tensor();
  if (bb.defined()) {
    TORCH_CHECK(bb.scalar_type() == x.scalar_type() && bb.is_contiguous() && bb.numel() == x.size(2),
                "swiglu_cpu: bias must be a contiguous [C] of the maps' dtype");
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
              "swiglu_cpu: the depthwise weight must be [1|B, C, 3, 3] = [1|", B, ", ", C, ", 3, 3], got ", weight.sizes());
  const Tensor w = weight.reshape({weight.size(0), C, 9}).transpose(1, 2).expand({B, 9, C}).contiguous();  // taps
  Tensor g = at::empty_like(w), w_new = at::empty_like(w), norm = at::empty({B, 1, C}, w.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "swiglu_cpu_dwconv_ttt_forward", [&] {
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
  TORCH_CHECK(norm.sizes() == at::IntArrayRef({B, 1, C}) && norm.is_contiguous(), "swiglu_cpu: norm must be [B, 1, C]");
  Tensor dw_new = at::empty_like(g), dg = at::empty_like(g);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "swiglu_cpu_dwconv_ttt_backward", [&] {
    dwconv_impl<scalar_t>(d_out, w_new.flip(1), dq, gh, gw, Tensor(), false);
    dwconv_weight_grad_impl<scalar_t>(d_out, q, dw_new, gh, gw);
    step_backward_impl<scalar_t>(dw_new, g, norm, dg.data_ptr<scalar_t>(), C, 9, scalar_t(c), scalar_t(lr), grad_norm);
    dwconv_impl<scalar_t>(v, dg.flip(1), dk, gh, gw, Tensor(), false);
    dwconv_impl<scalar_t>(k, dg, dv, gh, gw, Tensor(), false);
  });
  return dw_new;
}

}  // namespace

TORCH_LIBRARY(vit3_swiglu_cpu, m) {
  m.def(
      "ttt_forward(Tensor q, Tensor k, Tensor v, Tensor w1, Tensor w2, Tensor(a!) out, Tensor(b!)? z, "
      "Tensor(c!)? y, float c, float lr, bool grad_norm, int block) -> Tensor[]");
  m.def(
      "ttt_backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor? z, Tensor? y, Tensor w, Tensor g, "
      "Tensor norm, Tensor w_new, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, float c, float lr, "
      "bool grad_norm, int block) -> Tensor");
  m.def("dwconv(Tensor x, Tensor w, Tensor(a!) out, int gh, int gw, Tensor? bias=None, bool residual=False) -> ()");
  m.def("dwconv_weight_grad(Tensor g, Tensor x, Tensor(a!) gw_out, int gh, int gw) -> ()");
  m.def(
      "dwconv_ttt_forward(Tensor q, Tensor k, Tensor v, Tensor weight, Tensor(a!) out, int gh, int gw, float c, "
      "float lr, bool grad_norm) -> Tensor[]");
  m.def(
      "dwconv_ttt_backward(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor g, Tensor norm, Tensor w_new, "
      "Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, int gh, int gw, float c, float lr, bool grad_norm) -> Tensor");
}

TORCH_LIBRARY_IMPL(vit3_swiglu_cpu, CPU, m) {
  m.impl("ttt_forward", &ttt_forward);
  m.impl("ttt_backward", &ttt_backward);
  m.impl("dwconv", &dwconv);
  m.impl("dwconv_weight_grad", &dwconv_weight_grad);
  m.impl("dwconv_ttt_forward", &dwconv_ttt_forward);
  m.impl("dwconv_ttt_backward", &dwconv_ttt_backward);
}
