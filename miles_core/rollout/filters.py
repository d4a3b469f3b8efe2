"""Dynamic-sampling filters: which finished, scored groups are worth training on.

A filter is ``(group) -> bool`` (True keeps the group). ``AsyncConfig.dynamic_filters`` names them:
a built-in name below or ``"module:function"``. ``GroupFilters`` applies them in order and counts
what each one dropped, so a run reports how much generation its filters threw away.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from miles_core.types import Group, SampleStatus

GroupFilter = Callable[[Group], bool]


def nonzero_reward_std(group: Group) -> bool:
    """Keep groups whose rewards are not all equal: a group where every sample scored the same has
    zero GRPO advantage everywhere and teaches nothing (DAPO's dynamic sampling)."""
    rewards = {s.reward for s in group.samples if s.reward is not None}
    return len(rewards) > 1


def not_all_failed(group: Group) -> bool:
    """Keep groups with at least one sample that did not fail."""
    return any(s.status is not SampleStatus.FAILED for s in group.samples)


BUILTIN: dict[str, GroupFilter] = {"nonzero_reward_std": nonzero_reward_std, "not_all_failed": not_all_failed}


class GroupFilters:
    """The filters named in the config, applied in order; ``dropped`` counts drops per filter."""

    def __init__(self, names: Sequence[str]) -> None:
        from miles_core.plugins import load_object

        self.filters: list[tuple[str, GroupFilter]] = []
        for name in names:
            if name in BUILTIN:
                self.filters.append((name, BUILTIN[name]))
            elif ":" in name:
                self.filters.append((name, load_object(name, "dynamic filter")))
            else:
                raise ValueError(
                    f"unknown dynamic filter {name!r}; use one of {sorted(BUILTIN)} or 'package.module:function'"
                )
        self.dropped: Counter[str] = Counter()

    def keep(self, group: Group) -> bool:
        """True when every filter keeps the group; a drop is counted against the first that said no."""
        return self.rejected_by(group) is None

    def rejected_by(self, group: Group) -> str | None:
        """The first filter that drops the group (counted), or None when every filter keeps it."""
        for name, fn in self.filters:
            if not fn(group):
                self.dropped[name] += 1
                return name
        return None
