"""The Python API, as ``import miles``: start runs, follow them, evaluate them.

```python
import miles

run = miles.start_run("configs/toy.toml")    # a RunConfig, a dict or a TOML path (as the CLI)
summary = run.wait()
miles.evaluate(run, datasets=[{"name": "gsm8k", "data": {"type": "file", "path": "..."}}])
```

The names come from ``deployments.api`` (the layer that talks to Prefect; ``miles_core`` has no
Prefect in it); see its docstring for the whole of it.
"""

from deployments.api import RunFailed, RunHandle, evaluate, get_run, start_run

__all__ = ["RunFailed", "RunHandle", "evaluate", "get_run", "start_run"]
