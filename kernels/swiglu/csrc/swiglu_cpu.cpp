// The N-sized passes of the official SwiGLU inner model's TTT step on a CPU (dot loss, one full-batch step):
// four passes over the tokens, each one C++ op that walks every (sample, head) in token blocks of about a MiB.
// The step itself is not here.
//
// Python (vit3/kernels/swiglu/eager.py) does the small per-(sample, head) work between the passes (the step
// W' = W - lr G / (||G|| + 1) and its backward); the passes here do every N-sized matmul (ATen, i.e. MKL) and
// fuse each elementwise chain between two matmuls into one loop over a block that is still in cache. The same
// passes in PyTorch are the tiled path of that module; the op's reference is vit3/kernels/swiglu/reference.py.
//
// Layouts: q, k, v [B, H, N, d] contiguous; weights [B, H, 2, d, d] contiguous (W1, W2 paired); Z = k W and
// Y = q W' saved as [B, H, 2, N, d]; destinations (out, dq, dk, dv, d_out) [B, H, N, d] with unit stride
// along d and any other strides (views of the mixer's qkv gradient and output).
//
// Threads: the (sample, head) problems are spread over ATen's threads, each walking its own blocks with its
// own scratch, so matmuls run single-threaded on cache-resident blocks; with fewer problems than threads the
// problems run one after another and every op is parallel inside.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
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

// One [rows, d] block: a pointer to its first element and its row stride (elements).
template <typename T>
struct Block {
  T* ptr;
  int64_t stride;
  T* row(int64_t r) const { return ptr + r * stride; }
};

template <typename T>
Block<T> block_of(const Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0)};
}

// Applies f(vector lane group) over each row of a [rows, d] block, with a scalar tail.
template <typename T, typename FV, typename FS>
inline void rows(int64_t n_rows, int64_t d, FV fv, FS fs) {
  constexpr int64_t W = Vec<T>::size();
  for (int64_t r = 0; r < n_rows; ++r) {
    int64_t c = 0;
    for (; c + W <= d; c += W) fv(r, c);
    for (; c < d; ++c) fs(r, c);
  }
}

// A token block of an input that matmuls read several times, dense: the block itself when it is, else a copy
// into `slot` (rows of a q/k view strided across the qkv tensor cost matmuls ~30% more than cached dense rows).
inline Tensor dense_block(const Tensor& block, const Tensor& slot) {
  if (block.is_contiguous()) return block;
  return slot.narrow(0, 0, block.size(0)).copy_(block);
}

// Runs body(b, h, n0, n, scratch) over every (sample, head) problem of tokens [B, H, N, d] and its token blocks
// [n0, n0 + n) of at most nb tokens, in order within a problem (accumulations stay per problem). Problems are
// spread across threads when there are enough of them, else run one after another (every op then parallel
// inside). scratch: `slots` [nb, d] matrices per thread.
template <typename F>
void for_blocks(const Tensor& tokens, int64_t nb, int64_t slots, F body) {
  const int64_t H = tokens.size(1), N = tokens.size(2), d = tokens.size(3), count = tokens.size(0) * H;
  const int64_t threads = at::get_num_threads();
  const bool spread = threads > 1 && count >= threads;
  Tensor scratch = at::empty({spread ? threads : 1, slots, nb, d}, tokens.options());
  auto problems = [&](int64_t begin, int64_t end, const Tensor& s) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t n0 = 0; n0 < N; n0 += nb) body(i / H, i % H, n0, std::min(nb, N - n0), s);
    }
  };
  if (!spread) {
    problems(0, count, scratch[0]);
    return;
  }
  // Worker threads start with default thread-local state (grad mode on, autograd keys active): give them ours.
  const at::ThreadLocalState state;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard guard(state);
    problems(begin, end, scratch[at::get_thread_num()]);
  });
}

// dense: contiguous buffers (weights, saved pre-activations); views: [B, H, N, d] tensors with unit stride along
// d. All share the first operand's dtype.
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

