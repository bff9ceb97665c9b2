"""``xirang-prepare``: corpus directory -> HDF5 token shards (a Hydra app over the data group)."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.store import register_configs
from xirang_hpc.config.validate import load_config
from xirang_hpc.data.prepare import CorpusError, prepare


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _app(cfg: DictConfig) -> None:
    try:
        d = load_config(cfg).data
        index = prepare(d.corpus, d.out_dir, d.val_fraction, d.shard_tokens, d.split_seed)
    except (ConfigError, CorpusError) as exc:
        print(f"xirang-prepare: error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"prepared {d.out_dir}: {index['train_tokens']:,} train / {index['val_tokens']:,} val tokens "
          f"from {index['source']} (skipped {index['skipped_binary']} binary, "
          f"{index['skipped_unreadable']} unreadable files)")


def main() -> None:
    """Console entry point."""
    logging.basicConfig(level=logging.INFO)
    register_configs()
    _app()
