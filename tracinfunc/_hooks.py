"""Global module forward hooks that see the calling thread's forward passes only.

The factorised paths and K-FAC capture find a model's layers with
``torch.nn.modules.module.register_module_forward_hook``, which is process-global: while it
is registered, every module's forward in every thread runs it. Another thread's inference or
training then fed its layers into this thread's records (wrong rows, "layers were called in
another order" errors raised in that other thread, outside tracinfunc). Filtered by thread,
the hook runs for its own thread's calls only.

The hook also goes first among the global hooks (torch runs them in registration order,
before a module's own): a user's global hook that replaces a layer's output (``o * 2``) would
otherwise hand the capture the replaced output, whose gradient is not the layer's (an
outside pass found K-FAC's ``S`` a quarter of the true one).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.nn.modules.module as torch_module
from torch.nn.modules.module import register_module_forward_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["register_thread_forward_hook"]


def register_thread_forward_hook(hook: Callable[..., Any]) -> RemovableHandle:
    """``register_module_forward_hook(hook)``, with ``hook`` run only for forward passes made
    in the thread that registers it (other threads' modules run as if it were absent)."""
    owner = threading.get_ident()

    def in_this_thread(module, inputs, output):
        if threading.get_ident() != owner:
            return None
        return hook(module, inputs, output)

    handle = register_module_forward_hook(in_this_thread)
    hooks = getattr(torch_module, "_global_forward_hooks", None)  # an OrderedDict by handle id
    if hooks is not None and handle.id in hooks:
        hooks.move_to_end(handle.id, last=False)  # before the user's global hooks
    return handle