// Pass 1 of the forward: Z = k W, P = [v ⊙ A | v ⊙ Z1 ⊙ A'] (A = silu(Z2), A' = σ + A (1 - σ)),
// G += kᵀ P. g [B, H, 2, d, d] accumulates (zeroed by the caller); z [B, H, 2, N, d] or undefined.
template <typename T>
void inner_grad_impl(
    const Tensor& k, const Tensor& v, const Tensor& w, const Tensor& g, const Tensor& z, int64_t nb) {
  const int64_t d = k.size(3);
  const bool save = z.defined();
  for_blocks(k, nb, 5, [&](int64_t b, int64_t h, int64_t n0, int64_t n, const Tensor& s) {
    const Tensor kh = k[b][h], vh = v[b][h], wh = w[b][h], gh = g[b][h];
    const Tensor kt = dense_block(kh.narrow(0, n0, n), s[4]);
    Tensor z1 = save ? z[b][h][0].narrow(0, n0, n) : s[0].narrow(0, 0, n);
    Tensor z2 = save ? z[b][h][1].narrow(0, n0, n) : s[1].narrow(0, 0, n);
    const Tensor p1 = s[2].narrow(0, 0, n), p2 = s[3].narrow(0, 0, n);
    at::mm_out(z1, kt, wh[0]);
    at::mm_out(z2, kt, wh[1]);
    auto Z1 = block_of<T>(z1), Z2 = block_of<T>(z2), P1 = block_of<T>(p1), P2 = block_of<T>(p2);
    auto V = block_of<T>(vh.narrow(0, n0, n));
    rows<T>(
        n, d,
        [&](int64_t r, int64_t c) {
          const Vec<T> z2v = Vec<T>::loadu(Z2.row(r) + c), vv = Vec<T>::loadu(V.row(r) + c);
          const Vec<T> sig = vsigmoid(z2v), a = z2v * sig;
          (a * vv).store(P1.row(r) + c);
          ((sig + a * (Vec<T>(T(1)) - sig)) * Vec<T>::loadu(Z1.row(r) + c) * vv).store(P2.row(r) + c);
        },
        [&](int64_t r, int64_t c) {
          const T z2s = Z2.row(r)[c], vs = V.row(r)[c], sig = ssigmoid(z2s), a = z2s * sig;
          P1.row(r)[c] = a * vs;
          P2.row(r)[c] = (sig + a * (T(1) - sig)) * Z1.row(r)[c] * vs;
        });
    const Tensor kt_t = kt.t();
    gh[0].addmm_(kt_t, p1);
    gh[1].addmm_(kt_t, p2);
  });
}

// Pass 2 of the forward: Y = q W', out = Y1 ⊙ silu(Y2). y [B, H, 2, N, d] or undefined.
template <typename T>
void readout_impl(const Tensor& q, const Tensor& w_new, const Tensor& out, const Tensor& y, int64_t nb) {
  const int64_t d = q.size(3);
  const bool save = y.defined();
  for_blocks(q, nb, 3, [&](int64_t b, int64_t h, int64_t n0, int64_t n, const Tensor& s) {
    const Tensor qh = q[b][h], wh = w_new[b][h], oh = out[b][h];
    const Tensor qt = dense_block(qh.narrow(0, n0, n), s[2]);
    Tensor y1 = save ? y[b][h][0].narrow(0, n0, n) : s[0].narrow(0, 0, n);
    Tensor y2 = save ? y[b][h][1].narrow(0, n0, n) : s[1].narrow(0, 0, n);
    at::mm_out(y1, qt, wh[0]);
    at::mm_out(y2, qt, wh[1]);
    auto Y1 = block_of<T>(y1), Y2 = block_of<T>(y2), O = block_of<T>(oh.narrow(0, n0, n));
    rows<T>(
        n, d,
        [&](int64_t r, int64_t c) {
          const Vec<T> y2v = Vec<T>::loadu(Y2.row(r) + c);
          (Vec<T>::loadu(Y1.row(r) + c) * y2v * vsigmoid(y2v)).store(O.row(r) + c);
        },
        [&](int64_t r, int64_t c) {
          const T y2s = Y2.row(r)[c];
          O.row(r)[c] = Y1.row(r)[c] * y2s * ssigmoid(y2s);
        });
  });
}

