"""The preference group: the pipeline's optional DPO stage after supervised fine-tuning.

``xirang-pipeline`` with ``preference.corpus`` set chains prepare -> train (the supervised fine-tune of
``data.*`` / ``finetune.*``) -> export -> dpo -> eval -> serve: the train stage's result, exported as a Hugging
Face directory (a LoRA run merged into its base), is the start and the frozen reference of a DPO run on the
pairs of ``preference.corpus``; eval and serve then take the DPO run (its adapter served over the merged
model when ``preference.lora``). Empty ``corpus``: no preference stage, the four-stage pipeline as before.
The DPO run's other fields (model, layout, cluster, tokenizer, LoRA shape) are the train stage's.
"""

from __future__ import annotations

from dataclasses import dataclass

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.schema._checks import check_finite


@dataclass
class PreferenceConfig:
    """DPO of the pipeline's fine-tuned model on preference pairs (``finetune.method=dpo`` of that run)."""

    # Preference pairs (JSONL / Parquet of prompt, chosen, rejected; strings or chat messages). "" = no stage.
    corpus: str = ""
    # Where the pairs are prepared (data.out_dir of the DPO run); must differ from data.out_dir.
    out_dir: str = "data/pairs"
    # finetune.dpo.beta of the DPO run.
    beta: float = 0.1
    # finetune.dpo.lora of the DPO run: LoRA adapters (finetune.lora.*) on the fine-tuned model, which stays the
    # reference; false: every weight trains against a frozen copy of it.
    lora: bool = False
    # train.max_steps / train.lr of the DPO run; 0 = the train stage's.
    steps: int = 0
    lr: float = 0.0

    def __post_init__(self) -> None:
        check_finite("preference", self)
        if not self.beta > 0:
            raise ConfigError("preference.beta", self.beta, "must be a positive number (finetune.dpo.beta of the "
                              "DPO stage, 0.1 by default)")
        if self.steps < 0 or self.lr < 0:
            raise ConfigError("preference.steps/lr", (self.steps, self.lr),
                              "use 0 (the train stage's train.max_steps / train.lr) or a positive value")
        if not self.out_dir:
            raise ConfigError("preference.out_dir", self.out_dir, "name a directory for the prepared pairs")
        if not self.corpus and (self.beta != 0.1 or self.lora or self.steps or self.lr):
            raise ConfigError("preference.corpus", self.corpus,
                              "the preference (DPO) stage needs pairs data: set preference.corpus to a JSONL file "
                              "of prompt/chosen/rejected records, or leave the other preference.* fields unset")

    @property
    def enabled(self) -> bool:
        """Whether the pipeline has a preference stage."""
        return bool(self.corpus)
