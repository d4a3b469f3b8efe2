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
