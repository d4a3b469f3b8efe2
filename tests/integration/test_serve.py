"""`miles serve` against a real Prefect server on PostgreSQL (``miles server``'s, started by the
tests, its scheduler polling every 2 s), as people use it:

- the deployments are registered with the run config as their validated parameter (the UI's form);
- a run started through the Python API and one started with ``prefect deployment run`` (the CLI)
  complete on the served deployment, each with its artifacts (metrics table, summary, curves image);
- the scheduled evaluation fires on its own and lands in the run's evaluation history;
- a fully-async run cancelled through the API ends CANCELLED within seconds, its producer stopped
  and no partial segment left in its sample stream;
- headless Chromium opens the served UI and finds the training deployment and the completed run with
  its artifacts, its curves image drawn; cancels a running fully-async run with the UI's Cancel
  button, which ends CANCELLED with nothing partial left; and starts a run from the deployment's
  RunConfig form (Run > Custom run > Submit), which completes (screenshots kept as test artifacts).

One server (``postgres_backend``) and one ``miles serve`` process serve the whole module (each takes seconds to
start).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from serving import REPO, recent_output, served, wait_for
from test_train_flow import _tiny_run

pytestmark = pytest.mark.integration

SCREENSHOTS = Path(os.environ.get("MILES_TEST_ARTIFACTS", REPO / "test-artifacts"))


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("served") / "runs"


@pytest.fixture(scope="module")
def first_run(postgres_backend, tiny_model_dir, runs_root) -> dict:
    """A finished run (in this process) for the scheduled evaluation to find."""
    from flows.train import train

    return train(_cfg(runs_root, tiny_model_dir))


@pytest.fixture(scope="module")
def serving(postgres_backend, first_run, tiny_model_dir, runs_root):
    """``miles serve`` with the scheduled evaluation of the newest ``flow-test`` run every 5 s."""
    argv = ["-m", "deployments.cli", "serve", "--hf-checkpoint", str(tiny_model_dir), "--storage-root", str(runs_root),
            "--eval-runs", str(runs_root / "flow-test"), "--eval-every-s", "5",
            # the form's defaults (a run started from the UI as it stands): a tiny run named ui-form
            "--name", "ui-form", "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "4", "--global-batch-size", "8", "--micro-batch-size", "4",
            "--eval-num-prompts", "4"]
    with served(argv, postgres_backend, tail=60) as server:
        wait_for(lambda: server.poll() is None and _deployment("evaluate-run/scheduled"), 90, "the served deployments")
        yield server


@pytest.fixture(scope="module")
def api_run(serving, tiny_model_dir, runs_root):
    """A ``train/sync`` deployment run started with the Python API, finished."""
    from deployments.api import start_run

    run = start_run(_cfg(runs_root, tiny_model_dir), deployment="train/sync")
    run.wait(timeout=240)
    return run


def _cfg(root: Path, model_dir, **overrides):
    return _tiny_run(root.parent, model_dir, **overrides)  # _tiny_run puts runs under <arg>/runs


def _client_call(fn):
    from prefect.client.orchestration import get_client

    async def call():
        async with get_client() as client:
            return await fn(client)

    # on a thread of its own (with this one's context: the Prefect settings): Playwright's sync API
    # keeps an event loop running on this thread while the browser is open
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(contextvars.copy_context().run, asyncio.run, call()).result()


def _deployment(name: str):
    async def read(client):
        try:
            return await client.read_deployment_by_name(name)
        except Exception:
            return None

    return _client_call(read)


def _flow_runs(deployment_id, state: str | None = None):
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )

    state_filter = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[state]))) if state else None
    return _client_call(lambda client: client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])), flow_run_filter=state_filter))


def _artifacts(flow_run_id) -> dict[str, list]:
    """The flow run's artifacts by type."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    found = _client_call(lambda client: client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))))
    by_type: dict[str, list] = {}
    for artifact in found:
        by_type.setdefault(artifact.type, []).append(artifact)
    return by_type


def _latest(artifacts: list):
    """The newest version of a run's keyed artifact (a live run publishes several)."""
    assert len({a.key for a in artifacts}) == 1 and artifacts[0].key, [a.key for a in artifacts]
    return max(artifacts, key=lambda a: a.created)


