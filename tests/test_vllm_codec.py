"""What crosses vLLM's worker RPC is bytes: the codec and the reply rules, without vLLM."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("cloudpickle", reason="cloudpickle comes with vLLM (the vllm extra)")

from weightsync.vllm.codec import (
    Call,
    RemoteCallError,
    decode_call,
    decode_reply,
    encode_call,
    run_call,
    unwrap,
)


def test_a_call_and_its_dataclass_arguments_round_trip_as_bytes() -> None:
    from weightsync import TensorSpec

    spec = TensorSpec("w", (2, 3), "bfloat16")
    payload = encode_call(Call("ws_accept", (spec,), {"name": "vllm"}))
    assert isinstance(payload, bytes)
    call = decode_call(payload)
    assert call.target == "ws_accept" and call.args == (spec,) and isinstance(call.args[0], TensorSpec)
    assert call.kwargs == {"name": "vllm"}


def test_a_result_that_cannot_be_pickled_becomes_a_failed_reply_naming_its_type() -> None:
    data = run_call(lambda: threading.Lock(), lambda: (1, "committed"))
    assert isinstance(data, bytes)
    reply = decode_reply(data, "vllm (TP rank 0)", "ws_describe")
    assert not reply.ok and reply.error_type == "UnpicklableResult" and "lock" in reply.message
    assert reply.state == (1, "committed")
    with pytest.raises(RemoteCallError, match=r"vllm \(TP rank 0\): ws_describe failed"):
        unwrap(reply, "vllm (TP rank 0)", "ws_describe")


def test_an_error_in_the_worker_comes_back_with_its_type_and_traceback() -> None:
    def boom() -> None:
        raise KeyError("model.layers.0.mlp.up_proj.weight")

    reply = decode_reply(run_call(boom, lambda: (None, "dirty")), "w", "ws_receive")
    assert (reply.ok, reply.error_type, reply.state) == (False, "KeyError", (None, "dirty"))
    assert "up_proj" in reply.message and "boom" in reply.remote_traceback
    err = RemoteCallError("w: failed", "KeyError", "tb")
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert (str(again), again.error_type, again.remote_traceback) == ("w: failed", "KeyError", "tb")


def test_anything_but_weightsync_bytes_is_refused_by_name() -> None:
    with pytest.raises(Exception, match="vllm: ws_status answered dict"):
        decode_reply({"ok": True}, "vllm", "ws_status")
    with pytest.raises(TypeError, match="arrives as bytes"):
        decode_call("ws_status")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="method name or a callable"):
        Call(42)  # type: ignore[arg-type]
