"""Device slots for tasks: ``device_slots(cfg, phase)`` holds ``cfg.resources.<phase>_slots`` slots
of the Prefect global concurrency limit ``cfg.resources.pool`` for the block (nothing when no pool
is set, or the phase takes no slots). Every run on the same Prefect server draws from the same
limit, so together they never use more devices than it holds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

from miles_core.config import RunConfig

Phase = Literal["rollout", "train", "eval"]


@contextlib.contextmanager
def device_slots(cfg: RunConfig, phase: Phase) -> Iterator[None]:
    pool = cfg.resources.pool
    occupy = getattr(cfg.resources, f"{phase}_slots")
    if pool is None or occupy == 0:
        yield
        return
    from prefect.concurrency.sync import concurrency
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(concurrency(pool, occupy=occupy, strict=True))
        except ConcurrencySlotAcquisitionError as e:
            raise RuntimeError(
                f"resources.pool={pool!r}: this Prefect server has no global concurrency limit of that name ({e}); "
                f"create it with `miles serve --device-slots {pool}=N` or "
                f"`prefect global-concurrency-limit create {pool} --limit N`"
            ) from None
        yield


def check_device_pool(cfg: RunConfig) -> None:
    """Fail before any work when the pool does not exist, or is too small for what this run holds
    at once (a fully-async or multi-LoRA run: its producer's rollout slots plus a training step's;
    otherwise the largest single phase), which would wait forever."""
    r = cfg.resources
    if r.pool is None:
        return
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(r.pool).limit
        except ObjectNotFound:
            raise RuntimeError(
                f"resources.pool={r.pool!r}: this Prefect server has no global concurrency limit of that name; "
                f"create it with `miles serve --device-slots {r.pool}=N` or "
                f"`prefect global-concurrency-limit create {r.pool} --limit N`"
            ) from None
    holds_producer = cfg.mode == "fully_async" or cfg.multi_lora is not None
    needed = r.rollout_slots + r.train_slots if holds_producer else max(r.rollout_slots, r.train_slots, r.eval_slots)
    if limit < needed:
        what = "its producer's rollout slots plus a training step's" if holds_producer else "its largest phase"
        raise RuntimeError(
            f"resources.pool={r.pool!r} has {limit} slots, but this run needs {needed} at once ({what}); "
            f"it would wait forever: give the pool more slots or the run fewer (--rollout-slots, --train-slots)"
        )
