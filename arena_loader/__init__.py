"""arena_loader: a DataLoader with torch's interface whose workers write batches in place
into one preallocated POSIX shared-memory slab."""

from .datasets import ArrayDataset, BatchReadable, MemmapDataset
from .errors import (
    ArenaLoaderError,
    DescriptorLimitError,
    LayoutError,
    LoaderClosedError,
    LoaderForkedError,
    LoaderTimeoutError,
    SampleKeyError,
    SampleShapeError,
    SampleTypeError,
    ShmCapacityError,
    SlotsExhaustedError,
    WorkerCrashedError,
)
from .loader import ArenaLoader
from .samplers import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from .snapshot import IteratorSnapshot, LoaderSnapshot
from .worker_info import WorkerInfo, get_worker_info

__all__ = [
    "ArenaLoader",
    "ArenaLoaderError",
    "ArrayDataset",
    "BatchReadable",
    "BatchSampler",
    "DescriptorLimitError",
    "DistributedSampler",
    "IteratorSnapshot",
    "LayoutError",
    "LoaderClosedError",
    "LoaderForkedError",
    "LoaderSnapshot",
    "LoaderTimeoutError",
    "MemmapDataset",
    "RandomSampler",
    "SampleKeyError",
    "SampleShapeError",
    "SampleTypeError",
    "SequentialSampler",
    "ShmCapacityError",
    "SlotsExhaustedError",
    "SubsetRandomSampler",
    "WeightedRandomSampler",
    "WorkerCrashedError",
    "WorkerInfo",
    "get_worker_info",
]

__version__ = "0.1.0"
