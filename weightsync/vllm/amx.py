"""AMX tile state for vLLM's CPU attention kernel, asked for before the engine's first request.

Linux hands a process Intel's AMX tile registers only after it asks for them
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); an AMX instruction before that
is an illegal instruction, and the process dies by SIGILL. vLLM's CPU build picks its
``"amx"`` attention kernel for bf16 models on CPUs that report AMX tiles, and that kernel
never asks. oneDNN asks, but only once its own matrix multiply picks an AMX kernel, which
it does for prefills of more than a few tokens. So an engine whose first prefill is one
prompt of 1-3 tokens died in its attention (``Worker proc VllmWorker-0 died unexpectedly
(exit code: -4)``), while one that first saw a longer prompt never did.

:func:`request_amx_tiles` asks, as torch itself does (``torch.cpu._init_amx()``); each TP
rank calls it while it is set up (``WorkerExtension.weightsync_setup``), before any request,
and so does the ``weightsync`` weight-transfer backend, which vLLM makes in every TP rank as
the model loads (a vLLM server started with it: ``ServerWorker``).
Asking only enlarges the state the kernel saves for the process's threads.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("weightsync")


def request_amx_tiles() -> bool:
    """Ask Linux for AMX tile state in this process when the CPU has AMX tiles; True when
    the process may use them now, False when the CPU has none or the request was refused."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    granted = bool(torch.cpu._init_amx())
    if not granted:
        log.warning(
            "weightsync: this CPU reports AMX tiles but Linux refused them to this process: vLLM's bf16 CPU "
            "attention will die with SIGILL; run the engine in float32 or on a kernel that allows AMX"
        )
    return granted
