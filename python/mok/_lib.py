"""_lib.py: ctypes declarations of include/mok.h, the loading of libmok.so, and the mapping of
mok_status codes to Python exceptions.

Nothing here allocates or caches; core.py builds on it. The library is found at $MOK_LIB, else
inside the package (pip install), else in the repository's build folder (make).
"""
import ctypes
import os
from ctypes import POINTER, c_char_p, c_float, c_int, c_int32, c_int64, c_size_t, c_uint16
from ctypes import c_void_p
from pathlib import Path

# The ABI this binding was written against (mok.h MOK_VERSION_*); the major must match.
VERSION = (0, 1, 0)
TILE_M = 128  # MOK_TILE_M
SAVED_ALIGN = 256  # mok_saved_bytes() buffers must start on this boundary
TENSOR_ALIGN = 16  # every other tensor pointer (api.c CHECK_ALIGNED)

BACKEND_CPU, BACKEND_CUDA = 0, 1
BF16, FP8 = 0, 1
GRAD_WRITE_BF16, GRAD_ACCUMULATE_F32 = 0, 1


# ---- status codes and exceptions ----------------------------------------------------------------
class MokError(RuntimeError):
    """A mok call failed. `status` is the mok_status value, `name` its MOK_* name, `message` the
    library's mok_last_error() text (what was wrong and what was expected)."""

    def __init__(self, status, name, message, func):
        self.status, self.name, self.message, self.func = status, name, message, func
        super().__init__(f"{func}: {name}: {message}")


class MokInvalidArgument(MokError, ValueError): pass
class MokUnsupported(MokError, NotImplementedError): pass
class MokAlignmentError(MokError, ValueError): pass
class MokOutOfMemory(MokError, MemoryError): pass
class MokExpertIdError(MokError, ValueError): pass
class MokCapacityError(MokError): pass
class MokTimeout(MokError, TimeoutError): pass
class MokCudaError(MokError): pass
class MokNcclError(MokError): pass
class MokInternalError(MokError): pass


# value -> (MOK_STATUS_LIST name, exception class); test_binding.py checks the names against C.
STATUS = {
    0: ("MOK_OK", None),
    1: ("MOK_ERR_INVALID_ARG", MokInvalidArgument),
    2: ("MOK_ERR_UNSUPPORTED", MokUnsupported),
    3: ("MOK_ERR_ALIGNMENT", MokAlignmentError),
    4: ("MOK_ERR_OUT_OF_MEMORY", MokOutOfMemory),
    5: ("MOK_ERR_EXPERT_ID", MokExpertIdError),
    6: ("MOK_ERR_CAPACITY", MokCapacityError),
    7: ("MOK_ERR_TIMEOUT", MokTimeout),
    8: ("MOK_ERR_CUDA", MokCudaError),
    9: ("MOK_ERR_NCCL", MokNcclError),
    10: ("MOK_ERR_INTERNAL", MokInternalError),
}


# ---- structs (field order and types exactly as in mok.h) ----------------------------------------
class ContextConfig(ctypes.Structure):
    _fields_ = [("backend", c_int), ("device", c_int), ("ep_rank", c_int), ("ep_size", c_int),
                ("threads", c_int), ("sms", c_int), ("cluster", c_int), ("group", c_void_p)]


class Shape(ctypes.Structure):
    _fields_ = [("max_tokens", c_int64), ("hidden", c_int64), ("inter", c_int64),
                ("shared_inter", c_int64), ("experts", c_int32), ("top_k", c_int32),
                ("precision", c_int), ("routed_rows", c_int64)]


class FP8Matrix(ctypes.Structure):
    _fields_ = [("q", c_void_p), ("s", c_void_p)]


class FP8Given(ctypes.Structure):
    _fields_ = [(n, FP8Matrix) for n in ("w_gate", "w_up", "w_down", "ws_gate", "ws_up",
                                         "ws_down")]


class Weights(ctypes.Structure):
    _fields_ = [(n, c_void_p) for n in ("w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down",
                                        "fp8")]


class ForwardArgs(ctypes.Structure):
    _fields_ = [("tokens", c_int64), ("x", c_void_p), ("topk_ids", c_void_p),
                ("topk_weights", c_void_p), ("w", Weights), ("y", c_void_p), ("saved", c_void_p)]


class Grads(ctypes.Structure):
    _fields_ = [(n, c_void_p) for n in ("dw_gate", "dw_up", "dw_down", "dws_gate", "dws_up",
                                        "dws_down")]


class BackwardArgs(ctypes.Structure):
    _fields_ = [("tokens", c_int64), ("x", c_void_p), ("topk_ids", c_void_p),
                ("topk_weights", c_void_p), ("w", Weights), ("saved", c_void_p), ("dy", c_void_p),
                ("dx", c_void_p), ("d_topk_weights", c_void_p), ("g", Grads),
                ("grad_mode", c_int)]


class RouterConfig(ctypes.Structure):
    _fields_ = [("max_tokens", c_int64), ("hidden", c_int64), ("experts", c_int32),
                ("top_k", c_int32), ("scoring", c_int), ("n_group", c_int32),
                ("topk_group", c_int32), ("renormalize", c_int32), ("scale", c_float)]


class RouterForwardArgs(ctypes.Structure):
    _fields_ = [("tokens", c_int64), ("x", c_void_p), ("w_router", c_void_p), ("bias", c_void_p),
                ("topk_ids", c_void_p), ("topk_weights", c_void_p), ("counts", c_void_p),
                ("aux_loss", c_void_p), ("z_loss", c_void_p), ("saved", c_void_p)]


