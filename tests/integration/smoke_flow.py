"""A flow with nothing to it, for deployment tests of the server itself (test_server.py)."""

from prefect import flow


@flow(name="server-smoke-deployed")
def smoke(x: int = 3) -> int:
    return 2 * x + 1
