"""The threads of ``hybridpar prepare``'s pipeline: a reader thread parses batches of text ahead
(:func:`prefetch`), encoder threads hand them to the tokenizer (:func:`encoded`), and
:class:`BatchChars` sizes the batches from the characters per token seen so far. Also the
progress bar over the input bytes.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from hybridpar.data.readers import Batch
from hybridpar.data.tokenizer import Framing

ENCODERS = 2
_PROGRESS_MIN_BYTES = 32 << 20


class _NoProgress:
    """What ``progress_bar`` returns when no bar is shown (tqdm is then not even imported)."""

    n = 0

    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total_bytes: int, enabled: bool) -> Any:
    """A bar over the input bytes (documents, tokens and tokens/s beside it), for inputs large
    enough to take a while."""
    if not enabled or total_bytes < _PROGRESS_MIN_BYTES:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="hybridpar prepare",
                file=sys.stderr)


_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetch(items: Iterator[Any], depth: int, name: str) -> Iterator[Any]:
    """``items`` produced by a thread, ``depth`` ahead, so that stages overlap (parsing holds the
    GIL, encoding releases it while it runs on all cores); an exception in the thread is raised
    here. Closing this generator stops the thread, and the thread closes ``items``."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for x in items:
                if not put(x):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer
            put(_Failure(e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=run, name=f"hybridpar-prepare-{name}", daemon=True)
    thread.start()
    try:
        while True:
            x = q.get()
            if x is _END:
                return
            if isinstance(x, _Failure):
                raise x.error
            yield x
    finally:
        stop.set()
        thread.join(timeout=10)


def _encode_one(framing: Framing, batch: Batch, dtype: np.dtype) -> tuple[Batch, np.ndarray, list[int]]:
    tokens, starts = framing.encode(batch.texts, batch.flags, dtype)
    batch.texts = []  # not needed any more: free it while the batch waits to be written
    return batch, tokens, starts


def encoded(batches: Iterator[Batch], framing: Framing, dtype: np.dtype,
             workers: int = ENCODERS) -> Iterator[tuple[Batch, np.ndarray, list[int]]]:
    """Encoded batches, in order. ``workers`` threads each encode a batch at the same time: the
    tokenizer's thread pool then takes work from the next batch while the last documents of one
    finish, and framing (which holds the GIL) overlaps encoding (which does not)."""
    import collections
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(workers, thread_name_prefix="hybridpar-prepare-encoder")
    pending: collections.deque = collections.deque()
    try:
        for batch in batches:
            pending.append(pool.submit(_encode_one, framing, batch, dtype))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # stops the reader thread when we stop early


class BatchChars:
    """Characters of text per batch for about ``tokens`` tokens each (None: a fixed size), from
    the characters per token seen so far, within 1/4 to 16 characters per token."""

    def __init__(self, tokens: int | None, first: int) -> None:
        self.tokens, self.chars, self._chars, self._tokens = tokens, first, 0, 0

    def __call__(self) -> int:
        return self.chars

    def observe(self, chars: int, tokens: int) -> None:
        self._chars += chars
        self._tokens += tokens
        if self.tokens and self._tokens:
            per_token = min(max(self._chars / self._tokens, 0.25), 16.0)
            self.chars = max(1, int(self.tokens * per_token))