class RouterBackwardArgs(ctypes.Structure):
    _fields_ = [("tokens", c_int64), ("x", c_void_p), ("w_router", c_void_p), ("saved", c_void_p),
                ("d_topk_weights", c_void_p), ("d_aux_loss", c_void_p), ("d_z_loss", c_void_p),
                ("dx", c_void_p), ("accumulate_dx", c_int32), ("dw_router", c_void_p),
                ("grad_mode", c_int)]


SCORINGS = {"softmax": 0, "sigmoid": 1}  # mok_router_scoring
ROUTER_MAX_EXPERTS, ROUTER_MAX_K = 1024, 32


# ---- the library --------------------------------------------------------------------------------
_PROTOTYPES = {
    # name: (restype, argtypes); c_int for mok_status results, which check() turns into exceptions.
    "mok_version": (c_int, []),
    "mok_status_name": (c_char_p, [c_int]),
    "mok_status_string": (c_char_p, [c_int]),
    "mok_last_error": (c_char_p, []),
    "mok_ep_group_create_emulated": (c_int, [c_int, c_int, POINTER(c_void_p)]),
    "mok_ep_group_create_nccl": (c_int, [c_void_p, c_int, POINTER(c_void_p)]),
    "mok_nccl_id": (c_int, [c_char_p]),
    "mok_ep_group_create_nccl_id": (c_int, [c_char_p, c_int, c_int, c_int, c_int,
                                            POINTER(c_void_p)]),
    "mok_ep_group_destroy": (None, [c_void_p]),
    "mok_context_create": (c_int, [POINTER(ContextConfig), POINTER(c_void_p)]),
    "mok_context_destroy": (None, [c_void_p]),
    "mok_cuda_device_count": (c_int, []),
    "mok_workspace_create": (c_int, [c_void_p, POINTER(Shape), POINTER(c_void_p)]),
    "mok_workspace_destroy": (None, [c_void_p]),
    "mok_workspace_bytes": (c_size_t, [c_void_p]),
    "mok_saved_bytes": (c_size_t, [c_void_p, c_int64]),
    "mok_schedule": (c_int, [c_void_p, POINTER(ForwardArgs), c_void_p]),
    "mok_forward": (c_int, [c_void_p, POINTER(ForwardArgs), c_void_p]),
    "mok_recompute": (c_int, [c_void_p, POINTER(ForwardArgs), c_void_p]),
    "mok_backward": (c_int, [c_void_p, POINTER(BackwardArgs), c_void_p]),
    "mok_check": (c_int, [c_void_p, c_void_p]),
    "mok_schedule_counts": (c_int, [c_void_p, c_void_p, c_int64, POINTER(c_int32), c_void_p]),
    "mok_fp8_weights_bytes": (c_size_t, [c_void_p]),
    "mok_quantize_weights": (c_int, [c_void_p, POINTER(Weights), c_void_p, c_void_p]),
    "mok_fp8_weights_import": (c_int, [c_void_p, POINTER(FP8Given), c_void_p, c_void_p]),
    "mok_mxfp8_to_bf16": (c_int, [c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_void_p,
                                  c_void_p]),
    "mok_router_create": (c_int, [c_void_p, POINTER(RouterConfig), POINTER(c_void_p)]),
    "mok_router_destroy": (None, [c_void_p]),
    "mok_router_saved_bytes": (c_size_t, [c_void_p, c_int64]),
    "mok_router_forward": (c_int, [c_void_p, POINTER(RouterForwardArgs), c_void_p]),
    "mok_router_backward": (c_int, [c_void_p, POINTER(RouterBackwardArgs), c_void_p]),
    # bf16 conversion (the tests compare bf16.py against it).
    "mok_f32_to_bf16": (c_uint16, [c_float]),
    "mok_bf16_to_f32": (c_float, [c_uint16]),
}


def library_path():
    """Where libmok.so is loaded from: $MOK_LIB, else the one inside the package (pip install),
    else <repo>/build/libmok.so (make, in the repository)."""
    env = os.environ.get("MOK_LIB")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parent
    inside = here / "libmok.so"
    return inside if inside.is_file() else (here / ".." / ".." / "build" / "libmok.so").resolve()


def _load():
    path = library_path()
    if not path.is_file():
        raise ImportError(f"mok: {path} not found; run `make` in the repository root, pip install "
                          f"mok, or set MOK_LIB to the path of libmok.so")
    lib = ctypes.CDLL(str(path))  # CDLL calls release the GIL while C runs
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    v = lib.mok_version()
    # The ABI is the major's, and while that is 0 the minor's too (as the soname says).
    abi = (v // 10000, v // 100 % 100) if VERSION[0] == 0 else (v // 10000,)
    if abi != VERSION[:len(abi)]:
        raise ImportError(f"mok: {path} is version {v}; this binding needs "
                          f"{'.'.join(map(str, VERSION[:len(abi)]))}.x")
    return lib


lib = _load()


def last_error():
    return (lib.mok_last_error() or b"").decode("utf-8", "replace")


def status_name(status):
    return lib.mok_status_name(status).decode()


def check(status, func):
    """Raises the exception for `status` (with mok_last_error's text) unless it is MOK_OK.
    Call it right after the failing call, on the same thread: the message is per thread."""
    if status == 0:
        return
    name, cls = STATUS.get(status, (None, MokError))
    name = name or status_name(status)
    msg = last_error() or lib.mok_status_string(status).decode()
    raise (cls or MokError)(status, name, msg, func)
