"""A Tinker-compatible service: the official ``tinker`` SDK and ``tinker-cookbook`` loops train LoRA
adapters through this project's trainer and engines.

- ``server``: the HTTP endpoints the SDK calls and ``miles tinker-serve``.
- ``service``: sessions, training clients, samplers, the training thread and call ordering.
- ``trainer``: training clients as adapters on shared base models (``AdapterBank``), their
  ``forward_backward`` calls fused into one pass.
- ``losses``: the SDK's loss functions on our loss code.
- ``futures``: results kept for the SDK's long polls.
- ``store``: sessions, clients and checkpoints in the run storage (a restart resumes from them).
- ``wire``: the SDK's protobuf messages.

docs/tinker.md says how to run it and what is and is not supported.
"""
