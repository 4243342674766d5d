"""A stream beside an accelerator's compute stream, for communication issued ahead.

``sharded_call`` issues a unit's gathers before the unit that needs them runs, and leaves its
reduce-scatters in flight while the backward goes on. On an accelerator the copies around them
(the cast to the compute dtype, the padding) would queue behind the compute already issued;
run on a stream of their own (FSDP2's all-gather and reduce-scatter streams), they start at
once and the collective with them. :class:`SideStream` is that stream:

- :meth:`SideStream.issue`: the block runs on the side stream, once the compute stream has
  done what it queued so far (the inputs are ready);
- :meth:`SideStream.join`: the compute stream waits for the side stream, and every tensor the
  side stream made is recorded as used by the compute stream (the caching allocator then keeps
  its memory until the compute stream is done with it).

The collectives themselves are ordered by their backend (``work.wait()`` makes the current
stream wait for NCCL's). On the CPU there is no stream: both do nothing, the copies run in
order on the calling thread and the collectives on the backend's threads (gloo's, or the
in-process ranks' turns). The device's stream API is read from ``torch.get_device_module``; a
module with the same few names may be given instead (the tests give one that records the calls).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["SideStream", "stream_api"]


def stream_api(device: torch.device) -> Any:
    """The stream API of ``device`` (``torch.cuda`` for CUDA), ``None`` where there are no
    streams (the CPU)."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device)


class SideStream:
    """A stream of ``device``'s own beside its current stream (see the module docs);
    ``module``: the stream API (``Stream``, ``current_stream``, ``stream`` and optionally
    ``record_stream(tensor, stream)``), by default :func:`stream_api`'s."""

    def __init__(self, device: torch.device, module: Any = None) -> None:
        if module is None:
            module = stream_api(device)
        self._module = module
        self._device = device
        self._stream = None if module is None else module.Stream(device)

    @property
    def active(self) -> bool:
        """Whether there is a side stream (not on the CPU)."""
        return self._stream is not None

    @contextlib.contextmanager
    def issue(self) -> Iterator[None]:
        """Run the block on the side stream, after the compute stream's queued work."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(self._module.current_stream(self._device))
        with self._module.stream(self._stream):
            yield

    def join(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make the compute stream wait for the side stream; ``tensors`` (made on the side
        stream) are recorded as used by the compute stream."""
        if self._stream is None:
            return
        current = self._module.current_stream(self._device)
        current.wait_stream(self._stream)
        record = getattr(self._module, "record_stream", None)
        for t in tensors:
            if record is not None:
                record(t, current)
            else:
                t.record_stream(current)
