"""Prefect flows: a training run (``train``), multi-LoRA, evaluation, a rollout producer."""

from flows import prefect_defaults

prefect_defaults.apply()
prefect_defaults.quiet_task_logs()
