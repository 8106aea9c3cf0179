"""Keep the KV wire's message buffers in the heap instead of fresh pages.

Every chunk of a pull is a new ``bytes`` object of up to ``max_chunk_bytes`` on
both sides (gRPC owns a message until it is sent, so buffers cannot be reused
by hand). glibc serves an allocation above its mmap threshold (128 KiB until the
first such block is freed) with a fresh ``mmap``: every page of every message is
then faulted in and zeroed by the kernel and unmapped again. Measured on the
2-core CPU machine with ``benchmarks/kv_transfer.py`` (the engine's caches
allocated, so glibc's threshold had not moved): a 1-block pull took 13 ms
against 6 ms with this setting, a 4k-token pull ran at 1.3-1.4 GB/s against
1.6-1.8. Raising the threshold above the chunk size, and the trim threshold
with it, lets freed messages be reused by the next ones.

The setting is process-wide, so it is bounded: blocks of up to 32 MiB (glibc's
largest threshold) come from the heap, and at most ``trim`` bytes stay unused at
its top. Larger blocks (the KV cache itself, model weights) are still mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
_MAX_MMAP_THRESHOLD = 32 << 20

_applied: tuple[int, int] | None = None


def keep_message_buffers(max_chunk_bytes: int) -> tuple[int, int] | None:
    """Tune glibc malloc for messages of ``max_chunk_bytes``. Returns (mmap threshold, trim
    threshold) as set, or None where the C library is not glibc or refuses. Idempotent: the
    largest chunk size asked for in this process wins."""
    global _applied
    if not sys.platform.startswith("linux"):
        return None
    mmap_threshold = min(_MAX_MMAP_THRESHOLD, max(2 * max_chunk_bytes, 1 << 20))
    trim_threshold = 4 * mmap_threshold
    if _applied is not None and _applied[0] >= mmap_threshold:
        return _applied
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, mmap_threshold) != 1 or mallopt(_M_TRIM_THRESHOLD, trim_threshold) != 1:
        logger.warning("malloc refused an mmap threshold of %d bytes; KV messages use fresh pages", mmap_threshold)
        return None
    _applied = (mmap_threshold, trim_threshold)
    logger.info("KV wire: malloc mmap threshold %d bytes, trim threshold %d bytes", *_applied)
    return _applied
