"""The checks of packed-sequence offsets run at the boundary of the three ``seqlens`` forms
(:class:`~fla_ac_isolation.LayerLocalSeqlens`, ``CPSeqlens``, ``StaticSeqlens.fill``), and the offsets of
document lengths.

Each raises ``TypeError`` for a wrong kind of value and ``ValueError`` for a wrong value, naming the argument.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Iterable

import torch

__all__ = [
    "INDEX_DTYPES",
    "check_available",
    "check_fits",
    "check_index_tensor",
    "check_num_tokens",
    "check_offsets",
    "check_positions",
    "checked_host_copy",
    "lengths",
    "offsets_of_lengths",
    "parse_device",
    "snapshot",
]

INDEX_DTYPES = (torch.int32, torch.int64)
"""The integer dtypes offsets may have."""


def lengths(seq_lens: object) -> list[int]:
    """``seq_lens`` as a list of Python ints, each checked (see :meth:`LayerLocalSeqlens.from_seq_lens`)."""
    if isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Iterable):
        raise TypeError(f"seq_lens must be a sequence of document lengths (ints), got {type(seq_lens).__name__}")
    lens = list(seq_lens)
    if not lens:
        raise ValueError("seq_lens must hold at least one document length")
    out = []
    for i, n in enumerate(lens):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):  # numpy integers are Integral
            hint = " (pass a tensor as seq_lens.tolist())" if isinstance(n, torch.Tensor) else ""
            raise TypeError(f"seq_lens[{i}] must be an int, got {type(n).__name__}{hint}")
        if n < 0:
            raise ValueError(f"seq_lens[{i}] must be >= 0, got {n}")
        out.append(int(n))
    return out


def check_positions(host: torch.Tensor, name: str) -> None:
    """Every position is 0 (a document starts) or the previous one plus 1; the error names the first bad index."""
    if int(host[0]) != 0:
        raise ValueError(f"position_ids must start at 0 (a document start), got {name}[0]={int(host[0])}")
    ok = (host[1:] == 0) | (host[1:] == host[:-1] + 1)
    if not bool(ok.all()):
        i = int(torch.nonzero(~ok)[0]) + 1
        prev, value = int(host[i - 1]), int(host[i])
        raise ValueError(
            f"position_ids must restart at 0 and count up by 1 within a document, but {name}[{i}]={value} "
            f"follows {name}[{i - 1}]={prev} (expected 0 or {prev + 1})"
        )


def check_index_tensor(t: object, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32/int64 offsets, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64 offsets, got dtype {t.dtype}")
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D with N + 1 >= 2 offsets for N documents, got shape {tuple(t.shape)}"
        )


def parse_device(device: torch.device | str, name: str = "device") -> torch.device:
    """``torch.device(device)``; ``ValueError`` naming ``name`` for a string torch cannot parse (``"gpu"``)."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cuda:0', got {device!r}") from err


def check_available(device: torch.device, name: str = "device") -> None:
    """``ValueError`` naming ``name`` for a CUDA device this process cannot use (no CUDA, index out of range)."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"{name}={str(device)!r} but CUDA is not available here (torch.cuda.is_available() is False)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{name}={str(device)!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")


def check_num_tokens(num_tokens: object) -> None:
    if num_tokens is None:
        return
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(
            f"num_tokens must be an int (the packed token count, hidden_states.shape[1]), got "
            f"{type(num_tokens).__name__}"
        )
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")


def checked_host_copy(cu_seqlens_cpu: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Validate ``cu_seqlens_cpu`` against the snapshot ``own`` of ``cu_seqlens``; return its own clone."""
    check_index_tensor(cu_seqlens_cpu, "cu_seqlens_cpu")
    if cu_seqlens_cpu.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu must be a CPU tensor, got device {cu_seqlens_cpu.device}")
    if cu_seqlens_cpu.shape != own.shape:
        raise ValueError(
            f"cu_seqlens_cpu must have the shape of cu_seqlens {tuple(own.shape)}, got {tuple(cu_seqlens_cpu.shape)}"
        )
    host = cu_seqlens_cpu.detach().clone()
    device_values = own.to(device="cpu", dtype=torch.int64)  # int64: an int32 copy could wrap and hide a mismatch
    if not torch.equal(device_values, host.to(torch.int64)):
        i = int(torch.nonzero(device_values != host.to(torch.int64))[0])
        raise ValueError(
            f"cu_seqlens_cpu must hold the same values as cu_seqlens, but cu_seqlens_cpu[{i}]="
            f"{int(host[i])} != cu_seqlens[{i}]={int(device_values[i])}"
        )
    return host


