"""Quiet by default: a run prints its own lines (one per step, one per evaluation), not its
libraries' progress bars, deprecation notices and start-up banners.

``quiet_environment(env)`` fills what the environment leaves unset, before torch, transformers or
DeepSpeed is imported, and every child process (engine servers, producers, trainer ranks)
inherits it:

- no progress bars (``HF_HUB_DISABLE_PROGRESS_BARS``; transformers' "Loading weights" bar follows it);
- transformers logs errors only (``TRANSFORMERS_VERBOSITY``);
- ``FutureWarning`` and ``DeprecationWarning`` are not shown (``PYTHONWARNINGS``): they speak to
  whoever maintains the code, not to whoever runs it;
- on a machine with no accelerator device node, DeepSpeed is told it runs on CPU
  (``DS_ACCELERATOR=cpu``) instead of detecting it and saying so on every command.

``miles ... --verbose`` skips all of it. Never applied by importing the library: the ``miles``
command applies it, and a Python user may call it.
"""

from __future__ import annotations

import glob
import os
from collections.abc import MutableMapping

QUIET = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
}
ACCELERATOR_NODES = ("/dev/nvidia*", "/dev/kfd", "/dev/dri", "/dev/accel*", "/dev/davinci*", "/dev/neuron*")
"""Device nodes of GPUs and other accelerators (NVIDIA, AMD, Intel, NPUs): with none of them, the machine is a CPU."""


def quiet_environment(env: MutableMapping[str, str] = os.environ) -> None:
    for name, value in QUIET.items():
        env.setdefault(name, value)
    if "DS_ACCELERATOR" not in env and not any(glob.glob(pattern) for pattern in ACCELERATOR_NODES):
        env["DS_ACCELERATOR"] = "cpu"
    if env is os.environ:  # this process's warnings filters were read at start: apply the same here
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
