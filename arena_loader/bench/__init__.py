"""The benchmark harness behind ``arena-loader bench``: workloads, the loaders compared,
measurement (rounds, warm-up, medians of within-round ratios, CPU, peak memory, environment)
and reporting.

Needs the ``bench`` extra (torch, psutil, matplotlib, pillow, and the peers compared: spdl,
grain, torchdata; a peer that is missing is reported "not installed" and skipped).
"""

from .cli import main
from .harness import METRICS, CaseResult, environment, measure
from .loaders import LOADERS, Setup

__all__ = ["LOADERS", "METRICS", "CaseResult", "Setup", "environment", "main", "measure"]
