"""Device slots: a run's work holds slots of the Prefect global concurrency limit
``cfg.resources.pool`` while it uses devices. Every run on the same Prefect server draws from the
same limit, so together they never use more devices than it holds.

- ``device_slots(cfg, phase)``: the slots one task takes for its block. A rollout, and an
  evaluation on the rollout engine, take ``rollout_slots``; a training step ``train_slots``; an
  evaluation on the separate evaluation engine ``eval_slots``.
- ``run_slots(cfg)``: a run with a producer for its whole length (fully async, multi-LoRA) keeps
  its rollout engine and trainer busy all along, so it takes ``rollout_slots + train_slots`` in one
  acquisition for that length, and its rollouts, training steps and rollout-engine evaluations take
  nothing more. Taking both at once is what keeps two such runs from each holding a producer's
  slots while waiting for a training step's (which would wait forever).
- ``check_device_pool(cfg)``: a missing pool, or one smaller than what the run holds at once,
  fails the run before any work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from miles_core.config import RunConfig

Phase = Literal["rollout", "train", "eval"]


def _missing(pool: str, detail: str = "") -> RuntimeError:
    return RuntimeError(
        f"resources.pool={pool!r}: this Prefect server has no global concurrency limit of that name{detail}; "
        f"create it with `miles serve --device-slots {pool}=N` or "
        f"`prefect global-concurrency-limit create {pool} --limit N`"
    )


@contextlib.contextmanager
def _hold(pool: str | None, occupy: int) -> Iterator[None]:
    if pool is None or occupy == 0:
        yield
        return
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
    from prefect.concurrency.sync import concurrency

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(concurrency(pool, occupy=occupy, strict=True))
        except ConcurrencySlotAcquisitionError as e:
            raise _missing(pool, f" ({e})") from None
        yield


def holds_run_slots(cfg: RunConfig) -> bool:
    """Whether the run takes its rollout and training slots once, for its whole length."""
    return cfg.mode.type == "fully_async"  # multi-LoRA runs included: they are always fully async


def _separate_eval(cfg: RunConfig) -> bool:
    return cfg.multi_lora is None and cfg.eval.engine == "separate"


def phase_slots(cfg: RunConfig, phase: Phase) -> int:
    """Slots one task of ``phase`` takes (0 when ``run_slots`` already holds them)."""
    r = cfg.resources
    if phase == "eval":
        return r.eval_slots
    return 0 if holds_run_slots(cfg) else getattr(r, f"{phase}_slots")


@contextlib.contextmanager
def device_slots(cfg: RunConfig, phase: Phase) -> Iterator[None]:
    with _hold(cfg.resources.pool, phase_slots(cfg, phase)):
        yield


@contextlib.contextmanager
def run_slots(cfg: RunConfig) -> Iterator[None]:
    """Hold a fully-async or multi-LoRA run's rollout and training slots for the block (the run's
    length); nothing for other runs, whose tasks take slots one at a time."""
    r = cfg.resources
    with _hold(r.pool, r.rollout_slots + r.train_slots if holds_run_slots(cfg) else 0):
        yield


def slots_needed(cfg: RunConfig) -> int:
    """The most slots the run holds at once: a fully-async or multi-LoRA run's reservation (plus an
    evaluation on its separate engine, which the trainer may wait for); otherwise its largest task."""
    r = cfg.resources
    if holds_run_slots(cfg):
        return r.rollout_slots + r.train_slots + (r.eval_slots if _separate_eval(cfg) else 0)
    return max(r.rollout_slots, r.train_slots, r.eval_slots if _separate_eval(cfg) else 0)


def check_device_pool(cfg: RunConfig) -> None:
    """Fail before any work when the pool does not exist, or is too small for what this run holds
    at once (``slots_needed``), which would wait forever."""
    r = cfg.resources
    if r.pool is None:
        return
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(r.pool).limit
        except ObjectNotFound:
            raise _missing(r.pool) from None
    needed = slots_needed(cfg)
    if limit < needed:
        if holds_run_slots(cfg):
            what = "its rollout and training slots for its whole length"
            what += ", plus an evaluation's on its separate engine" if _separate_eval(cfg) else ""
        else:
            what = "its largest task"
        raise RuntimeError(
            f"resources.pool={r.pool!r} has {limit} slots, but this run needs {needed} at once ({what}); "
            f"it would wait forever: give the pool more slots or the run fewer "
            f"(--rollout-slots, --train-slots, --eval-slots)"
        )
