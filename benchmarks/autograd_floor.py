"""What any autograd node costs on this CPU, written in Python or in C++: the floor under a fused node's call.

Times forward + backward, median (p10) µs per call, of ``python node`` (``common.FloorNode``), ``c++ node,
python bodies`` (a C++ ``torch::autograd::Node`` calling the same Python bodies) and ``bodies alone``, on
the fused node's inputs at the ``triton_overhead.py`` shape. The C++ node needs a C++ compiler; without one
its row is left out. Method: benchmarks/README.md.

    python benchmarks/autograd_floor.py --threads 1
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, FloorNode, print_table, time_samples, write_csv
from vit3.kernels.cpp import _cpp_extension

_CPP = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::variable_list;

// The backward calls Python back (under the GIL) with what the forward kept.
struct PythonBodies : Node {
  py::object backward, state;
  ~PythonBodies() override {
    py::gil_scoped_acquire gil;
    backward = py::object();
    state = py::object();
  }
  variable_list apply(variable_list&& grads) override {
    py::gil_scoped_acquire gil;
    return backward(state, grads[0]).cast<std::vector<at::Tensor>>();
  }
  void release_variables() override {
    py::gil_scoped_acquire gil;
    state = py::none();
  }
};

// forward(inputs) -> (output, state); the output's autograd node is a PythonBodies over the inputs.
at::Tensor apply(py::object forward, py::object backward, std::vector<at::Tensor> inputs) {
  py::tuple got;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    got = forward(inputs);
  }
  at::Tensor out = got[0].cast<at::Tensor>();
  if (torch::autograd::compute_requires_grad(inputs)) {
    auto node = c10::make_intrusive<PythonBodies>();
    node->backward = backward;
    node->state = got[1];
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
    torch::autograd::set_history(out, node);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("apply", &apply); }
"""


def _cpp_node() -> tuple[Any, str]:
    """The extension with ``apply(forward, backward, inputs)``, or ``None`` and why it could not be built."""
    try:  # (imported without its "no CUDA runtime" warning: CPU code)
        load_inline = _cpp_extension().load_inline
        return load_inline("vit3_autograd_floor", cpp_sources=[_CPP], extra_cflags=["-O2"]), ""
    except Exception as exc:  # no compiler, no headers: the row is left out, said why
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


BACK_TO_BACK = 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "autograd_floor_cpu.csv")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    width = 96
    qkv = torch.randn(1, 16, 3 * width, requires_grad=True)
    weights = [torch.randn(1, 2, 32, 32, requires_grad=True) for _ in range(2)]
    weights.append(torch.randn(1, 32, 3, 3, requires_grad=True))
    leaves = [qkv, *weights]
    d_out = torch.ones(1, 16, width)

    def step(make: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(BACK_TO_BACK):
                for t in leaves:
                    t.grad = None
                torch.autograd.backward(make(), d_out)

        return run

    def forward(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return inputs[0].new_empty(*inputs[0].shape[:-1], width), inputs

    def backward(state: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
        return [t.new_empty(t.shape) for t in state]

    def bodies() -> None:
        for _ in range(BACK_TO_BACK):
            backward(forward(leaves)[1], d_out)

    fns = {
        "python node (the floor)": step(lambda: FloorNode.apply(qkv, width, *weights)),
        "bodies alone": bodies,
    }
    ext, why = _cpp_node()
    if ext is not None:
        fns["c++ node, python bodies"] = step(lambda: ext.apply(forward, backward, leaves))
    samples = time_samples(fns, torch.device("cpu"), repeats=args.repeats, warmup=20)
    rows = []
    for label, ts in samples.items():
        ts = sorted(t / BACK_TO_BACK for t in ts)
        rows.append({"node": label, "median_us": ts[len(ts) // 2] * 1e6, "p10_us": ts[len(ts) // 10] * 1e6})
    print_table(rows, floatfmt="{:.1f}")
    if ext is None:
        print(f"c++ node left out: {why}")
    write_csv(rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
