"""s3: the loader consumed in another thread than the one that called ``iter()``:
prefetch_generator's ``BackgroundGenerator`` (and the ``DataLoaderX`` subclass that returns
one from ``__iter__``), a hand-written ``queue.Queue(maxsize=k)`` prefetcher, a CUDA-style
``data_prefetcher`` that calls ``next()`` one ahead and holds two batches, a thread pool
mapping over the batches, and such threads abandoned mid-epoch.

    pip install --target /tmp/trial23-site prefetch-generator
    PYTHONPATH=$PYTHONPATH:/tmp/trial23-site python s3_threads.py [substring]
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch.multiprocessing as tmp
from common import Case, Ctx, main
from prefetch_generator import BackgroundGenerator

_END = object()


class QueuePrefetcher:
    """The background-thread prefetcher people write: a thread fills a bounded queue."""

    def __init__(self, iterable, depth: int = 2):
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._fill, args=(iterable,), daemon=True)
        self.thread.start()

    def _fill(self, iterable) -> None:
        try:
            for item in iterable:
                self.queue.put(item)
        except Exception as e:  # handed to the consumer
            self.queue.put(e)
        self.queue.put(_END)

    def __iter__(self):
        while True:
            item = self.queue.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item


class DataPrefetcher:
    """NVIDIA apex's ``data_prefetcher`` shape (on the CPU: no stream): ``next()`` one ahead,
    so it holds the batch it handed out and the one it preloaded."""

    def __init__(self, loader):
        self.loader = iter(loader)
        self.preload()

    def preload(self) -> None:
        try:
            batch = next(self.loader)
        except StopIteration:
            self.next_input = self.next_target = None
            return
        self.next_input = batch["x"].float()  # .cuda(non_blocking=True) on a GPU
        self.next_target = batch["y"]

    def next(self):
        x, y = self.next_input, self.next_target
        if x is not None:
            self.preload()
        return x, y


def background_generator(ctx: Ctx) -> None:
    loader = ctx.loader()
    for depth in (1, 3):
        for batch in BackgroundGenerator(loader, max_prefetch=depth):
            ctx.got(batch, f"max_prefetch={depth}", keep=True)
    ctx.epoch(loader, "plain epoch after")


def background_abandoned(ctx: Ctx) -> None:
    """A break: the daemon thread stays blocked in ``put()`` holding the loader's iterator."""
    loader = ctx.loader()
    for step, batch in enumerate(BackgroundGenerator(loader, max_prefetch=1)):
        ctx.got(batch, "background")
        if step == 1:
            break
    time.sleep(0.5)  # (its thread blocked in put(): not racing the next iter(), see README)
    ctx.epoch(loader, "next epoch")


def data_loader_x(ctx: Ctx) -> None:
    """``class DataLoaderX(DataLoader)`` whose ``__iter__`` returns
    ``BackgroundGenerator(super().__iter__())``."""
    class LoaderX(ctx.cls):
        def __iter__(self):
            return BackgroundGenerator(super().__iter__())

    loader = ctx.loader(cls=LoaderX)
    ctx.value(len(loader), "len")
    for epoch in range(2):
        ctx.epoch(loader, f"epoch {epoch}")


def queue_prefetcher(ctx: Ctx) -> None:
    loader = ctx.loader()
    for depth in (1, 4):
        for batch in QueuePrefetcher(loader, depth):
            ctx.got(batch, f"depth {depth}", keep=True)
    it = iter(loader)  # iter() here, next() in the filling thread
    ctx.epoch(QueuePrefetcher(it, 2), "iter() in this thread")


def queue_prefetcher_abandoned(ctx: Ctx) -> None:
    loader = ctx.loader()
    prefetcher = QueuePrefetcher(loader, 1)
    for step, batch in enumerate(prefetcher):
        ctx.got(batch, "prefetched")
        if step == 0:
            break
    del prefetcher  # its thread stays blocked in put() with the iterator
    time.sleep(0.5)  # (blocked there: not racing the next iter(), see README)
    ctx.epoch(loader, "next epoch")


def apex_prefetcher(ctx: Ctx) -> None:
    loader = ctx.loader()
    for epoch in range(2):
        prefetcher = DataPrefetcher(loader)
        x, y = prefetcher.next()
        while x is not None:
            ctx.got((x, y), f"epoch {epoch}", keep=True)
            x, y = prefetcher.next()
    ctx.check("after")


