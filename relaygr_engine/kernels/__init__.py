"""Triton kernels of relaygr-engine (installed as ``relaygr_engine.kernels``).

=====================================  ======================================================================
``prefix_attention.prefix_attention``  new history rows + candidates of a varlen batch over cached prefix pages
                                       (softmax or HSTU, relative position/time bias computed in the kernel)
                                       (on sm_90, ``hopper_kernel=True``: tiles' full cached blocks on a
                                       warp-specialised Gluon kernel, ``_hopper``, HSTU or softmax; opt-in;
                                       split partials merged by ``_merge_kernel``)
``kv_write.kv_write``                  scatter new tokens' K/V (and timestamps) into their page slots
``kv_pack.kv_pack`` / ``kv_unpack``    pages of all layers <-> one contiguous buffer (spill / transfer)
``reference``                          pure-torch references of each kernel
=====================================  ======================================================================

Kernels run on CUDA, on Ascend NPUs through triton-ascend (``torch_npu`` imported only when an NPU tensor arrives),
and on the CPU in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is first imported; fp32 only).
Every launcher takes ``persistent=``: one program per core looping over tiles, as triton-ascend prefers.

Import the launchers from their modules (``from relaygr_engine.kernels.kv_write import kv_write``): each module
shares its name with its entry point. Importing this package does not import triton; the references below load on
first access.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "prefix_attention_ref": ".reference",
    "kv_write_ref": ".reference",
    "kv_pack_ref": ".reference",
    "kv_unpack_ref": ".reference",
    "merge_splits_ref": ".reference",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
