"""How tests wait for a state instead of sleeping a guessed time: ``wait_for`` polls a condition in
plain code, ``eventually`` in a coroutine (the condition may be a coroutine function); both fail
with what they waited for once the deadline passes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.5) -> Any:
    """``predicate()``'s first truthy value within ``timeout`` seconds, else an AssertionError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def eventually(condition: Callable[[], Any], timeout: float = 30, what: str = "the condition") -> None:
    """Wait until ``condition()`` (a function, or a coroutine function) is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        done = condition()
        if inspect.isawaitable(done):
            done = await done
        if done:
            return
        assert time.monotonic() < deadline, f"not reached within {timeout} s: {what}"
        await asyncio.sleep(0.005)
