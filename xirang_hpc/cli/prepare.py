"""``xirang-prepare``: corpus (text, JSONL, Parquet) -> tokenizer + HDF5 token shards (a Hydra app).

``data.tokenizer=bpe data.vocab_size=N`` trains a byte-level BPE on the corpus first;
``data.tokenizer=PATH`` uses an existing tokenizer.json or HF model dir. Progress goes to stderr.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from xirang_hpc.cli.help import maybe_print_help, setup_logging
from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.validate import load_config
from xirang_hpc.data.prepare import CorpusError, prepare_data
from xirang_hpc.data.tokenizer import TokenizerError
from xirang_hpc.files import private_by_default
from xirang_hpc.submit.hydra_setup import register_configs, run_app
from xirang_hpc.submit.preflight import check_writable


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    # The result line printed below is the report; prepare()'s own log line (through Hydra's job
    # logging) would say the same thing a second time.
    logging.getLogger("xirang_hpc.data.prepare").setLevel(logging.WARNING)
    try:
        full = load_config(cfg)
        private_by_default(full.train.share_group)  # the shards are the training data
        d = full.data
        # Before the corpus is read: a directory that cannot be written is refused naming data.out_dir.
        check_writable(Path(d.out_dir), "data.out_dir", "data directory (to prepare the corpus into)")
        index = prepare_data(d)
    except (ConfigError, CorpusError, TokenizerError) as exc:
        print(f"xirang-prepare: error: {exc}", file=sys.stderr)
        sys.exit(2)
    skipped = index["skipped_records"]["total"]  # type: ignore[index]
    print(f"prepared {d.out_dir}: {index['train_tokens']:,} train / {index['val_tokens']:,} val tokens "
          f"from {index['source']} with tokenizer {index['tokenizer']} (vocab {index['vocab_size']}; "
          f"skipped {index['skipped_binary']} binary, {index['skipped_unreadable']} unreadable files, "
          f"{skipped} bad records)")
    if index.get("format") == "chat":
        from xirang_hpc.data.dataset import overlong_samples

        n = index["samples"]  # type: ignore[index]
        long = overlong_samples(d.out_dir, full.model.seq_len)
        what = "cut to their start" if d.overlong == "truncate" else "left out"
        print(f"chat: {n['train']:,} train / {n['val']:,} val samples (train_on={d.train_on}, template sha256 "
              f"{str(index['chat_template_sha256'])[:12]}); {long['train'] + long['val']:,} longer than "
              f"model.seq_len+1={full.model.seq_len + 1} tokens, {what} (data.overlong={d.overlong})")


def main() -> None:
    """Console entry point."""
    maybe_print_help("xirang-prepare", sys.argv[1:])
    setup_logging(logging.INFO)
    register_configs()
    run_app("xirang-prepare", _app)