def iter_here_next_there(ctx: Ctx) -> None:
    loader = ctx.loader()
    it = iter(loader)
    got: list = []
    thread = threading.Thread(target=lambda: got.extend(it))
    thread.start()
    thread.join(30)
    ctx.epoch(got, "thread", keep=True)
    halves = iter(loader)
    ctx.got(next(halves), "main")
    worker = threading.Thread(target=lambda: got.append(next(halves)))
    worker.start()
    worker.join(30)
    ctx.got(got[-1], "thread")
    ctx.got(next(halves), "main again")


def thread_pool_map(ctx: Ctx) -> None:
    loader = ctx.loader()
    with ThreadPoolExecutor(2) as pool:
        for total in pool.map(lambda b: float(b["x"].sum()), loader):
            ctx.value(total, "sum")
        futures = [pool.submit(lambda b: b["y"] * 2, batch) for batch in loader]
        for future in futures:
            ctx.got(future.result(), "doubled")


def asyncio_to_thread(ctx: Ctx) -> None:
    """An async training loop: ``await asyncio.to_thread(next, it, None)`` per batch, so each
    ``next()`` runs in the default executor's threads."""
    loader = ctx.loader()

    async def consume() -> list:
        got = []
        for _ in range(2):
            it = iter(loader)
            while (batch := await asyncio.to_thread(next, it, None)) is not None:
                got.append(batch)
        return got

    ctx.epoch(asyncio.run(consume()), "async", keep=True)


def _sum_in_child(batches, sums) -> None:
    while (batch := batches.get()) is not None:
        sums.put((float(batch["x"].sum()), batch["y"].tolist()))


def multiprocessing_consumer(ctx: Ctx) -> None:
    """Batches sent to a consumer process through a ``torch.multiprocessing`` queue."""
    loader = ctx.loader()
    mp = tmp.get_context("fork")
    batches, sums = mp.Queue(), mp.Queue()
    child = mp.Process(target=_sum_in_child, args=(batches, sums))
    child.start()
    count = 0
    for batch in loader:
        batches.put(batch)
        ctx.got(batch, "sent", keep=True)
        count += 1
    batches.put(None)
    for _ in range(count):
        ctx.value(sums.get(timeout=20), "summed in the child")
    child.join(20)
    ctx.value(child.exitcode, "child exit")


def torchdata_nodes(ctx: Ctx) -> None:
    """torchdata.nodes over the loader: ``IterableWrapper(loader)`` -> ``Prefetcher`` (its
    thread calls ``next()``) -> ``Mapper`` -> ``Loader``, two epochs, then one cut short."""
    from torchdata import nodes

    loader = ctx.loader()
    root = nodes.Mapper(nodes.Prefetcher(nodes.IterableWrapper(loader), prefetch_factor=2),
                        lambda b: {"x": b["x"] + 1, "y": b["y"]})
    node_loader = nodes.Loader(root)
    for epoch in range(2):
        ctx.epoch(node_loader, f"nodes epoch {epoch}", keep=True)
    for step, batch in enumerate(node_loader):
        ctx.got(batch, "cut short")
        if step == 1:
            break
    ctx.epoch(node_loader, "after")


def iter_in_two_threads(ctx: Ctx) -> None:
    """Two threads each run an epoch of one loader at the same time."""
    loader = ctx.loader(shuffle=False)
    results: dict = {}

    def epoch(name: str) -> None:
        try:
            results[name] = [int(b["y"][0]) for b in loader]
        except Exception as e:
            results[name] = f"{type(e).__name__}: {e}"[:100]

    threads = [threading.Thread(target=epoch, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    ctx.value(sorted(str(v) for v in results.values()), "both epochs")


HELD = "known: a thread holds the iterator for ever, as with torch (README)"
CASES = [
    Case("background-generator", background_generator),
    Case("background-abandoned", background_abandoned, known=HELD),
    Case("dataloader-x-subclass", data_loader_x),
    Case("queue-prefetcher", queue_prefetcher),
    Case("queue-prefetcher-abandoned", queue_prefetcher_abandoned, known=HELD),
    Case("apex-data-prefetcher", apex_prefetcher),
    Case("iter-here-next-there", iter_here_next_there),
    Case("thread-pool-map", thread_pool_map),
    Case("asyncio-to-thread", asyncio_to_thread),
    Case("torchdata-nodes", torchdata_nodes),
    Case("multiprocessing-consumer", multiprocessing_consumer),
    Case("iter-in-two-threads", iter_in_two_threads, configs=((0, False), (2, False))),
    Case("iter-in-two-threads-persistent", iter_in_two_threads, configs=((2, True),),
         known="known: racy in torch too (README)"),
]

if __name__ == "__main__":
    main(CASES)
