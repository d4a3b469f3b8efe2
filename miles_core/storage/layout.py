"""Where a run's files live: the one place that names them.

```
<root>/<name>/<run_id>/
  config.json                      the run config (public part, no storage options)
  samples/<producer>/<seq>.arrow   SampleStream segments; samples/<producer>/_END closes a stream
  cursors/<producer>/<reader>.json durable read cursors (one per reader of each stream)
  weights/v<version>/              WeightStore snapshots; weights/LATEST
  metrics.jsonl  eval.jsonl  summary.json
```

``SampleStream`` and ``WeightStore`` take a run folder or weights folder URL and use the
relative-path helpers below, so they agree with ``RunLayout`` without depending on it.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime, timezone
from typing import Any

from miles_core.storage.fs import atomic_write, join, open_fs, read_bytes, to_url

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def check_name(kind: str, name: str) -> str:
    """A producer, reader or run name becomes a path part: no separators, no leading dot."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use letters, digits, '_', '-', '.' (not first), no '/'"
        )
    return name


def samples_dir(producer: str) -> str:
    return f"samples/{check_name('producer', producer)}"


def cursor_file(producer: str, reader: str) -> str:
    # Cursors are per stream: a reader called "trainer" of "rollout" and of "eval" are distinct.
    return f"cursors/{check_name('producer', producer)}/{check_name('reader', reader)}.json"


def new_run_id() -> str:
    """A fresh run id that sorts by creation time (UTC), e.g. ``20261130-141502-ab12``."""
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


class RunLayout:
    """The URLs of one run's files. Builds paths only; creates nothing."""

    def __init__(self, root_url: str, name: str, run_id: str, storage_options: dict[str, Any] | None = None):
        self.fs, root = open_fs(root_url, storage_options)
        self.name = check_name("run", name)
        self.run_id = check_name("run id", run_id)
        self.path = join(root, name, run_id)
        """The run folder as a path inside ``self.fs``."""

    def url(self, *parts: str) -> str:
        """URL (plain path for local files) of ``parts`` under the run folder."""
        return to_url(self.fs, join(self.path, *parts))

    @property
    def run_dir(self) -> str:
        return self.url()

    @property
    def config(self) -> str:
        return self.url("config.json")

    def samples(self, producer: str = "rollout") -> str:
        return self.url(samples_dir(producer))

    def cursor(self, reader: str, producer: str = "rollout") -> str:
        return self.url(cursor_file(producer, reader))

    @property
    def weights(self) -> str:
        return self.url("weights")

    @property
    def metrics(self) -> str:
        return self.url("metrics.jsonl")

    @property
    def eval(self) -> str:
        return self.url("eval.jsonl")

    @property
    def summary(self) -> str:
        return self.url("summary.json")

    def write_json(self, rel: str, obj: Any) -> str:
        """Replace the JSON file ``rel`` under the run folder atomically; returns its URL."""
        atomic_write(self.fs, join(self.path, rel), json.dumps(obj, indent=2, sort_keys=True).encode())
        return self.url(rel)

    def read_json(self, rel: str) -> Any | None:
        """The JSON file ``rel`` under the run folder, or None when it does not exist."""
        data = read_bytes(self.fs, join(self.path, rel))
        return None if data is None else json.loads(data)

    def write_jsonl(self, rel: str, rows: list[dict[str, Any]]) -> str:
        """Replace the JSON-lines file ``rel`` (object stores cannot append, so the whole file)."""
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
        atomic_write(self.fs, join(self.path, rel), data)
        return self.url(rel)

    def __repr__(self) -> str:
        return f"RunLayout({self.run_dir!r})"
