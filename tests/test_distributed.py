"""DistributedSampler under a real torch.distributed group (gloo), two ranks started here."""

from __future__ import annotations

import json
import os
import socket
import textwrap

import pytest

from . import zygote

pytestmark = pytest.mark.timeout(120)

RANK_SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import numpy as np
    import torch.distributed as dist
    from arena_loader import ArenaLoader
    from arena_loader.samplers import DistributedSampler
    from torch.utils.data.datapipes.iter import IterableWrapper

    # Made before the process group, as in a script that builds its data first: torch's
    # DataLoader shards a DataPipe by the rank at iter(), not at construction.
    early = ArenaLoader(IterableWrapper(range(12)).sharding_filter(), batch_size=3)
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment
    piped = [int(i) for batch in early for i in batch]
    early.close()
    dataset = np.arange(50, dtype=np.int64)
    sampler = DistributedSampler(dataset, shuffle=True, seed=7)  # replicas, rank: from dist
    epochs = []
    with ArenaLoader(dataset, batch_size=4, sampler=sampler, num_workers=1) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)  # (to the sampler, as Hugging Face's Trainer calls it)
            epochs.append([int(i) for batch in loader for i in batch])
    def warned(**options):  # the warnings an epoch of a loader with these options gives
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ArenaLoader(dataset, batch_size=25, **options) as loader:
                seen = [int(i) for batch in loader for i in batch]
                list(loader)  # a second epoch: warned once per loader
        return seen, [str(w.message) for w in caught if "every rank" in str(w.message)]
    whole, unsharded = warned()
    _, sharded = warned(sampler=sampler)
    gathered = [None, None]
    dist.all_gather_object(gathered, epochs)  # every rank sees both ranks' indices
    dist.destroy_process_group()
    print(json.dumps({"rank": sampler.rank, "replicas": sampler.num_replicas,
                      "epochs": epochs, "gathered": gathered, "whole": whole,
                      "unsharded": unsharded, "sharded": sharded, "piped": piped}))
""")


# Both ranks from one interpreter forked from the warm one with torch (tests/zygote.py): it
# forks rank 1, and each rank writes its line to a file of its own. (Two cold interpreters
# importing torch took ~7 s of CPU.) Rank 1 dies with rank 0 (PR_SET_PDEATHSIG), so a rank 0
# killed at the timeout leaves no orphan.
LAUNCH = textwrap.dedent("""
    import ctypes, os, signal, sys, traceback
    script, out = sys.argv[1:]
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
    rank = "0" if pid else "1"
    os.environ["RANK"] = rank
    sys.stdout = open(os.path.join(out, "rank" + rank), "w")
    try:
        exec(compile(open(script).read(), script, "exec"), {"__name__": "__main__"})
        sys.stdout.flush()
    except BaseException:
        if pid:
            raise
        traceback.print_exc()
        os._exit(1)
    if pid == 0:
        os._exit(0)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert status == 0, f"rank 1 exited with {status}"
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def ranks(tmp_path) -> list[dict]:
    """RANK_SCRIPT's results from two gloo ranks (one run for the tests below)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    result = zygote.run(["-c", LAUNCH, str(script), str(tmp_path)], timeout=90, env=env,
                        preload="torch")
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}").read_text().strip().splitlines()[-1])
            for r in range(2)]


def test_two_gloo_ranks_split_the_dataset_and_set_epoch_reshuffles(ranks):
    """Each rank takes num_replicas/rank from the initialised process group; their index sets
    are disjoint and cover the dataset (50 = 2 x 25, no padding), and set_epoch changes the
    order while both ranks agree on the permutation. A loader with its default sampler (what
    Lightning cannot replace in an ArenaLoader) warns that every rank loads everything.

    A loader over a sharded DataPipe made before ``init_process_group`` (or in the parent of
    ``mp.spawn``): torch's DataLoader reads the world size and rank at each ``iter()``, so
    each rank gets its half. Ours read them at construction (1 rank): every rank loaded all
    12 items. (One test: two would each start the two ranks, ~8 s of CPU, in each pytest
    process that runs one; pytest-xdist's xdist_group does not group under pytest 9.)"""
    results = ranks
    assert [r["piped"] for r in results] == [list(range(0, 12, 2)), list(range(1, 12, 2))]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["replicas"] == 2 for r in results)
    assert results[0]["gathered"] == results[1]["gathered"] == [r["epochs"] for r in results]
    for epoch in range(2):
        mine = [r["epochs"][epoch] for r in results]
        assert len(mine[0]) == len(mine[1]) == 25
        assert not set(mine[0]) & set(mine[1])
        assert sorted(mine[0] + mine[1]) == list(range(50))
    for r in results:
        assert r["epochs"][0] != r["epochs"][1]
        assert r["whole"] == list(range(50))
        assert len(r["unsharded"]) == 1 and "torch.distributed runs 2 ranks" in r["unsharded"][0]
        assert "sampler=arena_loader.DistributedSampler(dataset" in r["unsharded"][0]
        assert r["sharded"] == []


