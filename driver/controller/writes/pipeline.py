"""The bounded pool of writer threads behind the decider (decisions never wait for writes).

The decider hands each gang's writes over as one job; a job runs on one writer thread, so a gang's
writes keep their order (finalizer -> allocation -> gate) while different gangs are written side by
side. The queue is bounded: when the writers fall behind, ``submit`` blocks the decider (back
pressure) instead of assuming ever more. Each writer thread has its own ``ApiClient``, its own
``ApiWriter`` (every write checks the shared fence: leader fencing holds for every write in flight)
and its own ``EventRecorder``.

A job raising ``HaltWrites`` (the fence is set, or a test's simulated crash) stops the whole
controller as a killed process would stop: ``on_halt`` sets the fence, so no other writer writes
either.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes import client

from driver.controller.writes.events import EventMemory, EventRecorder
from driver.controller.writes.writer import ApiWriter, HaltWrites, WriteHook
from driver.kube import new_api_client

__all__ = ["Job", "WritePool", "Writers"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Writers:
    """What a job may write with: the writer thread's own writer and recorder."""

    writer: ApiWriter
    recorder: EventRecorder


Job = Callable[[Writers], None]


class WritePool:
    def __init__(
        self,
        *,
        configuration: client.Configuration,
        workers: int,
        capacity: int,
        identity: str,
        fence: threading.Event,
        hook: WriteHook | None,
        on_halt: Callable[[], None],
    ) -> None:
        self._configuration = configuration
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=capacity)
        self._identity = identity
        self._fence = fence
        self._hook = hook
        self._on_halt = on_halt
        self._threads = [
            threading.Thread(target=self._run, name=f"writer-{index}", daemon=True)
            for index in range(workers)
        ]
        self._idle = threading.Condition()
        self._pending = 0
        self._memory = EventMemory()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job, stop: threading.Event) -> bool:
        """Queue ``job``; blocks while the queue is full. False when ``stop`` was set first."""
        with self._idle:
            self._pending += 1
        while not stop.is_set():
            try:
                self._jobs.put(job, timeout=0.1)
                return True
            except queue.Full:
                continue
        self._finished()
        return False

    def wait_idle(self, timeout_seconds: float) -> bool:
        """True once every submitted job has finished (tests, and a clean stop)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_seconds)

    @property
    def pending(self) -> int:
        with self._idle:
            return self._pending

    def stop(self, timeout_seconds: float) -> None:
        """One stop mark per writer, after the jobs queued (they are sent first), all within
        ``timeout_seconds`` in all. A full queue (writers slowed by the client rate limit) takes
        its marks as it drains; once the time is up, what is left is abandoned with the threads
        (daemons), never waited for thread by thread."""
        deadline = time.monotonic() + timeout_seconds
        for _ in self._threads:
            try:
                self._jobs.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                break
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def _finished(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _run(self) -> None:
        api_client = new_api_client(self._configuration)
        writers = Writers(
            writer=ApiWriter(api_client, hook=self._hook, fence=self._fence),
            recorder=EventRecorder(
                api_client, identity=self._identity, memory=self._memory, fence=self._fence
            ),
        )
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    job(writers)
                except HaltWrites:
                    log.warning("writes halted (leadership lost, or a test's simulated crash)")
                    self._on_halt()
                except Exception:  # a bug in a job: log it once; the writer keeps serving the others
                    log.exception("write job failed")
                finally:
                    self._finished()
        finally:
            writers.writer.close()
            api_client.close()  # type: ignore[no-untyped-call]
