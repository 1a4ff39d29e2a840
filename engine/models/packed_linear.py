"""Fast small-batch linear layers on CPU: oneDNN with weights packed once.

A token tree feeds a handful of rows (M = 2..64) through every linear layer, and decoding a 135M-parameter
model on a CPU is memory-bound: each forward streams every weight from DRAM once, so an M-row matmul
should cost about what a one-row one does. PyTorch's `nn.Linear` goes to MKL's sgemm, whose cost grows with
M at these sizes; oneDNN's inner-product on a weight reordered once into its blocked layout streams it at the
bandwidth for every small M (measurements: docs/performance.md section 4). So on a CPU, as on a GPU,
verifying a small tree costs about one plain decoding step.

`use_fast_cpu_linears` turns every CPU floating-point `nn.Linear` of a model into a `PackedLinear` (same
module, same Parameter, state-dict keys and ties; only `forward` differs): the forward packs the weight on
first use (and again whenever the weight is replaced or modified in place, seen from its version counter)
and calls oneDNN's inner-product. It falls back to `nn.Linear.forward` when autograd is recording (training
keeps the ordinary path), for weights created under inference mode (they have no version counter), for
DTensor shards (tensor parallelism shards the same modules), off the CPU
(cuBLAS needs no help), when this PyTorch build has no oneDNN, and for bfloat16 on CPUs whose oneDNN has no
bf16 path (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only EPYC has neither). Results equal
`nn.Linear`'s up to float rounding (a different accumulation order, ~1e-6 relative).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LAYOUT_VERSION = "onednn-packed-1"  # part of the hardware-profile cache key: the kernels change T(N)
# Weight dtypes oneDNN can pack on this CPU: float32 always, bfloat16 only where it has a bf16 path (a property of
# the machine, read once: the check sits on every linear's forward).
_BF16_PACKABLE = hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and torch.ops.mkldnn._is_mkldnn_bf16_supported()
PACKED_DTYPES = (torch.float32, torch.bfloat16) if _BF16_PACKABLE else (torch.float32,)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _PackedWeight:
    """A weight reordered for oneDNN, with the identity of the tensor it was made from. Copies of a module
    (deepcopy, pickling) start without one: it is rebuilt from the weight on first use."""

    def __init__(self, weight: Tensor):
        self.key = _weight_key(weight)
        self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return (type(None), ())


def _weight_key(weight: Tensor) -> tuple[int, int, torch.dtype]:
    return weight.data_ptr(), weight._version, weight.dtype


class PackedLinear(nn.Linear):
    """`nn.Linear` whose CPU inference forward runs oneDNN on a packed copy of the weight."""

    _packed: _PackedWeight | None = None

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if (weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or x.dtype != weight.dtype
                or type(weight.data) is not Tensor  # a DTensor shard: its own dispatch
                or weight.is_inference()  # no version counter: an in-place change could not be seen
                or torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
            return F.linear(x, weight, self.bias)
        if self._packed is None or self._packed.key != _weight_key(weight):
            self._packed = _PackedWeight(weight)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed.tensor, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


def use_fast_cpu_linears(model: nn.Module) -> nn.Module:
    """Make every CPU floating-point nn.Linear of `model` a PackedLinear (idempotent); returns `model`.
    Does nothing where this PyTorch build has no oneDNN."""
    if not onednn_available():
        return model
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in PACKED_DTYPES:
            module.__class__ = PackedLinear
    return model