def test_loader_set_epoch_reaches_the_batch_sampler_the_sampler_or_the_dataset():
    """``loader.set_epoch(e)``, which Hugging Face's Trainer calls each epoch on a loader that
    has it: a DistributedSampler then gives torch's DistributedSampler's order for that
    epoch; a batch sampler with its own set_epoch gets it instead; with neither, a dataset
    with one (a Hugging Face IterableDataset shuffles by it)."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from arena_loader import ArenaLoader
    from arena_loader.samplers import DistributedSampler

    dataset = np.arange(30, dtype=np.int64)
    theirs = torch.utils.data.DistributedSampler(dataset, num_replicas=3, rank=1, seed=5)
    sampler = DistributedSampler(dataset, num_replicas=3, rank=1, seed=5)
    orders = []
    with ArenaLoader(dataset, batch_size=4, sampler=sampler) as loader:
        for epoch in (0, 1, 2):
            loader.set_epoch(epoch)
            theirs.set_epoch(epoch)
            orders.append([int(i) for batch in loader for i in batch])
            assert orders[-1] == list(theirs), epoch
    assert orders[0] != orders[1] != orders[2]

    class Epochs:
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    class EpochBatches(Epochs):
        sampler = None

        def __iter__(self):
            yield [0, 1]

        def __len__(self):
            return 1

    class EpochSampler(Epochs):
        def __iter__(self):
            return iter(range(4))

        def __len__(self):
            return 4

    class EpochDataset(Epochs):
        def __getitem__(self, index):
            return np.int64(index)

        def __len__(self):
            return 4

    data, batches, indices = EpochDataset(), EpochBatches(), EpochSampler()
    ArenaLoader(data, batch_sampler=batches).set_epoch(4)
    ArenaLoader(data, sampler=indices, batch_size=2).set_epoch(5)
    assert (batches.epochs, indices.epochs, data.epochs) == ([4], [5], [])
    ArenaLoader(data, batch_size=2).set_epoch(6)
    assert data.epochs == [6]
    # A batch sampler without set_epoch around one with it (torch's BatchSampler around a
    # DistributedSampler): the inner sampler gets it, not the dataset.
    inner = EpochSampler()
    ArenaLoader(data, batch_sampler=torch.utils.data.BatchSampler(inner, 2, False)).set_epoch(7)
    assert (inner.epochs, data.epochs) == ([7], [6])


def test_the_every_rank_loads_all_warning_needs_several_ranks(monkeypatch):
    """An initialised process group of one rank (a single-GPU run under torchrun) does not
    warn that every rank loads the whole dataset; two ranks do, unless the loader has a
    batch_sampler of the user's (which may share out the data itself)."""
    import warnings

    import numpy as np

    from arena_loader import ArenaLoader, _distributed

    class World:
        def __init__(self, size):
            self.size = size

        def get_world_size(self):
            return self.size

    for size, options, warned in ((1, dict(batch_size=2), False),
                                  (2, dict(batch_size=2), True),
                                  (2, dict(batch_sampler=[[0, 1], [2, 3]]), False)):
        monkeypatch.setattr(_distributed, "initialized_distributed", lambda size=size: World(size))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ArenaLoader(np.arange(4), **options) as loader:
                list(loader)  # (it warns at iter())
        found = [w for w in caught if "every rank loads the whole dataset" in str(w.message)]
        assert len(found) == warned, (size, options)


def test_a_datapipe_loader_outlives_its_process_group_and_copies_like_torchs():
    """A DataPipe loader's epoch seed is broadcast over a gloo group of its own. Ours made
    that group once: after ``destroy_process_group()`` and a new ``init_process_group()``
    its next ``iter()`` raised ValueError ("not initialized in the world group map"), and a
    copy of the loader (``copy.deepcopy``) raised TypeError (a ProcessGroup does not
    pickle). torch's DataLoader makes a group per iterator: both work, in torch's order."""
    import copy

    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.utils.data.datapipes.iter import IterableWrapper

    from arena_loader import ArenaLoader

    def group():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def epochs(cls):
        group()
        torch.manual_seed(0)
        loader = twin = cls(IterableWrapper(range(6)).shuffle().sharding_filter(),
                            batch_size=2, shuffle=True)
        try:
            seen = [[int(i) for b in loader for i in b]]
            twin = copy.deepcopy(loader)
            dist.destroy_process_group()
            group()
            for one in (loader, twin):
                seen.append([int(i) for b in one for i in b])
        finally:
            dist.destroy_process_group()
            if cls is ArenaLoader:
                twin.close()
                loader.close()
        return seen

    ours = epochs(ArenaLoader)
    assert ours == epochs(torch.utils.data.DataLoader)
    assert all(sorted(epoch) == list(range(6)) for epoch in ours)
