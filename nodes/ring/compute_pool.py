"""The node's one compute thread as an Executor: every job timed into the node's spans, and a short job run on
the event loop itself when the thread is idle.

A decode step hands work to the compute thread several times a token (the head's embedding, each window, the
logits); each hand-off wakes a thread and then the loop again, which costs most where nodes share cores. A job
runs inline only when the thread has nothing queued or running (torch work stays on one thread at a time) and
the same kind of job (function, rows) last took under INLINE_S, so the loop never blocks long: a prefill chunk,
a streamed layer or a slow device stays on the thread. Kinds never seen run on the thread first. Only a node that
computes on one torch thread runs jobs inline: with more, the loop's jobs get an OpenMP team of their own beside
the compute thread's, whose workers spin between jobs and take the cores (a 2-thread SmolLM2 node: 16.8 ms a token
on its thread, 30.5 inline). Each job's thread CPU time is a span too (FUNCTION.cpu): where a job's wall time is
more than that, the OS gave its core to something else meanwhile."""

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch

from nodes.ring.spans import Spans

INLINE_S = 0.02  # longest job run on the event loop: pings (5 s) and other streams wait at most this


def rows(args: tuple) -> int:
    """Rows a job works on: tensors' first dimension and ids in lists, one level into lists and tuples."""
    n = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            n += a.shape[0] if a.dim() else 1
        elif isinstance(a, (list, tuple)):
            n += sum(rows(x) if isinstance(x, (list, tuple)) else x.shape[0] if isinstance(x, torch.Tensor)
                     and x.dim() else 1 for x in a)
    return n


class ComputePool(Executor):
    def __init__(self, spans: Spans, inline_s: float = INLINE_S):
        self.spans, self.inline_s = spans, inline_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self._lock = threading.Lock()
        self._busy = 0  # jobs on the thread, queued or running
        self._took: dict[tuple[str, int], float] = {}  # (function, rows) -> seconds its last run took

    def submit(self, fn: Callable, /, *args, **kwargs) -> Future:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        key = (name, rows(args))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            inline = loop is not None and self._busy == 0 and self._took.get(key, self.inline_s) < self.inline_s \
                and torch.get_num_threads() == 1
            self._busy += not inline
        if inline:
            return self._inline(key, fn, args, kwargs)
        return self._on_thread(loop, key, fn, args, kwargs)

    def _inline(self, key: tuple[str, int], fn: Callable, args: tuple, kwargs: dict) -> Future:
        fut: Future = Future()
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the awaiting caller gets it, as from the thread
            fut.set_exception(exc)
        took = self._took[key] = time.perf_counter() - start
        self.spans.add(f"{key[0]}.inline", took)
        self.spans.add(f"{key[0]}.cpu", time.thread_time() - cpu)
        return fut

    def _on_thread(self, loop, key: tuple[str, int], fn: Callable, args: tuple, kwargs: dict) -> Future:
        submitted = time.perf_counter()
        stamps = [0.0, 0.0, 0.0]  # when the thread began and ended the job, and the thread's CPU time in it

        def job():
            stamps[0], cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                stamps[1], stamps[2] = time.perf_counter(), time.thread_time() - cpu
                self._took[key] = stamps[1] - stamps[0]
                with self._lock:
                    self._busy -= 1

        def timed(_):  # on the loop: the hand-off there, the run, and the hand-off back
            name = key[0]
            self.spans.add(f"{name}.wait", stamps[0] - submitted)
            self.spans.add(f"{name}.run", stamps[1] - stamps[0])
            self.spans.add(f"{name}.cpu", stamps[2])
            self.spans.add(f"{name}.back", time.perf_counter() - stamps[1])

        def done(f: Future) -> None:
            if f.cancelled():  # it never ran: its place on the thread is free
                with self._lock:
                    self._busy -= 1
            elif loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(timed, f)

        fut = self._thread.submit(job)
        fut.add_done_callback(done)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._thread.shutdown(wait=wait, cancel_futures=cancel_futures)
