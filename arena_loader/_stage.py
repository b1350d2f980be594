"""A thread between the host iterator and the consumer: it takes each host batch as soon as
the host's read-ahead has it, works on it while the training step runs, and queues the result
for ``next()`` (docs/design.md, "Stages"). Two stages use it: the device stage copies each
slot to the GPU (``_device.stage``), the pin stage copies a batch's tensors into page-locked
memory (``_pin_stage``), as torch's pin-memory thread does.

``HostStage`` is what both share: the thread's start with the batch the consumer's first
``next()`` took (so that batch's errors, and whatever the host does at its first batch,
belong to that ``next()``), the host's errors and its end handed on in order, a bounded queue,
and a ``close()`` that stops and joins the thread. ``StagedIterator`` is what ``iter()``
returns; ``Stager`` makes one per host iterator and stops the one still reading a persistent
host iterator before the next epoch starts on it.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from . import _forksafe, _thread_start
from ._inprocess import InProcessIterator
from ._iterator_length import LoaderLength
from ._messages import add_note, formatted, fresh_copy
from .errors import LoaderClosedError, forked_iterator_error

# The longest sleep of either side between checks that the other is alive or closed.
POLL_S = 0.5
# How long close() lets the thread finish the batch it is waiting for before closing the host
# iterator under it: short when that iterator is ours to close, long when it is a persistent
# one (closing it costs the workers) or runs user code in this process.
OWNED_JOIN_S = 0.5
SHARED_JOIN_S = 10.0


@dataclass(frozen=True, eq=False)
class Raised:
    """The host iterator (or the stage's work) raised ``error`` for a batch; ``fatal``: every
    later ``next()`` raises it again."""

    error: BaseException
    fatal: bool
    position: Any = None  # the epoch position as of this batch (state_dict), if tracked


@dataclass(frozen=True, eq=False)
class Ended:
    """The host iterator's epoch ended."""

    position: Any = None


class HostStage:
    """The state the stage's thread and the consumer share; the thread references only this,
    so an abandoned ``StagedIterator`` is collected and its finalizer closes the stage.
    Subclasses give the thread's loop (``_work``) and the consumer's ``next_batch``."""

    thread_name = "arena_loader-stage"

    def __init__(self, host: Iterator, owns_host: bool, depth: int,
                 positions: tuple[Callable[[], Any], Callable[[Any], None]] | None = None):
        self._host = host
        self._owns_host = owns_host
        self._depth = depth  # results queued for the consumer, at most
        # The thread takes batches ahead of the consumer: (track, follow) from
        # LoaderResume.follower, so that state_dict() counts what the consumer received.
        self._track, self._follow = positions if positions is not None else (None, None)
        self._cv = threading.Condition()
        self._ready: deque[Any] = deque()
        self._stop = False
        self._closed = False
        self._finished = False
        self._thread: threading.Thread | None = None
        self._started = False  # start() returned: the thread began
        self._first: Any = None
        self._first_error: Exception | None = None  # what the first batch raised, if it did
        # What the thread holds ahead of the consumer counts against the host's read-ahead,
        # as torch's pin thread's does: the host refills as the consumer receives each batch.
        self._lag = host.follow_stage() if positions is not None else None
        # One start: two threads' first next() took a first batch each, and one was lost.
        self._starting = threading.Lock()
        # One next() at a time (held by the subclass's next_batch): two threads' next() could
        # both take the first queued result before either removed it, and both hand it out.
        self._consumer_lock = threading.Lock()

    # -- the thread -----------------------------------------------------------------------

    def start(self) -> None:
        """Take the first batch from the host iterator here, in the consumer's thread, so
        that whatever the host does at its first next() (claim the arena, pin the slab)
        happens here and its errors are this next()'s; then start the thread with it (unless
        another thread's next() did meanwhile)."""
        with self._starting:
            thread = self._thread
            if thread is None:
                if self._first is None and self._first_error is None:
                    # Kept in an attribute (stored once next() returns, in the same line: a
                    # Ctrl-C later leaves it for the next next()), not as a thread argument:
                    # Thread keeps its arguments until run() returns, which would hold the
                    # slot all epoch.
                    # Its error kept on the handler's line: no call comes before it (a
                    # Ctrl-C is handled at a call), so none can lose it.
                    try:
                        self._first = next(self._host)
                    except Exception as exc: self._first_error = exc  # noqa: E701
                if self._first_error is not None:
                    # The first batch's error (or the end) goes to the thread as its first
                    # result, and next() raises it as one the thread handed on: counted as
                    # received (no longer against the read-ahead) in a next() that a Ctrl-C
                    # may repeat. (Raised in this frame, an interrupt before it was counted
                    # lost it, and kept the window full.) Made again if cut short here.
                    self._first = self._result_of(self._first_error)
                    self._first_error = None
                thread = _thread_start.Thread(target=self._run, daemon=True,
                                              name=self.thread_name)
                with self._cv:
                    if self._closed:
                        self._first = None
                        raise LoaderClosedError(
                            "this iterator was closed; call iter(loader) for a new one")
                    self._thread = thread
            if not _thread_start.began(thread):  # (a Ctrl-C before the last start() began it)
                try:
                    _thread_start.start(thread)
                except BaseException:  # (called off: the next start() makes another thread)
                    if thread.called_off:
                        self._thread = None
                    raise
            self._started = True

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # the stage itself failed: the consumer raises it
            # (each next() raises a copy, without this thread's frames: its text goes along)
            add_note(exc, f"Raised in the {self.thread_name} thread:\n{formatted(exc)}")
            self._publish(Raised(exc, fatal=True))  # raised by every next() from now on

    def _work(self) -> None:
        raise NotImplementedError

    def _next_host(self) -> Any:
        """The host iterator's next batch, ``Raised`` or ``Ended`` (with the position as of
        it); None when stopping."""
        try:
            item = next(self._host)
        except BaseException as exc:
            if self._stop and not isinstance(exc, StopIteration):
                return None
            return self._result_of(exc)
        if self._stop:
            return None
        return item

    def _result_of(self, error: BaseException) -> Raised | Ended:
        """What the consumer gets for a host ``next()`` that raised ``error``."""
        if isinstance(error, StopIteration):
            return Ended(self._position())
        return Raised(error, bool(getattr(self._host, "broken", False)), self._position())

    def _position(self) -> Any:
        """The host's epoch position now, for the result of the batch it just gave (None:
        not tracked)."""
        return self._track() if self._track is not None else None

    def _publish(self, item: Any) -> bool:
        """Queue ``item`` for the consumer, waiting for room; False when stopping."""
        with self._cv:
            while len(self._ready) >= self._depth and not self._stop:
                self._cv.wait(POLL_S)
            if self._stop:
                return False
            self._ready.append(item)
            self._cv.notify_all()
            return True

    def _remove(self, item: Any) -> Any:
        """``item``, the first result, taken off the queue: ``next()``'s last line, so that an
        interrupt before it leaves the result for the next ``next()``."""
        with self._cv:
            self._cv.notify_all()  # room for the thread's next result
            if not self._ready or self._ready[0] is not item:
                return item  # (an Ended made by _wait_more after close)
            return self._ready.popleft()

    def _wait_taken(self, item: Any) -> None:
        """Until the consumer took ``item`` (an error: the next batch is loaded once the
        error is seen, as without the stage)."""
        with self._cv:
            while item in self._ready and not self._stop:
                self._cv.wait(POLL_S)

    # -- the consumer ---------------------------------------------------------------------

    def _received(self, item: Any) -> None:
        """The consumer has ``item``: its position is the loader's (``state_dict()``). The
        same again if the ``next()`` is cut short and repeated."""
        position, lag = item.position, self._lag
        if lag is not None:
            lag.asked_at = None  # (its next() waits no more: the host's timeout stops)
        if position is not None:
            self._follow(position)
            if lag is not None:
                lag.receive(position.yielded)
                self._host.refill()

    def _hand_on(self, item: Raised | Ended) -> NoReturn:
        """``next()``'s end for a result that is no batch: the error raised (a fatal one
        kept, raised by every later ``next()``), or the epoch's end."""
        if isinstance(item, Raised):
            if item.fatal:
                # A copy: raised, the kept object would get a traceback through this frame,
                # and so hold the iterator, which the finalizer (holding this stage) keeps.
                raise fresh_copy(item.error)
            raise self._remove(item).error
        self._finished = True
        self.close()
        raise StopIteration

    @property
    def awaits_first(self) -> bool:
        """Neither started nor closed: ``start`` may be called."""
        return not self._started and not self._closed

    def _first_queued(self, before_look: Callable[[], None] | None = None) -> Any:
        """With ``_cv`` held: the first result, waited for and left queued until ``_remove``
        (an interrupt before then leaves it for the next ``next()``); ``before_look`` runs
        before each look at the queue."""
        while True:
            if before_look is not None:
                before_look()
            if self._ready:
                return self._ready[0]
            ended = self._wait_more()
            if ended is not None:
                return ended

    def _wait_more(self) -> Ended | None:
        """With ``_cv`` held and nothing queued: wait a while. ``Ended`` once the epoch was
        finished and the stage closed; LoaderClosedError if closed before; RuntimeError if
        the thread died without a word. (A wait can time out as the thread's notify crosses
        it, and the thread can end before this looks: its last result is queued then.)"""
        if self._closed:
            if self._finished:
                return Ended()
            raise LoaderClosedError("this iterator was closed; call iter(loader) for a new one")
        if not self._cv.wait(POLL_S) and not self._ready and not self._thread.is_alive():
            raise RuntimeError(f"the {self.thread_name} thread stopped unexpectedly")
        return None

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Stops and joins the thread; closes the host iterator if this stage owns it (or if
        the thread is stuck in it). Safe from a finalizer. No early return: every step may
        be redone, so a call that Ctrl-C cut short is finished by the next."""
        with self._cv:
            self._closed = self._stop = True
            self._cv.notify_all()
            thread = self._thread
        if self._lag is not None:
            self._lag.stop()  # (a thread waiting for the room its consumer makes stops too)
        if thread is not None and not _thread_start.began(thread):
            thread = None  # a Ctrl-C cut start() short before it began: nothing to stop
        if thread is not None and thread is not threading.current_thread():
            # A multi-process host iterator it owns is closed soon; one that runs user code in
            # this process, or a persistent one, is given time to finish its batch.
            quick = self._owns_host and not isinstance(self._host, InProcessIterator)
            thread.join(OWNED_JOIN_S if quick else SHARED_JOIN_S)
            if self._owns_host or thread.is_alive():
                self._before_host_close()
                self._host.close()
            thread.join(SHARED_JOIN_S)
        elif self._owns_host:
            self._host.close()
        with self._cv:
            self._ready.clear()  # results never taken go, and what they hold with them

    def _before_host_close(self) -> None:
        """Called from ``close()`` while the thread may still be at work: what must finish
        before the host iterator (which may unpin its slab) is closed."""


class StagedIterator(LoaderLength):
    """What ``iter(loader)`` returns with a stage: the stage's results, in order."""

    def __init__(self, owner: Any, stage: HostStage):
        self._owner = owner  # the loader: `for b in ArenaLoader(...)` must keep it alive
        self._stage = stage  # (which holds the host iterator)
        self._pid, self._generation = os.getpid(), _forksafe.generation()
        self._finalizer = weakref.finalize(self, stage.close)

    def __iter__(self) -> StagedIterator:
        return self

    def __next__(self) -> Any:
        if _forksafe.generation() != self._generation:  # its thread is the parent's
            raise forked_iterator_error(self._pid)
        stage, lag = self._stage, self._stage._lag
        try:
            if lag is not None:  # the host's timeout runs from here (StageLag.asked_at)
                lag.asked_at = time.monotonic()
            if stage.awaits_first:
                stage.start()  # with the host's first batch, taken in this thread
            return stage.next_batch()  # type: ignore[attr-defined]
        except KeyboardInterrupt:  # nobody waits now: nothing is timed until the next next()
            if lag is not None:  # (a batch or an error ends the wait in _received)
                lag.asked_at = None
            raise

    def close(self) -> None:
        self._stage.close()  # (not the finalizer, which runs once: see HostStage.close)


_ANY_HOST = object()  # Stager.detach: whatever host the staged iterator reads


class Stager:
    """A loader's stage: a ``StagedIterator`` around each host iterator (``make``)."""

    def __init__(self) -> None:
        self._shared: weakref.ref | None = None  # the iterator reading a persistent host one

    def make(self, host: Iterator, owns_host: bool, positions: Any) -> HostStage:
        raise NotImplementedError

    def wrap(self, owner: Any, host: Iterator, owns_host: bool,
             positions: Any = None) -> StagedIterator:
        """``owns_host``: close ``host`` with the staged iterator (it is not persistent).
        ``positions``: ``LoaderResume.follower``'s pair, for a stage that keeps the
        consumer's epoch position."""
        iterator = StagedIterator(owner, self.make(host, owns_host, positions))
        if not owns_host:
            self._shared = weakref.ref(iterator)
        return iterator

    def detach(self, host: Any = _ANY_HOST) -> None:
        """Stop the staged iterator still reading the persistent host iterator (an abandoned
        epoch) before that one starts a new epoch: ``host``'s only, if given. One reading a
        host that load_state_dict() let go goes on to its epoch's end, as without a stage."""
        previous = self._shared() if self._shared is not None else None
        if previous is None or (host is not _ANY_HOST and previous._stage._host is not host):
            return
        self._shared = None
        previous.close()
