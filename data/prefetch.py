"""Batches prepared ahead in a background thread, so that the training step never waits on data.

PrefetchLoader wraps any step loader (next_batch / state_dict / load_state_dict): a daemon thread calls the
inner loader's next_batch() up to `depth` batches ahead and records the inner state_dict() after each one.
The wrapper's state_dict() is the state after the last batch the TRAINER took, not after the prefetched ones,
so checkpoints and resume are exactly those of the inner loader. load_state_dict() stops the thread, loads the
inner loader and lets the next next_batch() start a fresh thread from the loaded position.

An exception in the thread (a data error, a finite loader's StopIteration) is raised by the next_batch() that
would have returned that batch. wait_seconds sums the time next_batch() blocked: the data time of the step.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time

# Every prefetch thread started, with its stop event (the thread outlives a dropped wrapper by up to one
# batch). At interpreter exit they are stopped and joined before the runtime is torn down: a daemon thread
# caught inside a torch op at that moment aborts the process ("terminate called without an active exception").
_THREADS: dict[threading.Thread, threading.Event] = {}


@atexit.register
def _stop_threads() -> None:
    for thread, stop in list(_THREADS.items()):
        stop.set()
        thread.join(timeout=60)  # a batch is milliseconds; only a hung read (a stalled stream) waits this long


class PrefetchLoader:
    def __init__(self, loader, depth: int = 2):
        if depth < 1:
            raise ValueError(f"training.prefetch_batches={depth}: the wrapper needs >= 1 (0 = no prefetching)")
        self.loader, self.depth = loader, depth
        self._state = loader.state_dict()
        self._thread: threading.Thread | None = None
        self.wait_seconds, self.batches = 0.0, 0

    def _start(self) -> None:
        self._queue: queue.Queue = queue.Queue(self.depth)
        self._stop = threading.Event()
        # The thread holds the inner loader, not this wrapper, so that dropping the wrapper stops it (__del__).
        self._thread = threading.Thread(
            target=self._work, args=(self.loader, self._queue, self._stop), daemon=True, name="data-prefetch"
        )
        _THREADS[self._thread] = self._stop
        self._thread.start()

    @staticmethod
    def _work(loader, out: queue.Queue, stop: threading.Event) -> None:
        try:
            PrefetchLoader._produce(loader, out, stop)
        finally:
            _THREADS.pop(threading.current_thread(), None)

    @staticmethod
    def _produce(loader, out: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = (loader.next_batch(), loader.state_dict(), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                item = (None, None, e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def next_batch(self):
        if self._thread is None:
            self._start()
        started = time.perf_counter()
        batch, state, error = self._queue.get()
        self.wait_seconds += time.perf_counter() - started
        if error is not None:
            self._thread.join()
            self._thread = None  # a later call retries from the inner loader's position
            raise error
        self._state = state
        self.batches += 1
        return batch

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is building). The next next_batch() would restart it,
        but from the inner loader's position, which may be ahead: call load_state_dict(state_dict()) first."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __del__(self):
        if self.__dict__.get("_thread") is not None:
            self._stop.set()  # no join: the thread ends within its put timeout

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state_dict: dict) -> None:
        self.close()
        self.loader.load_state_dict(state_dict)
        self._state = self.loader.state_dict()

    def reset(self) -> None:
        self.close()
        self.loader.reset()
        self._state = self.loader.state_dict()

    def __getattr__(self, name):  # rows_per_rank, seq_len, ... of the inner loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
