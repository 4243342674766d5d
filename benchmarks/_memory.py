"""Reading a process's memory for the benchmarks: resident now, peak, and handing freed heap
back to the system first (glibc), so that what is resident is what is alive."""

from __future__ import annotations

import ctypes
import resource


def rss_mib() -> float:
    """Resident memory now, MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_mib() -> float:
    """Peak resident memory of the process so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trim() -> None:
    """Return freed heap memory to the system (glibc's malloc_trim)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - not glibc
        pass


def reset_peak() -> bool:
    """Start the high-water mark of :func:`hwm_mib` again from what is resident now (Linux's
    ``/proc/self/clear_refs``); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:  # pragma: no cover - not Linux
        return False


def hwm_mib() -> float:
    """Resident high-water mark since the start or the last :func:`reset_peak`, MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return peak_mib()
