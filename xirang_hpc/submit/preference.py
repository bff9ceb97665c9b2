"""The pipeline's preference stage: the DPO run's config, derived from the pipeline's own (``preference.*``).

With ``preference.corpus`` set, ``xirang-pipeline`` runs prepare -> train -> export -> dpo -> eval -> serve. The
train stage is the supervised fine-tune the composed config describes (``data.format=chat``,
``finetune.method=lora|full``); the export stage writes its result as a Hugging Face directory, a LoRA run's
adapters merged into their base (``<run>/sft-model``); the dpo stage is a second run (``<run>/dpo``) with
``finetune.method=dpo`` on the pairs, started from that directory.

Why merged: DPO's reference must be the supervised model (the DPO paper's ``pi_ref = pi_SFT``). Continuing the SFT
adapter with ``finetune.dpo.lora`` would make the reference the base with the adapters disabled, i.e. the model
before fine-tuning. From the merged directory, ``preference.lora=true`` trains fresh adapters whose disabled state
is exactly the SFT model, and ``false`` trains every weight against a frozen copy of it.

Everything here runs on the login node (no torch): the configs are checked before any stage is submitted, so a
chain whose stages disagree is refused naming the fields.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.hf import base_model_dir
from xirang_hpc.config.schema import XirangConfig
from xirang_hpc.config.validate import check_runnable, load_config
from xirang_hpc.runs.chain import DPO_RUN, SFT_MODEL

#: Fields a pair record must have (data.format=pairs).
PAIR_FIELDS = ("prompt", "chosen", "rejected")


def _refuse(field: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(field, value, f"the preference (DPO) stage of the pipeline: {fix}")


def _first_record(corpus: Path) -> tuple[Path, int, dict[str, Any]] | None:
    """The first JSONL record of the corpus (a file, or the first .jsonl file of a directory), or None when the
    corpus is not JSONL (Parquet: preparation checks it)."""
    files = sorted(corpus.rglob("*.jsonl")) if corpus.is_dir() else [corpus] if corpus.suffix == ".jsonl" else []
    for f in files:
        with f.open() as fh:
            for i, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        return None  # a malformed line: data.on_bad_record decides at preparation
                    return f, i, rec if isinstance(rec, dict) else {}
    return None


def check_pairs_corpus(corpus: str) -> None:
    """Refuse a ``preference.corpus`` that is missing or holds no preference pairs (e.g. the chat data)."""
    path = Path(corpus).expanduser()
    if not path.exists():
        raise _refuse("preference.corpus", corpus, "no such file or directory; point it at a JSONL file of "
                      "preference pairs (prompt, chosen, rejected)")
    first = _first_record(path)
    if first is None:
        return
    f, line, rec = first
    missing = [k for k in PAIR_FIELDS if k not in rec]
    if missing:
        kind = "a chat conversation (messages)" if "messages" in rec else f"fields {sorted(rec)}"
        raise _refuse("preference.corpus", corpus, f"{f}:{line} is {kind}, not a preference pair: it lacks "
                      f"{', '.join(missing)}; the DPO stage needs pairs ({', '.join(PAIR_FIELDS)}), while the chat "
                      "data of the train stage goes to data.corpus")


def preference_config(cfg: XirangConfig, run_dir: Path) -> XirangConfig:
    """The DPO run of the pipeline whose (validated) config is ``cfg`` and run directory ``run_dir``.

    Raises :class:`ConfigError` naming the field when the chain cannot run: the train stage is not a supervised
    fine-tune of a Hugging Face model, the pairs are missing or are not pairs, the two stages would share
    prepared data, or the layout is one DPO does not run on. The returned config's ``model.init_from`` is the
    export stage's directory (``<run>/sft-model``), which exists only once that stage ran: the job validates it
    again when it loads it.
    """
    pref = cfg.preference
    if not pref.enabled:
        raise _refuse("preference.corpus", pref.corpus, "set it to a JSONL file of preference pairs")
    if cfg.finetune.method == "dpo" or cfg.data.format == "pairs":
        raise _refuse("finetune.method/data.format", (cfg.finetune.method, cfg.data.format),
                      "with preference.corpus the train stage is the supervised fine-tune before DPO: use "
                      "finetune.method=lora or full on data.format=chat (or text), and put the pairs in "
                      "preference.corpus")
    base = base_model_dir(cfg.model.init_from)
    if base is None:
        raise _refuse("model.init_from", cfg.model.init_from,
                      "the chain hands the fine-tuned model to DPO as a Hugging Face directory (and serves its "
                      "adapter over it), so it must start from one: model.init_from=<Hugging Face model directory>")
    check_pairs_corpus(pref.corpus)
    pairs_dir = Path(pref.out_dir).expanduser().absolute()
    if pairs_dir == Path(cfg.data.out_dir).expanduser().absolute():
        raise _refuse("preference.out_dir", pref.out_dir, f"the same directory as data.out_dir={cfg.data.out_dir}: "
                      "the pairs and the train stage's data are prepared apart; choose another preference.out_dir")
    d = dataclasses.asdict(cfg)
    d["data"].update(corpus=pref.corpus, out_dir=str(pairs_dir), format="pairs", packing=False, train_on="assistant")
    d["finetune"].update(method="dpo", dpo={"beta": pref.beta, "loss": "sigmoid", "lora": pref.lora})
    d["train"].update(run_dir=str(Path(run_dir) / DPO_RUN), name=f"{cfg.train.name}-dpo", resume_from=-1,
                      max_steps=pref.steps or cfg.train.max_steps, lr=pref.lr or cfg.train.lr)
    # Checked from the Hugging Face directory the fine-tune starts from (a PEFT adapter's base): the export stage
    # has not run yet, and it writes the same shapes.
    d["model"]["init_from"] = str(Path(base).expanduser().absolute())
    try:
        dpo = load_config(OmegaConf.create(d))
        check_runnable(dpo)
    except ConfigError as exc:
        raise _refuse(exc.field, exc.value, f"{exc.fix} (the DPO run takes the train stage's {exc.field}; "
                      f"this chain runs both)") from None
    # A plain attribute set: the directory is validated when the DPO job loads the config, once it exists.
    model = copy.copy(dpo.model)
    model.init_from = str(Path(run_dir) / SFT_MODEL)
    return dataclasses.replace(dpo, model=model)
