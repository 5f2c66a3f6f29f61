"""The HF engine's KV cache: allocated once, one fixed slot per in-flight request.

Every layer holds keys and values as ``[slots, kv_heads, columns, head_dim]``, ``columns`` being
``max_seq_len + 1`` rounded up to a multiple of ``COLUMN_ALIGNMENT``. A request owns one slot (a row) from its
prefill to its last token; a token at cache position ``p`` of slot ``s`` is written to ``[s, :, p]``. Nothing is
concatenated or reallocated while decoding, so a decode step has the same tensors at every token (what a captured
CUDA graph needs). Column ``max_seq_len`` is a scratch column: padding tokens of a prefill and idle slots of a decode
batch write there, and no live request ever reads it. The columns after it are never written: attention reads
columns in multiples of ``COLUMN_ALIGNMENT`` (``aligned``; the extra ones masked out), as its masks are laid out.

The model sees this as a transformers ``Cache``: its attention layers call ``update(keys, values, layer)``
and attend over what it returns, under the 4D mask the engine passes (transformers uses a 4D mask as given).
Before each forward pass the engine says which slots are written where (``write``) and which block is read
back: ``read_prefix`` for the first ``rows`` slots, as a decode batch is laid out, or ``read_rows`` for the
slots of a prefill batch, each returning the mask over the columns it reads; or ``read_own``, no mask, for a
pass that attends causally over its own new keys.

The masks are additive, in the cache's dtype: 0 where a query attends, the dtype's lowest finite value where
not. (Finite, as transformers' own additive masks are: a kernel that meets a block of -inf scores can make NaN
of it, and PyTorch gives cuDNN's attention a finite one for that reason; softmax gives masked columns exactly 0
either way.) Given a boolean mask, SDPA would convert it to this in every layer; made once, a pass saves two
operators a layer. Its rows are ``COLUMN_ALIGNMENT`` elements apart in memory, as the memory-efficient kernel that
runs a masked SDPA on a GPU needs: other masks it copies into that layout, in every layer. (Rounding the columns
read, rather than slicing a wider mask, also keeps a compiled pass from specialising on whether a pass's columns
happen to be aligned.)
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import Cache

from policy.staging import to_device

COLUMN_ALIGNMENT = 8  # cache columns attention reads at once, and its masks' row length, come in multiples of this


def aligned(n: int) -> int:
    """``n`` columns rounded up to a multiple of ``COLUMN_ALIGNMENT``."""
    return -(-n // COLUMN_ALIGNMENT) * COLUMN_ALIGNMENT


class SlotKVCache(Cache):
    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: Any, device: Any):
        import torch

        super().__init__(layers=[])
        self.torch = torch
        self.slots, self.max_seq_len = slots, max_seq_len
        self.scratch = max_seq_len  # the column padding and idle slots write to
        shape = (slots, kv_heads, aligned(max_seq_len + 1), head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.column_index = torch.arange(shape[2], device=device)  # (masks are made from it)
        self._write_rows: Any = None  # [n, 1] slot of each row of the forward batch
        self._write_pos: Any = None  # [n, q] cache position of each of its q new tokens
        self._read_rows: Any = None  # [n] slots read back (a prefill), or None: the first _read_count slots (a decode)
        self._read_count = 0
        self._read_len = 0
        self._read_own = False  # (``read_own``)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def write(self, rows: Any, positions: Any) -> None:
        """The next forward pass writes row ``i``'s new token ``j`` to slot ``rows[i]`` at ``positions[i, j]``."""
        self._write_rows, self._write_pos = rows[:, None], positions

    def read_prefix(self, rows: int, length: int, last: Any) -> Any:
        """Attention reads the first ``length`` columns of slots ``0 .. rows - 1`` (a view: no copy), each query
        attending to columns ``0 .. last`` (``last``: one per query, in the shape the mask broadcasts from): the
        mask, ``last.shape + (columns,)``."""
        length = aligned(length)
        self._read_rows, self._read_count, self._read_len, self._read_own = None, rows, length, False
        return self._mask(last, length)

    def read_rows(self, rows: Any, length: int, last: Any) -> Any:
        """Attention reads the first ``length`` columns of the slots ``rows`` (gathered: a prefill batch), each
        query attending to columns ``0 .. last``: the mask, as ``read_prefix``."""
        length = aligned(length)
        self._read_rows, self._read_len, self._read_own = rows, length, False
        return self._mask(last, length)

    def read_own(self, length: int) -> None:
        """Attention reads the pass's own ``length`` new keys and values, as computed (a causal pass whose prompts all
        start at column 0: its real tokens' keys are what the slots' first columns now hold, so nothing is gathered;
        its padding tokens' keys, which went to the scratch column, are read only by padding queries)."""
        self._read_len, self._read_own = length, True

    def _mask(self, last: Any, columns: int) -> Any:
        """0 for columns ``0 .. last``, the lowest finite value beyond, ``columns`` (aligned) wide."""
        torch = self.torch
        dtype = self.keys[0].dtype
        attend = self.column_index[:columns] <= last[..., None]
        return torch.where(attend, torch.zeros((), dtype=dtype, device=last.device), torch.finfo(dtype).min)

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        # [n, heads, q, dim] -> [n, q, heads, dim]: the layout advanced indexing on dims 0 and 2 expects
        k[self._write_rows, :, self._write_pos] = key_states.transpose(1, 2).to(k.dtype)
        v[self._write_rows, :, self._write_pos] = value_states.transpose(1, 2).to(v.dtype)
        if self._read_own:
            return key_states.to(k.dtype), value_states.to(v.dtype)
        if self._read_rows is None:
            return k[:self._read_count, :, :self._read_len], v[:self._read_count, :, :self._read_len]
        return k[self._read_rows, :, :self._read_len], v[self._read_rows, :, :self._read_len]

    def copy_prefixes(self, sources: Any, targets: Any, lengths: list[int]) -> None:
        """Columns ``0 .. lengths[i] - 1`` of slot ``sources[i]`` into slot ``targets[i]``, every layer (a prompt
        prefix another slot already holds: one gather and one scatter a layer, however many pairs). Shorter
        pairs copy the scratch column into the scratch column beyond their length."""
        torch = self.torch
        device = self.keys[0].device
        longest = max(lengths)
        columns = torch.arange(longest, device=device)[None, :]
        columns = torch.where(columns < to_device(lengths, device)[:, None], columns, self.scratch)
        src, dst = sources[:, None], targets[:, None]
        for k, v in zip(self.keys, self.values):
            k[dst, :, columns] = k[src, :, columns]
            v[dst, :, columns] = v[src, :, columns]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._read_len

    def __len__(self) -> int:
        return len(self.keys)
