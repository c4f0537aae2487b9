"""Resident memory of a process (Linux `/proc`), for the run's memory metrics.

`usage()` is this process's resident set now and its peak so far; `usage(pid)`
another process's (a local rollout server). Off Linux both are NaN, so the
metrics exist everywhere and read as missing where nobody can measure them.
"""

from __future__ import annotations

import math

_GB = 2**30


def usage(pid: int | str = 'self') -> tuple[float, float]:
  """`(rss_gb, peak_rss_gb)` of `pid`: VmRSS and VmHWM of /proc/<pid>/status."""
  fields = {}
  try:
    with open(f'/proc/{pid}/status') as f:
      for line in f:
        name, _, value = line.partition(':')
        if name in ('VmRSS', 'VmHWM'):
          fields[name] = int(value.split()[0]) * 1024 / _GB  # kB
  except (OSError, ValueError):
    pass
  return fields.get('VmRSS', math.nan), fields.get('VmHWM', math.nan)
