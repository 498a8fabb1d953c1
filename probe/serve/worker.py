"""One worker thread for all model work (hooks belong to one model). A job its caller gave up on never starts; one
past its deadline gets `JobTimeout` at the next module call from a global forward pre-hook, inside the library's
context managers, which restore the model as on any error."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch


class JobTimeout(Exception):
    """A job ran past its deadline."""


class Worker:
    """A queue of jobs and the one thread that runs them."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Future, Callable[[], Any], float] | None] = queue.Queue()
        self._deadline = float("inf")
        self._thread = threading.Thread(target=self._run, name="probe-serve-worker", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], Any], seconds: float) -> Future:
        """Queue `work`; its future ends in `JobTimeout` `seconds` after submission."""
        future: Future = Future()
        self._jobs.put((future, work, time.monotonic() + seconds))
        return future

    def close(self) -> None:
        """Stop the thread after the jobs queued so far."""
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _check(self, _module: torch.nn.Module, _args: Any) -> None:
        if threading.current_thread() is self._thread and time.monotonic() > self._deadline:
            raise JobTimeout("the request took longer than its time limit")

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, work, deadline = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued: never started
            if time.monotonic() > deadline:
                future.set_exception(JobTimeout("the request waited in the queue past its time limit"))
                continue
            self._deadline = deadline
            handle = torch.nn.modules.module.register_module_forward_pre_hook(self._check)
            try:
                result, error = work(), None
            except BaseException as failure:  # handed to the caller, who answers it; the worker lives on
                result, error = None, failure
            handle.remove()  # before the caller hears: then nothing of the job is left
            self._deadline = float("inf")
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
