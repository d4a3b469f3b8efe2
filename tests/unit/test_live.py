"""The UI's live view of a run (flows/live.py): artifact keys, the progress line, the metrics table;
and what the UI's form is given (field order, the folded tiny-model recipe, a deployment's one mode)."""

from __future__ import annotations

from flows.live import artifact_key, metrics_table, progress_line


def test_artifact_keys_are_what_prefect_accepts_one_per_run():
    assert artifact_key("Toy_Addition", "20261204-101502-ab12", "metrics") == "toy-addition-20261204-101502-ab12-metrics"
    assert artifact_key("a b//c", "r1", "adapter.one", "curves") == "a-b-c-r1-adapter-one-curves"
    assert artifact_key("x", "", "summary") == "x-summary"


def test_the_progress_line_says_step_reward_accuracy_held_out_and_time_left():
    row = {"reward_mean": 0.5312, "accuracy": 0.7, "loss": 0.1}
    line = progress_line("toy", 12, 60, row, {"step": 10.0, "accuracy": 0.8125}, eta_s=45.4)
    assert line == "toy: step 12/60 | reward 0.531 | acc 0.700 | held-out 0.812 (step 10) | 45 s left"
    assert progress_line("toy", 3, 60, row, None, eta_s=754).endswith("| acc 0.700 | 12 min 34 s left")
    assert progress_line("toy", 3, 60, row, None, eta_s=7300).endswith("2 h 01 min left")
    assert progress_line("toy", 60, 60, row, None, eta_s=None).endswith("| acc 0.700 | done")
    assert progress_line("toy", 0, 60, {}, None, eta_s=None) == "toy: step 0/60"


def test_the_metrics_table_keeps_the_headline_columns_rounded():
    rows = [{"step": 1, "reward_mean": 0.123456, "loss": -0.5, "version": 2, "async/producer_qps": 3.0},
            {"step": 2, "reward_mean": 0.5, "eval_accuracy": 0.25}]
    assert metrics_table(rows) == [{"step": 1, "reward_mean": 0.1235, "loss": -0.5},
                                   {"step": 2, "reward_mean": 0.5, "eval_accuracy": 0.25}]


def test_the_form_lists_what_a_run_is_first_and_folds_the_tiny_model_recipe():
    from miles_core.config import ModelConfig, RunConfig, TinyModelRecipe

    schema = RunConfig.model_json_schema()
    order = sorted(schema["properties"], key=lambda k: schema["properties"][k]["position"])
    assert order[:7] == ["name", "mode", "model", "data", "rollout", "train", "eval"]
    model = schema["$defs"]["ModelConfig"]["properties"]
    assert sorted(model, key=lambda k: model[k]["position"])[0] == "path"
    assert {"type": "null"} in model["tiny"]["anyOf"] and model["tiny"]["default"] is None  # folded: a None toggle
    for name, table in schema["$defs"].items():  # every table's fields are numbered (PostgreSQL reorders keys)
        positions = [field.get("position") for field in table.get("properties", {}).values()]
        assert positions == list(range(len(positions))), name
    assert ModelConfig().recipe == TinyModelRecipe()  # None is the default recipe
    assert ModelConfig(tiny={"hidden_size": 64}).recipe.hidden_size == 64


def test_a_mode_deployment_offers_its_mode_only(tmp_path, monkeypatch):
    from deployments.serve import deployments
    from miles_core.config import RunConfig

    monkeypatch.chdir(tmp_path)
    served = {d.name: d for d in deployments(RunConfig())}
    for name, mode in (("sync", "sync"), ("async", "async"), ("fully-async", "fully_async")):
        field = served[name]._parameter_openapi_schema.definitions["RunConfig"]["properties"]["mode"]
        assert field["properties"]["type"]["enum"] == [mode] and field["properties"]["type"]["readOnly"]
        assert served[name].tags == ["train", mode] and served[name].parameters["cfg"]["mode"]["type"] == mode
        assert field["position"] == 1 and "trains in" in field["description"]
    # the mode's own settings, and only those, are in its form
    fully = served["fully-async"]._parameter_openapi_schema.definitions["RunConfig"]["properties"]["mode"]
    assert "max_concurrent_samples" in fully["properties"] and "update_weights_interval" not in fully["properties"]
    # the flow's own schema (prefect deploy, other deployments) still offers every mode
    multi = served["multi-lora"]._parameter_openapi_schema.definitions["RunConfig"]["properties"]["mode"]
    assert sorted(multi["discriminator"]["mapping"]) == ["async", "fully_async", "sync"]


def test_a_mode_deployment_keeps_the_served_configs_settings_of_its_mode(tmp_path, monkeypatch):
    from deployments.serve import deployments
    from miles_core.config import RunConfig

    monkeypatch.chdir(tmp_path)
    cfg = RunConfig.model_validate({"mode": {"type": "fully_async", "max_concurrent_samples": 8}})
    served = {d.name: d.parameters["cfg"]["mode"] for d in deployments(cfg) if "cfg" in d.parameters}
    assert served["fully-async"]["max_concurrent_samples"] == 8
    assert served["async"] == {"type": "async", "update_weights_interval": 1} and served["sync"] == {"type": "sync"}


def test_a_live_report_republishes_on_its_interval_and_once_more_at_the_end(monkeypatch):
    """Steps 1 s apart, progress every 2 s, artifacts every 5 s: the table and curves go out at 5 s and
    10 s while the run goes on (also where the progress line is due at the same step), the last step
    waits for ``finish``."""
    import flows.live as live

    clock, calls = [0.0], []
    monkeypatch.setattr(live.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(live, "create_progress_artifact", lambda *a, **k: "progress-id")
    monkeypatch.setattr(live, "update_progress_artifact", lambda _id, pct, description: calls.append(("progress", pct)))
    monkeypatch.setattr(live, "create_table_artifact", lambda rows, key, description: calls.append(("table", len(rows))))
    monkeypatch.setattr(live, "create_image_artifact", lambda url, key, description: calls.append(("image", key)))

    class History:
        metrics_rows: list = []
        eval_rows: list = []

    history = History()
    report = live.LiveReport("toy", "toy-r1", total=12, start=0, history=history, every_s=5.0)
    for step in range(1, 13):
        clock[0] = float(step)
        history.metrics_rows = [{"step": k, "reward_mean": 0.5} for k in range(1, step + 1)]
        report.step_done(step)
    assert [c for c in calls if c[0] == "table"] == [("table", 5), ("table", 10)]
    assert [c[1] for c in calls if c[0] == "progress"] == [100 * k / 12 for k in (2, 4, 6, 8, 10, 12)]
    report.finish()
    assert calls[-2:] == [("image", "toy-r1-curves"), ("table", 12)]
