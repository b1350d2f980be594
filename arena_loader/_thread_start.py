"""Starting our threads (the pin or device stage's, a thread worker's) so that a Ctrl-C
inside ``Thread.start()`` leaves none half-started.

``Thread.start()`` first enters the thread in threading's table of threads being started
(``threading.enumerate()`` lists it from then on), then makes the OS thread, whose first step
takes it out of that table. A KeyboardInterrupt between the two (CPython runs the handler as
the table's lock is released) left it there for good, and with it its target and arguments:
the pin thread's stage with its first batch (that batch's slot, and so the slab, mapped until
exit), a thread worker's order ring. Nothing public takes a thread out of the table but
running it, so a thread whose start was cut short before it began is run, told to do nothing.
"""

from __future__ import annotations

import threading
import time

# How long a thread whose start() a Ctrl-C cut short gets to show it began (``began``).
BEGIN_WAIT_S = 1.0


class Thread(threading.Thread):
    """A thread that ``start`` may call off: then ``run`` does nothing."""

    called_off = False

    def run(self) -> None:
        if not self.called_off:
            super().run()


def start(thread: Thread) -> None:
    """``thread.start()``; interrupted before the thread began, the thread is called off (and
    run, which ends it at once) before the interrupt goes on: start a new one next time."""
    try:
        thread.start()
    except BaseException:
        if not began(thread):
            thread.called_off = True
            thread.start()
        raise


def began(thread: threading.Thread) -> bool:
    """Whether ``thread.start()`` began the thread. A Ctrl-C can cut it short before, or in
    its wait for the new thread, which then sets its ident in a moment (it stays in
    ``threading.enumerate()`` from the start's first step): it is given that moment."""
    deadline = time.monotonic() + BEGIN_WAIT_S
    while thread.ident is None:
        if thread not in threading.enumerate() or time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
