"""Random generator states as a checkpoint leaf: :class:`RngState`.

``torch.get_rng_state()`` is a tensor of bytes; a checkpoint stores a generator state as plain
data (base64 text in the JSON beside DCP's files), one per rank, never as a pickle. A tree leaf
of type :class:`RngState` is what asks for that.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["RngState"]


@dataclasses.dataclass(frozen=True)
class RngState:
    """The states of torch's global random generators: the CPU one and, when CUDA is
    initialised, every device's (``torch.get_rng_state()``, ``torch.cuda.get_rng_state_all()``).

    Put one in the tree given to :func:`pshard.save`; :func:`pshard.load` gives it back (each
    rank its own: a checkpoint keeps every rank's state) and :meth:`restore` makes the
    generators draw the numbers they would have drawn after the save.

    Attributes:
        cpu: the CPU generator's state.
        cuda: one state per CUDA device, ``()`` when CUDA was not initialised.

    Example:
        >>> import torch, pshard as ps
        >>> state = ps.RngState.capture()
        >>> a = torch.rand(3)
        >>> state.restore()
        >>> torch.equal(torch.rand(3), a)
        True
    """

    cpu: bytes
    cuda: tuple[bytes, ...] = ()

    @classmethod
    def capture(cls) -> RngState:
        """The generators' states now."""
        cuda: tuple[bytes, ...] = ()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = tuple(_bytes(s) for s in torch.cuda.get_rng_state_all())
        return cls(_bytes(torch.get_rng_state()), cuda)

    def restore(self) -> None:
        """Set the generators to these states.

        Raises:
            ValueError: the state holds CUDA devices this process does not have.
        """
        torch.set_rng_state(_tensor(self.cpu))
        if not self.cuda:
            return
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(self.cuda) > count:
            raise ValueError(
                f"RngState.restore: the state holds {len(self.cuda)} CUDA generators but this "
                f"process sees {count} CUDA devices; restore on a machine with as many devices, "
                f"or drop them: dataclasses.replace(state, cuda=())"
            )
        for device, state in enumerate(self.cuda):
            torch.cuda.set_rng_state(_tensor(state), device)

    def to_json(self) -> dict[str, Any]:
        """The state as JSON data (base64 text)."""
        return {"cpu": _text(self.cpu), "cuda": [_text(s) for s in self.cuda]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RngState:
        """The inverse of :meth:`to_json`.

        Raises:
            ValueError: ``data`` is not what :meth:`to_json` writes.
        """
        try:
            cpu = base64.b64decode(data["cpu"], validate=True)
            cuda = tuple(base64.b64decode(s, validate=True) for s in data["cuda"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a saved RngState ({type(e).__name__}: {e})") from None
        return cls(cpu, cuda)

    def __repr__(self) -> str:
        return f"RngState(cpu=<{len(self.cpu)} bytes>, cuda=<{len(self.cuda)} devices>)"


def _bytes(state: torch.Tensor) -> bytes:
    return bytes(state.to(torch.uint8).cpu().numpy().tobytes())


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _text(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