// Pass 1 of the backward: dY = [dO ⊙ silu(Y2) | dO ⊙ Y1 ⊙ silu'(Y2)], dq = dY1 W1'ᵀ + dY2 W2'ᵀ,
// dW' += qᵀ dY (dw [B, H, 2, d, d], zeroed by the caller).
template <typename T>
void readout_backward_impl(
    const Tensor& d_out,
    const Tensor& q,
    const Tensor& y,
    const Tensor& w_new,
    const Tensor& dq,
    const Tensor& dw,
    int64_t nb) {
  const int64_t d = q.size(3);
  for_blocks(q, nb, 3, [&](int64_t b, int64_t h, int64_t n0, int64_t n, const Tensor& s) {
    const Tensor qh = q[b][h], wh = w_new[b][h], dwh = dw[b][h], dqh = dq[b][h], doh = d_out[b][h];
    const Tensor dy1 = s[0].narrow(0, 0, n), dy2 = s[1].narrow(0, 0, n);
    auto Y1 = block_of<T>(y[b][h][0].narrow(0, n0, n)), Y2 = block_of<T>(y[b][h][1].narrow(0, n0, n));
    auto DO = block_of<T>(doh.narrow(0, n0, n)), D1 = block_of<T>(dy1), D2 = block_of<T>(dy2);
    rows<T>(
        n, d,
        [&](int64_t r, int64_t c) {
          const Vec<T> y2v = Vec<T>::loadu(Y2.row(r) + c), dov = Vec<T>::loadu(DO.row(r) + c);
          const Vec<T> sig = vsigmoid(y2v), one(T(1));
          (dov * y2v * sig).store(D1.row(r) + c);
          (dov * Vec<T>::loadu(Y1.row(r) + c) * sig * (one + y2v * (one - sig))).store(D2.row(r) + c);
        },
        [&](int64_t r, int64_t c) {
          const T y2s = Y2.row(r)[c], dos = DO.row(r)[c], sig = ssigmoid(y2s);
          D1.row(r)[c] = dos * y2s * sig;
          D2.row(r)[c] = dos * Y1.row(r)[c] * sig * (T(1) + y2s * (T(1) - sig));
        });
    Tensor dqt = dqh.narrow(0, n0, n);
    at::mm_out(dqt, dy1, wh[0].t());
    dqt.addmm_(dy2, wh[1].t());
    const Tensor qt_t = dense_block(qh.narrow(0, n0, n), s[2]).t();
    dwh[0].addmm_(qt_t, dy1);
    dwh[1].addmm_(qt_t, dy2);
  });
}

// Pass 2 of the backward, with dG (the -c of E = -c v folded in): dP = k dG,
// dv = dP1 ⊙ A + dP2 ⊙ Z1 ⊙ A', dZ1 = v ⊙ dP2 ⊙ A', dZ2 = v ⊙ (dP1 ⊙ A' + dP2 ⊙ Z1 ⊙ A''),
// dk = P1 dG1ᵀ + P2 dG2ᵀ + dZ1 W1ᵀ + dZ2 W2ᵀ, dW += kᵀ dZ.
template <typename T>
void inner_backward_impl(
    const Tensor& k,
    const Tensor& v,
    const Tensor& z,
    const Tensor& w,
    const Tensor& dg,
    const Tensor& dk,
    const Tensor& dv,
    const Tensor& dw,
    int64_t nb) {
  const int64_t d = k.size(3);
  for_blocks(k, nb, 7, [&](int64_t b, int64_t h, int64_t n0, int64_t n, const Tensor& s) {
    const Tensor kh = k[b][h], vh = v[b][h], wh = w[b][h], dgh = dg[b][h], dwh = dw[b][h];
    const Tensor dkh = dk[b][h], dvh = dv[b][h];
    const Tensor kt = dense_block(kh.narrow(0, n0, n), s[6]);
    Tensor dp1 = s[0].narrow(0, 0, n), dp2 = s[1].narrow(0, 0, n), dz1 = s[2].narrow(0, 0, n);
    Tensor dz2 = s[3].narrow(0, 0, n), p1 = s[4].narrow(0, 0, n), p2 = s[5].narrow(0, 0, n);
    at::mm_out(dp1, kt, dgh[0]);
    at::mm_out(dp2, kt, dgh[1]);
    auto Z1 = block_of<T>(z[b][h][0].narrow(0, n0, n)), Z2 = block_of<T>(z[b][h][1].narrow(0, n0, n));
    auto V = block_of<T>(vh.narrow(0, n0, n)), DV = block_of<T>(dvh.narrow(0, n0, n));
    auto DP1 = block_of<T>(dp1), DP2 = block_of<T>(dp2), DZ1 = block_of<T>(dz1), DZ2 = block_of<T>(dz2);
    auto P1 = block_of<T>(p1), P2 = block_of<T>(p2);
    rows<T>(
        n, d,
        [&](int64_t r, int64_t c) {
          const Vec<T> one(T(1)), two(T(2));
          const Vec<T> z1v = Vec<T>::loadu(Z1.row(r) + c), z2v = Vec<T>::loadu(Z2.row(r) + c);
          const Vec<T> vv = Vec<T>::loadu(V.row(r) + c);
          const Vec<T> dp1v = Vec<T>::loadu(DP1.row(r) + c), dp2v = Vec<T>::loadu(DP2.row(r) + c);
          const Vec<T> sig = vsigmoid(z2v), a = z2v * sig, u = sig * (one - sig);
          const Vec<T> a1 = sig + z2v * u, a2 = u * (two + z2v - two * a);
          const Vec<T> rr = dp2v * z1v, va = vv * a1;
          (dp1v * a + rr * a1).store(DV.row(r) + c);
          (dp2v * va).store(DZ1.row(r) + c);
          (dp1v * va + rr * vv * a2).store(DZ2.row(r) + c);
          (a * vv).store(P1.row(r) + c);
          (va * z1v).store(P2.row(r) + c);
        },
        [&](int64_t r, int64_t c) {
          const T z1s = Z1.row(r)[c], z2s = Z2.row(r)[c], vs = V.row(r)[c];
          const T dp1s = DP1.row(r)[c], dp2s = DP2.row(r)[c];
          const T sig = ssigmoid(z2s), a = z2s * sig, u = sig * (T(1) - sig);
          const T a1 = sig + z2s * u, a2 = u * (T(2) + z2s - T(2) * a);
          const T rr = dp2s * z1s, va = vs * a1;
          DV.row(r)[c] = dp1s * a + rr * a1;
          DZ1.row(r)[c] = dp2s * va;
          DZ2.row(r)[c] = dp1s * va + rr * vs * a2;
          P1.row(r)[c] = a * vs;
          P2.row(r)[c] = va * z1s;
        });
    Tensor dkt = dkh.narrow(0, n0, n);
    at::mm_out(dkt, p1, dgh[0].t());
    dkt.addmm_(p2, dgh[1].t());
    dkt.addmm_(dz1, wh[0].t());
    dkt.addmm_(dz2, wh[1].t());
    const Tensor kt_t = kt.t();
    dwh[0].addmm_(kt_t, dz1);
    dwh[1].addmm_(kt_t, dz2);
  });
}

