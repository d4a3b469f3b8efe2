"""Ways to start runs: the ``miles`` CLI, the Python API, deployments and servers."""

from flows import prefect_defaults

prefect_defaults.apply()
