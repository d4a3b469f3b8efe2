"""The Prefect settings runs get (flows/prefect_defaults.py) and the task-run log filter."""

from __future__ import annotations

import logging

from flows import prefect_defaults


def test_defaults_fill_only_what_the_user_left_unset():
    env = {"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "7"}
    prefect_defaults.apply(env)
    assert env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] == "7"
    assert env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL"] == "1"
    assert env["DO_NOT_TRACK"] == "1" and env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"


def test_every_default_is_a_setting_prefect_knows():
    from prefect.settings import Settings

    names = Settings().to_environment_variables(exclude_unset=False)
    unknown = [name for name in prefect_defaults.DEFAULTS if name.startswith("PREFECT_") and name not in names]
    assert not unknown, f"Prefect has no such settings (renamed?): {unknown}"


def test_completed_task_runs_are_not_logged_but_failures_are(caplog):
    prefect_defaults.quiet_task_logs()
    prefect_defaults.quiet_task_logs()  # twice: one filter
    logger = logging.getLogger("prefect.task_runs")
    assert sum(isinstance(f, prefect_defaults._HideCompleted) for f in logger.filters) == 1
    with caplog.at_level(logging.INFO, logger="prefect.task_runs"):
        logger.info("Finished in state Completed()")
        logger.error("Finished in state Failed('Task run encountered an exception ValueError')")
        logger.info("launched rollout producer p0: process 12")
    messages = [r.getMessage() for r in caplog.records if r.name == "prefect.task_runs"]
    assert messages == ["Finished in state Failed('Task run encountered an exception ValueError')",
                        "launched rollout producer p0: process 12"]