#define VIT3_DISPATCH(t, name, ...)                                  \
  if ((t).scalar_type() == at::kFloat) {                             \
    name<float>(__VA_ARGS__);                                        \
  } else if ((t).scalar_type() == at::kDouble) {                     \
    name<double>(__VA_ARGS__);                                       \
  } else {                                                           \
    TORCH_CHECK(false, "swiglu_cpu: float32 or float64, got ", (t).scalar_type()); \
  }

void check_block(int64_t block) {
  TORCH_CHECK(block > 0, "swiglu_cpu: block must be a positive number of tokens, got ", block);
}

void inner_grad(
    const Tensor& k, const Tensor& v, const Tensor& w, Tensor g, const std::optional<Tensor>& z, int64_t block) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // raw kernel: its outputs are plain buffers
  const Tensor zz = z.has_value() ? *z : Tensor();
  check_inputs({w, g}, {k, v});
  if (zz.defined()) check_inputs({zz}, {k});
  check_block(block);
  VIT3_DISPATCH(k, inner_grad_impl, k, v, w, g, zz, block);
}

void readout(const Tensor& q, const Tensor& w_new, Tensor out, const std::optional<Tensor>& y, int64_t block) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Tensor yy = y.has_value() ? *y : Tensor();
  check_inputs({w_new}, {q, out});
  if (yy.defined()) check_inputs({yy}, {q});
  check_block(block);
  VIT3_DISPATCH(q, readout_impl, q, w_new, out, yy, block);
}

void readout_backward(
    const Tensor& d_out,
    const Tensor& q,
    const Tensor& y,
    const Tensor& w_new,
    Tensor dq,
    Tensor dw,
    int64_t block) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_inputs({y, w_new, dw}, {d_out, q, dq});
  check_block(block);
  VIT3_DISPATCH(q, readout_backward_impl, d_out, q, y, w_new, dq, dw, block);
}

void inner_backward(
    const Tensor& k,
    const Tensor& v,
    const Tensor& z,
    const Tensor& w,
    const Tensor& dg,
    Tensor dk,
    Tensor dv,
    Tensor dw,
    int64_t block) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_inputs({z, w, dg, dw}, {k, v, dk, dv});
  check_block(block);
  VIT3_DISPATCH(k, inner_backward_impl, k, v, z, w, dg, dk, dv, dw, block);
}

}  // namespace

TORCH_LIBRARY(vit3_swiglu_cpu, m) {
  m.def("inner_grad(Tensor k, Tensor v, Tensor w, Tensor(a!) g, Tensor(b!)? z, int block) -> ()");
  m.def("readout(Tensor q, Tensor w_new, Tensor(a!) out, Tensor(b!)? y, int block) -> ()");
  m.def(
      "readout_backward(Tensor d_out, Tensor q, Tensor y, Tensor w_new, Tensor(a!) dq, Tensor(b!) dw, "
      "int block) -> ()");
  m.def(
      "inner_backward(Tensor k, Tensor v, Tensor z, Tensor w, Tensor dg, Tensor(a!) dk, Tensor(b!) dv, "
      "Tensor(c!) dw, int block) -> ()");
}

TORCH_LIBRARY_IMPL(vit3_swiglu_cpu, CPU, m) {
  m.impl("inner_grad", &inner_grad);
  m.impl("readout", &readout);
  m.impl("readout_backward", &readout_backward);
  m.impl("inner_backward", &inner_backward);
}
