"""Ways to start runs: the ``miles`` CLI, the Python API, deployments and servers."""

import flows  # noqa: F401  (applies the Prefect settings a run gets: flows/prefect_defaults.py)