def check_offsets(offsets: list[int], num_tokens: int | None) -> list[int]:
    """Document lengths of the ``cu_seqlens`` values, checked: from 0, non-decreasing, ending at ``num_tokens``."""
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
    lens = [b - a for a, b in itertools.pairwise(offsets)]
    bad = next((i for i, n in enumerate(lens) if n < 0), None)
    if bad is not None:
        raise ValueError(
            f"cu_seqlens must be non-decreasing, but cu_seqlens[{bad + 1}]={offsets[bad + 1]} < "
            f"cu_seqlens[{bad}]={offsets[bad]}"
        )
    if num_tokens is not None and offsets[-1] != num_tokens:
        raise ValueError(
            f"cu_seqlens[-1] must equal the packed token count num_tokens={num_tokens} (hidden_states.shape[1] "
            f"when packed), got {offsets[-1]}"
            + (f"; a batch padded after its documents: count the padding as one more document (append "
               f"{num_tokens} to cu_seqlens) and mask it out of the loss" if offsets[-1] < num_tokens else "")
        )
    return lens


def check_fits(last_offset: int, dtype: torch.dtype, name: str) -> None:
    """``ValueError`` naming ``name`` when ``last_offset`` does not fit ``dtype`` (``[2**31]`` with int32)."""
    limit = torch.iinfo(dtype).max
    if last_offset > limit:
        raise ValueError(
            f"{name} add up to {last_offset} tokens, more than {dtype} offsets can hold ({limit}); "
            "pass dtype=torch.int64"
        )


def snapshot(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(own, host)``: a clone of the checked ``cu_seqlens`` (stream-ordered on a GPU: no sync) and its host offsets
    (``cu_seqlens_cpu``'s clone checked equal, else ``own`` on a CPU or one device-to-host copy).

    Raises:
        ValueError: ``cu_seqlens`` on the meta device; see :func:`checked_host_copy`.
    """
    if cu_seqlens.device.type == "meta":
        raise ValueError("cu_seqlens is a meta tensor, which holds no values; build it on the activations' device")
    own = cu_seqlens.detach().clone()
    if cu_seqlens_cpu is not None:
        return own, checked_host_copy(cu_seqlens_cpu, own)
    return own, own if own.device.type == "cpu" else own.cpu()


def offsets_of_lengths(
    seq_lens: object, device: torch.device | str | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens on device, cu_seqlens_cpu)`` of document lengths, e.g. ``[5, 0, 17]`` -> ``[0, 5, 5, 22]``
    (on the CPU both are one tensor).

    Raises:
        TypeError: ``seq_lens`` is not an iterable of integers, or ``dtype`` is not int32/int64.
        ValueError: no or a negative length; a total ``dtype`` cannot hold; a bad or unusable ``device``.
    """
    lens = lengths(seq_lens)
    if dtype not in INDEX_DTYPES:
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    offsets = [0, *itertools.accumulate(lens)]
    check_fits(offsets[-1], dtype, "seq_lens")
    target = None
    if device is not None:
        target = parse_device(device)
        check_available(target)
    host = torch.tensor(offsets, dtype=dtype)
    return (host.to(target) if target is not None else host), host
