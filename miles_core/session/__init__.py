"""The parts one run is made of, each built from (config, run folder) alone.

- ``refs``: ``RunRefs`` (where a run lives) and the small references steps return.
- ``parts``: ``RunFiles`` (the run folder, its sample stream, its weight store), ``EngineLoop``
  (the event loop engines run on), ``built_once``, and the prompt helpers.
- ``rollouts.RolloutSide``: what generates (the policy engine, prompts, reward): a sync run's
  rollouts, and the producer of a fleet member (``miles_core.session.fleet_member``).
- ``training.TrainerSide``: what trains (the trainer, the feed of a fully-async run).
- ``evals.Evaluator``: held-out evaluation, on any engine or on a separate one.
- ``history.RunHistory``: ``metrics.jsonl`` and ``eval.jsonl``.
- ``checkpoints.Checkpointer``: saving a run and putting it back.
- ``fleet_member``: one producer of a fully-async run's fleet as a process of its own
  (``run_fleet_producer``, ``SubprocessLauncher``).

``miles_core.run.RunSession`` composes them for one training process; a fleet member builds only
a ``RolloutSide``; a multi-LoRA run (``miles_core.multi_lora``) shares one ``RolloutSide`` between
adapters that each have their own trainer side, evaluator, history and checkpointer; a standalone
evaluation builds only an ``Evaluator``.
"""
