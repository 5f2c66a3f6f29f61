"""The objective the trainer minimises: a list of terms, each a pure loss function on one kind of samples.

The trainer knows nothing of any algorithm: it computes what the terms declare they need (reference log-probs,
full logits), calls each term on the micro-batches of its samples, and adds ``coef`` x each term's loss. Which
terms there are follows from the config alone:

- ``policy``: ``loss.name`` on the RL batch (GRPO by default, or any function by import path);
- ``kl``: ``loss.kl_beta`` x KL_k3(pi_theta || pi_ref) on the RL batch, when kl_beta > 0;
- ``anchor``: ``anchor.coef`` x the anchor's replay loss on demo turns, when an anchor suite is set;
- ``explored``: ``explored_coef`` x the NLL of the batch's successful explored episodes (workflow exploration);
- an SFT phase (Entropulse) minimises ``sft`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from learner.losses import LossFn, anchor_kl_term, anchor_sft_term, explored_sft_term, get_loss, kl_term, needs_of

BATCH, ANCHOR, EXPLORED = "batch", "anchor", "explored"


@dataclass(frozen=True)
class Term:
    """One term of the objective."""

    name: str
    fn: LossFn
    coef: float = 1.0
    samples: str = BATCH
    """batch (the RL batch's turns) | anchor (the anchor's demo turns) | explored (the batch's successful explored
    episodes' turns)"""

    @property
    def needs(self) -> frozenset[str]:
        return needs_of(self.fn)


def rl_objective(cfg) -> list[Term]:
    """The terms of an RL step for a ``LearnerConfig``."""
    terms = [Term("policy", get_loss(cfg.loss.name))]
    if cfg.loss.kl_beta > 0:
        terms.append(Term("kl", kl_term, cfg.loss.kl_beta))
    if cfg.anchor.enabled:
        terms.append(Term("anchor", anchor_kl_term if cfg.anchor.kind == "kl" else anchor_sft_term, cfg.anchor.coef,
                          ANCHOR))
    if cfg.explored_coef > 0:
        terms.append(Term("explored", explored_sft_term, cfg.explored_coef, EXPLORED))
    return terms


def sft_objective() -> list[Term]:
    """The terms of an SFT step (Entropulse's SFT phases)."""
    return [Term("sft", get_loss("sft"))]


def needs_reference(terms: list[Term]) -> bool:
    return any(t.needs & {"ref_logprobs", "ref_logits"} for t in terms)
