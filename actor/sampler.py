"""Token sampling on the device for a batch whose rows have their own sampling parameters.

Rows carry their temperature (0 = greedy), top-p mass and minimum length as tensors, so one decode batch
can mix training turns and greedy evaluation turns, and nothing here waits for the host. Which code paths
run (nucleus, greedy rows, a minimum length) is decided by the caller from what it knows on the host, so a
batch that uses none of them pays for none.

The log-probability recorded for a sampled token is taken under the row's temperature over the whole
vocabulary (not renormalised over the nucleus): that is what the learner recomputes. A greedy row records
its token's log-probability under temperature 1.

Sampling is an exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` per column, i.e. the Gumbel-max
trick), which draws exactly from ``p`` without the cumulative sums and host synchronisation of a
``multinomial`` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policy.model import BANNED_LOGIT


@dataclass
class RowParams:
    """Per-slot sampling parameters on the device (rows are engine slots)."""

    temperature: Any  # [slots] float32; a greedy row holds 1.0 (its log-probs are under temperature 1)
    greedy: Any  # [slots] bool
    top_p: Any  # [slots] float32
    min_new: Any  # [slots] long: stop tokens are banned until a row has generated this many
    generated: Any  # [slots] long: tokens generated so far

    def take(self, rows: Any) -> "RowParams":
        """The parameters of ``rows`` (a slice: views; an index tensor: a gather)."""
        return RowParams(self.temperature[rows], self.greedy[rows], self.top_p[rows], self.min_new[rows],
                         self.generated[rows])


@dataclass(frozen=True)
class BatchKinds:
    """What the rows of one decode batch use, known on the host."""

    nucleus: bool = False
    greedy: bool = False
    sampled: bool = True
    min_new: bool = False


def sample(logits: Any, rows: RowParams, kinds: BatchKinds, stop_ids: Any, gen: Any) -> tuple[Any, Any]:
    """Tokens and their log-probs for the rows of ``logits`` (float32, banned columns already set), row ``i``
    drawn with the parameters ``rows`` hold at ``i``."""
    import torch

    if kinds.min_new:
        early = (rows.generated < rows.min_new)[:, None]
        stops = logits.index_select(-1, stop_ids)
        logits = logits.index_copy(-1, stop_ids, torch.where(early, torch.full_like(stops, BANNED_LOGIT), stops))
    logp = torch.log_softmax(logits / rows.temperature[:, None], dim=-1)
    if not kinds.sampled:
        tokens = logp.argmax(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    race = torch.empty_like(logp).exponential_(generator=gen)
    if kinds.nucleus:
        probs = logp.exp()
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < rows.top_p[:, None]  # the most likely token is always kept
        choice = (sorted_p * keep / race).argmax(-1)
        drawn = order.gather(-1, choice[:, None]).squeeze(-1)
    else:
        drawn = (logp - race.log()).argmax(-1)
    tokens = torch.where(rows.greedy, logp.argmax(-1), drawn) if kinds.greedy else drawn
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