def _assert_run_artifacts(flow_run_id, run_dir: str) -> None:
    artifacts = _artifacts(flow_run_id)
    assert {"table", "markdown", "image", "progress"} <= set(artifacts), sorted(artifacts)
    image = _latest(artifacts["image"])
    assert image.data.startswith("data:image/png;base64,") and len(image.data) > 5000, image.data[:80]
    assert (Path(run_dir) / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [summary] = artifacts["markdown"]
    assert f"[{run_dir}](file://{run_dir})" in summary.data, summary.data  # a link to the run folder
    table = _latest(artifacts["table"])
    assert table.key == f"{Path(run_dir).parent.name}-{Path(run_dir).name}-metrics"
    assert [row["step"] for row in json.loads(table.data)] == [1, 2, 3]
    [progress] = artifacts["progress"]
    assert progress.data == 100.0 and " step 3/3 | reward " in progress.description, progress.description


def test_deployments_are_registered_with_the_run_config_form(serving, tiny_model_dir, runs_root):
    for name in ("train/sync", "train/async", "train/fully-async", "train-multi-lora/multi-lora",
                 "rollout/fleet", "evaluate-run/on-demand", "evaluate-run/scheduled", "tinker-service/serve"):
        assert _deployment(name) is not None, name
    sync = _deployment("train/sync")
    # the parameter is the pydantic RunConfig: the UI renders (and validates) a form from this schema
    schema = sync.parameter_openapi_schema
    assert schema["properties"]["cfg"]["$ref"].endswith("/RunConfig") and "RunConfig" in schema["definitions"]
    assert sync.parameters["cfg"]["model"]["path"] == str(tiny_model_dir)  # serve's config: the defaults
    assert _deployment("train/fully-async").parameters["cfg"]["mode"]["type"] == "fully_async"
    scheduled = _deployment("evaluate-run/scheduled")
    assert scheduled.schedules and scheduled.parameters == {"run_dir": str(runs_root / "flow-test"), "only_new": True}


def test_a_run_started_with_the_python_api_completes_with_its_artifacts(api_run):
    summary = api_run.wait()
    assert summary["final_version"] == 6 and api_run.status() == "COMPLETED" and not api_run.in_process
    assert [r["step"] for r in api_run.metrics()] == [1, 2, 3]
    _assert_run_artifacts(api_run.id, api_run.run_dir)


def test_a_run_started_with_prefect_deployment_run_completes_with_its_artifacts(serving, postgres_backend,
                                                                                tiny_model_dir, runs_root):
    from deployments.api import get_run

    run_id = "cli-" + uuid.uuid4().hex[:8]  # named up front, so the handle finds its folder
    cfg = _cfg(runs_root, tiny_model_dir, name="cli-test", run_id=run_id).model_dump(mode="json")
    cli = subprocess.run([str(Path(sys.executable).parent / "prefect"), "deployment", "run", "train/sync",
                          "--param", f"cfg={json.dumps(cfg)}"],
                         env={**os.environ, "PREFECT_API_URL": postgres_backend}, capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", cli.stdout).group(1)
    run = get_run(flow_run_id)
    summary = run.wait(timeout=240)
    assert run.status() == "COMPLETED" and summary["run_id"] == run_id and summary["final_version"] == 6
    _assert_run_artifacts(run.id, run.run_dir)


def test_a_deployment_runs_cfg_is_applied_on_top_of_the_served_one(serving, postgres_backend, tiny_model_dir,
                                                                   runs_root):
    """``--param cfg='{"rollout.num_rollout": 1, ...}'`` changes those fields of the served config
    (``ui-form``: 4 prompts x 4, 8 samples an optimizer step) instead of replacing it with built-in
    defaults (which once started building the default tiny model in the serving folder)."""
    from deployments.api import get_run

    run_id = "merge-" + uuid.uuid4().hex[:8]
    cli = subprocess.run([str(Path(sys.executable).parent / "prefect"), "deployment", "run", "train/sync",
                          "--param", "cfg=" + json.dumps({"rollout.num_rollout": 1, "run_id": run_id})],
                         env={**os.environ, "PREFECT_API_URL": postgres_backend}, capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    run = get_run(re.search(r"UUID: ([0-9a-f-]{36})", cli.stdout).group(1))
    summary = run.wait(timeout=240)
    assert summary["steps"] == 1 and summary["final_version"] == 2  # one step of 16 samples, 8 a step: the served config
    assert Path(summary["run_dir"]) == runs_root / "ui-form" / run_id
    saved = json.loads((Path(summary["run_dir"]) / "config.json").read_text())
    assert saved["model"]["path"] == str(tiny_model_dir) and saved["rollout"]["rollout_batch_size"] == 4


def test_a_mode_deployment_refuses_a_run_of_another_mode(serving, postgres_backend, runs_root):
    """``train/sync`` trains in sync mode (its runs are tagged so): its form offers sync only, so the
    server refuses a run asking for fully_async; a run that skips the server's check (a deployment
    from prefect.yaml has the flow's own schema) fails at once, naming the deployment to use."""
    from deployments.api import RunFailed, get_run

    cli = subprocess.run([str(Path(sys.executable).parent / "prefect"), "deployment", "run", "train/sync",
                          "--param", "cfg=" + json.dumps({"mode": {"type": "fully_async"}, "run_id": "wrong-mode"})],
                         env={**os.environ, "PREFECT_API_URL": postgres_backend}, capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert cli.returncode != 0 and "'fully_async' is not one of ['sync']" in cli.stdout + cli.stderr, cli.stdout

    deployment = _deployment("train/sync")

    async def unchecked(client):
        response = await client._client.post(f"/deployments/{deployment.id}/create_flow_run", json={
            "parameters": {"cfg": {"mode": "fully_async", "run_id": "wrong-mode"}},
            "enforce_parameter_schema": False})
        response.raise_for_status()
        return response.json()["id"]

    run = get_run(_client_call(unchecked))
    with pytest.raises(RunFailed, match="start it on the 'fully-async' deployment"):
        run.wait(timeout=120)
    assert not (runs_root / "ui-form" / "wrong-mode").exists()  # refused before the run folder was made


def test_the_scheduled_evaluation_fires(serving, api_run, runs_root):
    from miles_core.eval.standalone import read_history

    scheduled = _deployment("evaluate-run/scheduled")

    # every 5 s the schedule evaluates the newest flow-test run: soon one evaluates the newest run's
    # last version (earlier ones may have caught a run mid-training, or the one before it)
    def evaluated_a_last_version():
        newest = sorted(p for p in (runs_root / "flow-test").iterdir() if (p / "config.json").exists())[-1]
        if not (newest / "eval_history.parquet").exists():
            return False
        return any(row["version"] == 6 for row in read_history(str(newest)))

    try:
        wait_for(evaluated_a_last_version, 150, "a scheduled evaluation of a finished run")
    except AssertionError:
        print("scheduled runs:", [f"{r.state_type.value}:{r.state.message}" for r in _flow_runs(scheduled.id)])
        raise
    completed = _flow_runs(scheduled.id, "COMPLETED")
    assert any("table" in _artifacts(r.id) for r in completed)  # the history, as a table artifact
    # later ticks find nothing new: the finished run's last version is evaluated once, however many ticks
    seen = len(completed)
    wait_for(lambda: len(_flow_runs(scheduled.id, "COMPLETED")) >= seen + 2, 60, "two more scheduled ticks")
    newest = sorted(p for p in (runs_root / "flow-test").iterdir() if (p / "config.json").exists())[-1]
    assert [row["version"] for row in read_history(str(newest))].count(6) == 1
    assert all(r.name.startswith("evaluate flow-test/") or r.name == "evaluate runs/flow-test"
               for r in _flow_runs(scheduled.id, "COMPLETED")), "named after the run, not the folder's path"
    # one at a time: a run that came due while another ran was cancelled, never started beside it
    assert scheduled.global_concurrency_limit.limit == 1
    assert scheduled.concurrency_options.collision_strategy.value == "CANCEL_NEW"
    ran = sorted((r.start_time, r.end_time or r.start_time) for r in _flow_runs(scheduled.id)
                 if r.start_time and r.state_type.value != "CANCELLED")  # cancelled ones never ran
    overlaps = [(a, b) for a, b in zip(ran, ran[1:]) if b[0] < a[1]]
    assert not overlaps, f"scheduled evaluations ran at the same time: {overlaps}"


def _training_fully_async_run(runs_root: Path, model_dir, name: str):
    """An endless fully-async run on ``train/fully-async``, once it has trained three steps."""
    from deployments.api import start_run

    cfg = _cfg(runs_root, model_dir, name=name,
               rollout={"num_rollout": 10_000, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                        "rollout_max_response_len": 4},
               train={"micro_batch_size": 16},
               eval={"eval_interval": None, "num_prompts": 4, "skip_eval_before_train": True},
               mode={"type": "fully_async", "segment_max_groups": 2})
    run = start_run(cfg, deployment="train/fully-async")

    def training_steps() -> int:
        assert run.status() not in ("COMPLETED", "FAILED", "CRASHED"), "the run ended before it was cancelled"
        return len(run.metrics())

    wait_for(lambda: training_steps() >= 3, 180, "three training steps")
    return run


def _assert_stopped_whole(run, server) -> None:
    """Every producer stopped cleanly and its sample stream holds only whole segments; the run
    folder says which producer wrote what."""
    from miles_core.processes import alive
    from miles_core.rollout.fleet import ControlPlane, stream_name
    from miles_core.storage import SampleStream

    run_dir = Path(run.run_dir)
    control = ControlPlane(str(run_dir))
    assert control.heartbeats(), "no producer heartbeat in the run folder"

    def all_stopped():
        beats = control.heartbeats()
        return beats if all(beat.status == "stopped" for beat in beats.values()) else None

    # the run is CANCELLED once its own process ends; a producer (a process of its own, told by
    # SIGTERM or by finding its parent gone) says "stopped" a moment later, under load seconds later
    try:
        beats = wait_for(all_stopped, 30, "every producer to say it stopped", poll=0.2)
    except AssertionError:
        beats = control.heartbeats()
        states = {p: (run_dir / "state" / f"producer-{p}.json").read_text()[:400] for p in beats
                  if (run_dir / "state" / f"producer-{p}.json").exists()}
        raise AssertionError(
            f"producers not stopped 30 s after the run was (at {time.time():.1f}): {beats}\n"
            f"processes alive: {({p: alive(b.pid) for p, b in beats.items()})}\nstate files: {states}\n"
            f"--- the served process's output ---\n{recent_output(server, 80)}") from None
    for producer, beat in beats.items():
        assert beat.status == "stopped", (producer, beat)
        segments = SampleStream(str(run_dir), producer=stream_name(producer)).read()  # every one decodes
        assert segments and sum(len(s) for s in segments) == beat.stats["groups_written"] * 4
        folder = run_dir / "samples" / stream_name(producer)
        leftovers = [p.name for p in folder.iterdir() if not p.name.endswith(".arrow")]
        assert leftovers == [], leftovers


def test_cancelling_a_fully_async_run_ends_it_cancelled_leaving_nothing_partial(serving, tiny_model_dir, runs_root):
    run = _training_fully_async_run(runs_root, tiny_model_dir, "cancel-test")
    t0 = time.monotonic()
    state = run.cancel(timeout=60)
    seconds = time.monotonic() - t0
    assert state.is_cancelled(), state
    assert seconds < 20, f"cancellation took {seconds:.1f} s"
    _assert_stopped_whole(run, serving)


def _chromium() -> str | None:
    for path in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if os.access(path, os.X_OK):
            return path
    return None


needs_chromium = pytest.mark.skipif(_chromium() is None and not os.environ.get("CI"),  # CI runs them: fails there
                                    reason="needs Debian's chromium package (scripts/test.sh installs it)")


@pytest.fixture(scope="module")
def page(postgres_backend):
    """A headless Chromium page (Playwright), one for the module; its ``ui`` is the served UI's URL."""
    from playwright.sync_api import expect, sync_playwright

    # a busy two-core machine has taken over 5 s (expect's default) to render the RunConfig form
    expect.set_options(timeout=30_000)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        # no background networking: this machine's network is closed, and Chromium would keep trying
        browser = p.chromium.launch(executable_path=_chromium(), args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.ui = postgres_backend.removesuffix("/api")
            yield page
        finally:
            browser.close()
    print(f"screenshots: {SCREENSHOTS}")


@contextlib.contextmanager
def _screenshot_on_failure(page, name: str):
    try:
        yield
    except BaseException:
        page.screenshot(path=SCREENSHOTS / f"{name}-failed.png", full_page=True)
        raise


@needs_chromium
def test_the_ui_shows_the_deployment_and_the_completed_run_with_its_artifacts(serving, api_run, page):
    from playwright.sync_api import expect

    deployment = _deployment("train/sync")
    image = _latest(_artifacts(api_run.id)["image"])
    with _screenshot_on_failure(page, "ui-artifacts"):
        page.goto(f"{page.ui}/deployments")
        expect(page.get_by_text("8 Deployments")).to_be_visible()  # rollout/fleet and tinker-service/serve among them
        page.screenshot(path=SCREENSHOTS / "ui-deployments.png")
        page.get_by_role("link", name="sync", exact=True).click()  # the training deployment's page
        expect(page).to_have_url(re.compile(f"/deployments/deployment/{deployment.id}"))
        expect(page.get_by_text("flow-test").first).to_be_visible()  # its runs, the API's among them
        page.screenshot(path=SCREENSHOTS / "ui-deployment-train-sync.png")

        page.goto(f"{page.ui}/runs/flow-run/{api_run.id}")
        expect(page.get_by_text("Completed").first).to_be_visible()
        page.get_by_text("Artifacts", exact=True).click()
        for description in ("per-step metrics", "flow-test: step 3/3 | reward", "summary",
                            "reward and held-out accuracy"):
            expect(page.get_by_text(description).first).to_be_visible()
        page.screenshot(path=SCREENSHOTS / "ui-flow-run-artifacts.png", full_page=True)

        page.get_by_text("reward and held-out accuracy").first.click()  # the curves artifact's own page
        expect(page).to_have_url(re.compile(f"/artifacts/(artifact/{image.id}|key/{image.key})"))
        curves = page.locator("img[src^='data:image/png']").first
        expect(curves).to_be_visible()
        assert curves.evaluate("img => img.complete && img.naturalWidth") > 300, "the curves image did not draw"
        page.screenshot(path=SCREENSHOTS / "ui-curves-artifact.png", full_page=True)


@needs_chromium
def test_cancelling_from_the_ui_ends_the_run_cancelled_leaving_nothing_partial(serving, tiny_model_dir, runs_root,
                                                                               page):
    from playwright.sync_api import expect

    # (start_run here runs where Playwright keeps an event loop going, as in a notebook)
    run = _training_fully_async_run(runs_root, tiny_model_dir, "ui-cancel-test")
    with _screenshot_on_failure(page, "ui-cancel"):
        page.goto(f"{page.ui}/runs/flow-run/{run.id}")
        expect(page.get_by_text("Running").first).to_be_visible()
        page.get_by_role("button", name="Cancel", exact=True).click()
        page.screenshot(path=SCREENSHOTS / "ui-cancel-confirm.png")
        page.get_by_role("dialog").get_by_role("button", name="Confirm").click()  # "Cancel Flow Run"
        wait_for(lambda: run.status() == "CANCELLED", 60, "the run to end CANCELLED")
        expect(page.get_by_text("Cancelled").first).to_be_visible()
        page.screenshot(path=SCREENSHOTS / "ui-cancelled.png")
    _assert_stopped_whole(run, serving)


@needs_chromium
def test_a_run_started_from_the_ui_form_keeps_its_name_and_completes(serving, page, runs_root):
    """The UI's Run > Custom run on ``train/sync``: the RunConfig form renders with ``miles serve``'s
    config as its defaults, what a run is first (name, mode, model, data, ...), the tiny model's
    recipe folded, and a mode field offering sync only; submitted with a Run Name of our own, it
    starts a run of that name (found by it) that completes."""
    from playwright.sync_api import expect

    deployment = _deployment("train/sync")
    name = f"my-form-run-{uuid.uuid4().hex[:6]}"
    with _screenshot_on_failure(page, "ui-form"):
        page.goto(f"{page.ui}/deployments/deployment/{deployment.id}")
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run").click()
        expect(page).to_have_url(re.compile(f"/deployments/deployment/{deployment.id}/run"))
        expect(page.get_by_text("A whole training run.")).to_be_visible()  # RunConfig's form
        page.screenshot(path=SCREENSHOTS / "ui-form.png", full_page=True)
        labels = [t.strip() for t in page.locator("label").all_inner_texts() if t.strip()]
        first = [t for t in labels if t.split(" (")[0] in ("Name", "Mode", "Model", "Data", "Rollout", "Train")]
        assert [t.split(" (")[0] for t in first[:6]] == ["Name", "Mode", "Model", "Data", "Rollout", "Train"], labels
        assert "Hidden Size" not in " ".join(labels), "the tiny model's recipe is folded away"
        page.get_by_text("Run Name", exact=True).locator("xpath=following::input[1]").fill(name)
        page.get_by_role("button", name="Submit").click()
    runs = wait_for(lambda: [r for r in _flow_runs(deployment.id) if r.name == name], 60, f"the run named {name}")
    from deployments.api import get_run

    run = get_run(runs[0].id)  # its run id was given by the flow (the form had none): read from its label
    summary = run.wait(timeout=240)
    assert summary["steps"] == 2 and run.status() == "COMPLETED" and sorted(runs[0].tags) == ["sync", "train"]
    assert summary["run_dir"] == run.run_dir == str(runs_root / "ui-form" / run.run_id)  # the config's name: its folder
    assert [r["step"] for r in run.metrics()] == [1, 2]
    assert [r.name for r in _flow_runs(deployment.id) if r.id == run.id] == [name]  # never renamed


@needs_chromium
def test_a_running_runs_metrics_artifact_changes_in_the_ui(serving, tiny_model_dir, runs_root, page):
    """A run publishes its metrics table under one key every ``tracking.live_every_s``: the key's page
    in the UI shows more steps a few seconds later, while the run goes on."""
    from playwright.sync_api import expect

    from deployments.api import start_run

    run_id = "live-" + uuid.uuid4().hex[:8]
    cfg = _cfg(runs_root, tiny_model_dir, name="live-test", run_id=run_id,
               rollout={"num_rollout": 400, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                        "rollout_max_response_len": 4},
               eval={"eval_interval": None, "num_prompts": 4, "skip_eval_before_train": True},
               tracking={"live_every_s": 1.0})
    run = start_run(cfg, deployment="train/sync")
    key = f"live-test-{run_id}-metrics"

    def published_steps() -> int:
        tables = _artifacts(run.id).get("table", [])
        return max((len(json.loads(t.data)) for t in tables if t.key == key), default=0)

    try:
        with _screenshot_on_failure(page, "ui-live"):
            wait_for(lambda: published_steps() >= 2, 120, "the run's first metrics table")
            page.goto(f"{page.ui}/artifacts/key/{key}")
            first = page.get_by_text(re.compile(r"per-step metrics \(step \d+ of 400\)")).first
            expect(first).to_be_visible()
            before = first.inner_text()
            page.screenshot(path=SCREENSHOTS / "ui-live-1.png", full_page=True)
            seen = published_steps()
            wait_for(lambda: published_steps() > seen, 60, "a newer version of the metrics table")
            page.reload()
            later = page.get_by_text(re.compile(r"per-step metrics \(step \d+ of 400\)")).first
            expect(later).not_to_have_text(before)
            page.screenshot(path=SCREENSHOTS / "ui-live-2.png", full_page=True)
            step = lambda text: int(re.search(r"step (\d+) of", text).group(1))  # noqa: E731
            assert step(later.inner_text()) > step(before), (before, later.inner_text())
            assert (SCREENSHOTS / "ui-live-1.png").read_bytes() != (SCREENSHOTS / "ui-live-2.png").read_bytes()
            # the newest version is the table itself, one row per step so far
            latest = max((t for t in _artifacts(run.id)["table"] if t.key == key), key=lambda a: a.created)
            page.goto(f"{page.ui}/artifacts/artifact/{latest.id}")
            expect(page.get_by_text("reward_mean").first).to_be_visible()
            expect(page.get_by_role("cell", name=str(len(json.loads(latest.data))), exact=True).first).to_be_visible()
            page.screenshot(path=SCREENSHOTS / "ui-live-table.png", full_page=True)
            assert run.status() == "RUNNING"
    finally:
        run.cancel(timeout=60)
