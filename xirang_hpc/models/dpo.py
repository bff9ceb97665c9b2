"""Direct preference optimisation (DPO, Rafailov et al. 2023): the loss from summed completion log-probs.

A batch of ``B`` pairs runs as ``2B`` rows, the chosen sequences first and then the rejected ones (TRL's
concatenated layout). For each row the log-probability of its learned targets (the completion tokens; every
other target is :data:`~xirang_hpc.models.loss.IGNORE_INDEX`) is summed, under the policy (``pi``) and under
the frozen reference (``ref``). With ``beta`` the inverse temperature:

- implicit rewards ``r_c = beta * (pi_c - ref_c)``, ``r_r = beta * (pi_r - ref_r)``;
- loss (``sigmoid``, the paper's) ``-logsigmoid(r_c - r_r)``, the mean over pairs;
- metrics: the rewards' means, the margin ``r_c - r_r`` and the accuracy ``r_c > r_r``, as TRL logs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from xirang_hpc.models.loss import IGNORE_INDEX


def completion_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row sum of ``log p(target)`` over the learned targets: logits (N, T, V), targets (N, T) -> (N,) fp32."""
    keep = targets != IGNORE_INDEX  # (N, T)
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, T, V)
    picked = logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # (N, T)
    return (picked * keep).sum(dim=-1)


@dataclass
class DpoTerms:
    """One batch's DPO loss (mean over its pairs) and per-pair rewards (detached), shape (B,)."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        """``r_c - r_r`` per pair."""
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> torch.Tensor:
        """1.0 where the chosen reply's reward beats the rejected one's, else 0.0."""
        return (self.chosen_rewards > self.rejected_rewards).float()


def dpo_terms(pi_logps: torch.Tensor, ref_logps: torch.Tensor, beta: float, loss_type: str = "sigmoid") -> DpoTerms:
    """DPO loss and rewards from the (2B,) summed log-probs of a concatenated [chosen; rejected] batch."""
    if loss_type != "sigmoid":
        raise ValueError(f"finetune.dpo.loss={loss_type!r}: only sigmoid is implemented")
    pi_c, pi_r = pi_logps.chunk(2, dim=0)
    ref_c, ref_r = ref_logps.detach().chunk(2, dim=0)
    chosen_ratio, rejected_ratio = pi_c - ref_c, pi_r - ref_r  # (B,) each
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return DpoTerms(losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
