"""A private folder for one engine's IPC sockets, removed when the engine shuts down.

vLLM's front end and its engine process talk over ZeroMQ IPC sockets named
``<VLLM_RPC_BASE_PATH>/<uuid>``, by default in the system temp folder, and vLLM does not
remove the socket files when the engine stops: every engine start leaves several behind in
/tmp. :class:`~weightsync.vllm.VLLMWorker` and :class:`~weightsync.vllm.AsyncVLLMWorker`
give each engine a folder of its own, which the engine's processes inherit through the
environment, and remove it with everything in it at ``shutdown()`` or when the actor's
process exits normally. A ``VLLM_RPC_BASE_PATH`` the caller set (in the actor's environment
or through ``env=``) is the caller's: it is used as it is and never removed.

Call order, in the actor::

    sockets = SocketFolder.claim()   # after env=... is applied, before vLLM starts an engine
    ...                              # the engine runs; its sockets live in sockets.path
    sockets.release()                # once the engine has shut down (again: a no-op)
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass

#: The vLLM setting that names the folder of its IPC sockets.
ENV_VAR = "VLLM_RPC_BASE_PATH"


@dataclass
class SocketFolder:
    """The folder an engine's sockets go to, and whether weightsync made it."""

    path: str
    """The folder vLLM puts the engine's sockets in."""
    owned: bool
    """True when weightsync made the folder (so removes it); False for the caller's own."""

    @classmethod
    def claim(cls) -> SocketFolder:
        """Point vLLM at a new private folder unless the environment already names one."""
        preset = os.environ.get(ENV_VAR)
        if preset:
            return cls(preset, owned=False)
        folder = cls(tempfile.mkdtemp(prefix="weightsync-vllm-rpc-"), owned=True)
        os.environ[ENV_VAR] = folder.path
        atexit.register(folder.release)
        return folder

    def release(self) -> None:
        """Remove the folder and the sockets in it, if weightsync made it."""
        if self.owned and os.path.isdir(self.path):
            shutil.rmtree(self.path)


__all__ = ["ENV_VAR", "SocketFolder"]
