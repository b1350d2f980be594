"""The benchmark harness behind ``arena-loader bench``: workloads, the loaders compared,
measurement (warm-up, repeats, medians, CPU, peak memory, environment) and reporting.

Needs the ``bench`` extra (torch, psutil, matplotlib); ``spdl`` is used when installed.
"""

from .cli import main
from .harness import METRICS, CaseResult, environment, measure
from .loaders import LOADERS, Setup

__all__ = ["LOADERS", "METRICS", "CaseResult", "Setup", "environment", "main", "measure"]
