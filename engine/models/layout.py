"""Weight memory layout for fast small-batch matmuls on CPU.

A token tree feeds a handful of rows (M = 2..64) through every linear layer. With PyTorch's default
`nn.Linear` layout (weight [out, in], row-major) MKL's sgemm takes a transposed-B path that is 2-6x
slower for those M than for a weight stored input-major. Measured on the 2-core Xeon (Ice Lake) of this
project, 2 threads, fp32, x [M, 576] @ W [576, 576]^T: M=8 304 us -> 50 us, M=16 345 -> 78 us; the whole
SmolLM2-135M forward T(8) 151 -> 79 ms, T(16) 177 -> 102 ms (benchmarks/tree_build.py has the tree-side
numbers, `measure_profile` re-measures T(N) per machine).

`use_input_major_weights` stores each Linear weight as the transpose of a contiguous [in, out] tensor. It
is the same Parameter with the same shape, values and state-dict key (tied embeddings stay tied), so the
model code, TP sharding and checkpoints are untouched; only the strides change. GPUs need no such help
(cuBLAS handles both layouts), so it applies to CPU parameters only.
"""

from __future__ import annotations

import torch
from torch import nn

LAYOUT_VERSION = "input-major-1"  # part of the hardware-profile cache key: the layout changes T(N)


def is_input_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


@torch.no_grad()
def use_input_major_weights(model: nn.Module) -> nn.Module:
    """Re-store every CPU floating-point nn.Linear weight input-major (idempotent); returns `model`."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, nn.Linear) and weight is not None and weight.device.type == "cpu"
                and weight.dtype.is_floating_point and not is_input_major(weight)):
            weight.data = weight.data.t().contiguous().t()
    return model
