"""mok: Python binding of libmok, one deterministic Mixture-of-Experts layer (DESIGN.md §1).

Without torch (numpy arrays, CPU backend):
    y, saved = mok.forward(x, topk_ids, topk_weights, w_gate, w_up, w_down)
    grads = mok.backward(dy, x, topk_ids, topk_weights, w_gate, w_up, w_down, saved=saved)
    x = mok.mxfp8_to_bf16(codes, scales)   # MXFP8 inputs (uint8 arrays) to bf16 bits
With torch (CPU tensors -> CPU backend, CUDA tensors -> CUDA backend), with autograd:
    y = mok.moe(x, topk_ids, topk_weights, w_gate, w_up, w_down)
    layer = mok.MoELayer(hidden, inter, experts, top_k)
    layer = mok.MoELayer(hidden, inter, experts, top_k, router=mok.Router(hidden, experts, top_k))
    y = layer(x)   # routing included; layer.counts, layer.aux_loss, layer.z_loss
Expert parallelism, one process per GPU: mok.moe(..., group=pg, max_tokens=N) with a
torch.distributed process group (mok.ep_group(pg) makes mok's NCCL group for it).
`mok.moe`, `mok.MoELayer`, `mok.check` and `mok.ep_group` import torch on first use.
The library is loaded from $MOK_LIB, else from the package (pip install), else from
<repo>/build/libmok.so (`make` builds it). The mok command: `python -m mok` (or `mok`).
"""
from ._lib import (MokAlignmentError, MokCapacityError, MokCudaError, MokError, MokExpertIdError,
                   MokInternalError, MokInvalidArgument, MokNcclError, MokOutOfMemory, MokTimeout,
                   MokUnsupported, library_path)
from ._lib import lib as _clib
from .bf16 import bf16_to_f32, f32_to_bf16, round_bf16
from .core import Context, Dims, EPGroup, Workspace, clear_cache, cuda_device_count, nccl_id
from .numpy_api import Grads, Layer, aligned_empty, backward, forward, mxfp8_to_bf16

__all__ = ["MokAlignmentError", "MokCapacityError", "MokCudaError", "MokError", "MokExpertIdError",
           "MokInternalError", "MokInvalidArgument", "MokNcclError", "MokOutOfMemory", "MokTimeout",
           "MokUnsupported", "library_path", "bf16_to_f32", "f32_to_bf16", "round_bf16", "Context",
           "Dims", "EPGroup", "Workspace", "clear_cache", "cuda_device_count", "nccl_id", "Grads",
           "Layer", "aligned_empty", "backward", "forward", "mxfp8_to_bf16", "moe", "MoELayer",
           "check", "set_debug", "ep_group", "Router", "RouterOutput", "route"]

__version__ = "%d.%d.%d" % (_clib.mok_version() // 10000, _clib.mok_version() // 100 % 100,
                            _clib.mok_version() % 100)

_TORCH_NAMES = ("moe", "MoELayer", "check", "set_debug", "ep_group", "torch_ops")
_ROUTER_NAMES = ("Router", "RouterOutput", "route", "torch_router")


def __getattr__(name):
    if name in _TORCH_NAMES:
        import importlib
        ops = importlib.import_module(".torch_ops", __name__)  # ImportError without torch
        return ops if name == "torch_ops" else getattr(ops, name)
    if name in _ROUTER_NAMES:
        import importlib
        ops = importlib.import_module(".torch_router", __name__)  # ImportError without torch
        return ops if name == "torch_router" else getattr(ops, name)
    raise AttributeError(f"module 'mok' has no attribute {name!r}")
