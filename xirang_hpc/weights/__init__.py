"""xirang_hpc.weights: model weights in and out of the platform, in one room.

- :mod:`~xirang_hpc.weights.hf`: the Hugging Face tensor naming (Llama and GPT-2 families) and
  ``xirang-ckpt export --format hf``;
- :mod:`~xirang_hpc.weights.export`: a checkpoint of any layout gathered into one process, and the
  safetensors export;
- :mod:`~xirang_hpc.weights.hf_import`: ``model.init_from=<Hugging Face dir>`` by lazy slices, each
  rank reading only its own regions;
- :mod:`~xirang_hpc.weights.load`: a model ready for inference from a run, exported safetensors or a
  Hugging Face directory (serve, eval, pipeline stages), and the ``init_from`` hook of training.

The mapping of a Hugging Face ``config.json`` to ``model.*`` fields is torch-free and applied when a
config is loaded on the login node, so it lives in the config layer (:mod:`xirang_hpc.config.hf`);
this room imports it.
"""
