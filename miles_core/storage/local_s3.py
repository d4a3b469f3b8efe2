"""A local S3 endpoint for tests and benchmarks: moto's server over HTTP on 127.0.0.1.

``LocalS3`` starts ``moto_server`` in a subprocess on a free loopback port, waits until it answers,
and gives the fsspec ``storage_options`` that reach it. ``restart()`` stops and starts it on the same
port (state is lost, as with a real endpoint outage and a fresh bucket). Needs ``moto[server]``
(the ``dev`` extra). Nothing here is used by a training run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

from miles_core import processes


class LocalS3:
    def __init__(self, port: int | None = None, start_timeout: float = 30.0) -> None:
        self.port = port or processes.free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this endpoint (dummy credentials; caches off for pollers)."""
        return {
            "endpoint_url": self.endpoint,
            "key": "testing",
            "secret": "testing",
            "use_listings_cache": False,
            "skip_instance_cache": True,
        }

    def start(self) -> LocalS3:
        exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
        if exe is None:
            raise RuntimeError("moto_server not found: install the dev extra (pip install 'moto[server]')")
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        self._proc = proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)],
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            processes.wait_ready(lambda: processes.http_status(self.endpoint + "/moto-api/", timeout=1) == 200,
                                 what="moto_server", probe=f"{self.endpoint}/moto-api/", timeout_s=self.start_timeout,
                                 ended=lambda: processes.ended(proc),
                                 tail=lambda: f"its output is not kept: run {exe} -H 127.0.0.1 -p {self.port} to see it")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._proc is not None:
            processes.terminate(self._proc, 10)
        self._proc = None

    def restart(self, downtime: float = 0.0) -> None:
        self.stop()
        time.sleep(downtime)
        self.start()

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; returns ``s3://name``."""
        import s3fs

        fs = s3fs.S3FileSystem(**self.storage_options)
        fs.mkdir(name)
        return f"s3://{name}"

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
