"""LoRA syncs: the trainer sends only its PEFT adapter, each worker takes it as it can.

With ``WeightSync(..., lora=True)`` (``SyncSettings.lora``) the trainer's model must be a
PEFT model (``peft.get_peft_model``). At every setup the trainer's sender is pointed at the
model's active adapter (:func:`~weightsync.core.lora.source.send_adapter`): the Manifest
then lists the adapter's tensors under PEFT's checkpoint names (what
``get_peft_model_state_dict`` and ``adapter_model.safetensors`` use, without the adapter's
name), and carries its :class:`~weightsync.core.wire.adapter.AdapterConfig`. The base
model's tensors never travel. Each worker's receiver picks the sink for the session
(:func:`~weightsync.core.lora.sink.session_sink`):

* a module worker holding a PEFT model (a ``ModuleSink`` of it): its own adapter of the
  same config, written in place, bit for bit (:class:`~weightsync.core.lora.sink.AdapterSink`);
* a worker that says how it takes adapters (``WeightReceiver.adapter_sink``: a vLLM
  engine's TP ranks, see ``weightsync.vllm.lora``);
* anything else is refused at setup, by name.

Call order (one session)::

    send_adapter(sender, settings.lora)      # the trainer, before sender.manifest(...)
    receiver.accept(manifest, ...)           # session_sink(...) -> the sink for this session
    per sync: sender.send / receiver.receive as for any sync

Nothing here imports PEFT until a PEFT model is handled. The package itself imports
nothing: take the names from its modules (the receiver imports only the sink's).
"""
