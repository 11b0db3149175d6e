"""The private folder for a vLLM engine's sockets (``weightsync.vllm.sockets``), without vLLM:
claimed into the environment unless the caller named one, removed with what is in it, and
never removed when it is the caller's."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from weightsync.vllm.sockets import ENV_VAR, SocketFolder


def bind_socket(folder: str) -> str:
    """A bound Unix socket file in ``folder``, as vLLM leaves them; returns its path."""
    path = os.path.join(folder, "engine-input")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.close()  # the file stays, as it does when a process ends
    return path


def test_a_claimed_folder_is_named_in_the_environment_and_removed_with_its_sockets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "")  # empty is unset; monkeypatch restores what was there
    folder = SocketFolder.claim()
    assert folder.owned and os.environ[ENV_VAR] == folder.path
    assert os.path.dirname(folder.path) == tempfile.gettempdir() and os.path.isdir(folder.path)
    left = bind_socket(folder.path)
    assert os.path.exists(left)
    folder.release()
    assert not os.path.exists(folder.path), f"{folder.path} outlived release()"
    folder.release()  # twice (shutdown, then the process's exit): nothing left to do


def test_a_folder_the_caller_named_is_used_and_never_removed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mine = tmp_path / "my-sockets"
    mine.mkdir()
    monkeypatch.setenv(ENV_VAR, str(mine))
    folder = SocketFolder.claim()
    assert (folder.path, folder.owned) == (str(mine), False)
    assert os.environ[ENV_VAR] == str(mine)
    kept = bind_socket(folder.path)
    folder.release()
    assert os.path.exists(kept), f"release() removed the caller's {ENV_VAR} folder"


class _EngineCore:
    def __init__(self) -> None:
        self.stopped = 0

    def shutdown(self) -> None:
        self.stopped += 1


class _StartedLLM:
    """Stands in for vLLM's ``LLM`` once its engine is up: a model folder with no
    checkpoint in it, so the actor's model check fails after the engine started."""

    instances: ClassVar[list[_StartedLLM]] = []

    def __init__(self, model: str, **_: object) -> None:
        self.folder = os.environ[ENV_VAR]  # where this engine's sockets would go
        core = _EngineCore()
        config = type("ModelConfig", (), {"dtype": torch.bfloat16, "model": model, "revision": None})()
        load = type("LoadConfig", (), {"download_dir": None})()
        vllm_config = type("VllmConfig", (), {"model_config": config, "load_config": load})()
        self.llm_engine = type(
            "LLMEngine", (), {"model_config": config, "vllm_config": vllm_config, "engine_core": core}
        )()
        _StartedLLM.instances.append(self)


def test_an_engine_actor_whose_setup_fails_stops_its_engine_and_removes_its_socket_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
    from weightsync import WeightSyncError
    from weightsync.vllm.engine import _VLLMWorker

    monkeypatch.setenv(ENV_VAR, "")
    monkeypatch.setattr(vllm, "LLM", _StartedLLM)
    with pytest.raises(WeightSyncError, match="no-checkpoint.*safetensors"):
        _VLLMWorker(model=str(tmp_path / "no-checkpoint"))
    (llm,) = _StartedLLM.instances
    assert llm.llm_engine.engine_core.stopped == 1, "the engine was left running"
    assert os.path.dirname(llm.folder) == tempfile.gettempdir()
    assert not os.path.exists(llm.folder), f"{llm.folder} outlived the failed actor"
