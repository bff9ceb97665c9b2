"""The eval and serve groups: evaluation and the inference server."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from xirang_hpc.config.errors import ConfigError
from xirang_hpc.config.hf import is_peft_dir
from xirang_hpc.config.schema._checks import check_finite, check_positive

# A serving run directory's info file (url, port, pid, model id): written by the server, read by the pipeline's
# status and by clients that wait for the server.
SERVE_FILE = "serve.json"


@dataclass
class EvalConfig:
    """Held-out evaluation of a checkpoint (xirang_hpc/eval): loss, perplexity, a generation sample."""

    batches: int = 16
    batch_size: int = 8
    seed: int = 0
    step: int = -1  # checkpoint step to evaluate; -1 = the newest good one
    device: str = "auto"  # auto (the accelerator torch finds, else the CPU) | cpu | a device type
    sample_prompt: str = "def "
    sample_tokens: int = 64
    # Quality gate for xirang-pipeline: > 0 fails the eval stage (and stops the chain) above this loss.
    max_val_loss: float = 0.0
    # lm-evaluation-harness tasks run against the served checkpoint (xirang_hpc/eval/harness.py): the shipped
    # local tasks (xirang_heldout_mc, xirang_heldout_gen) or YAMLs under harness_include; [] = none.
    harness_tasks: list[str] = field(default_factory=list)
    harness_limit: int = 0  # documents per task (0 = all; the shipped tasks build 100)
    harness_num_fewshot: int = 0  # few-shot examples per prompt
    harness_include: str = ""  # a directory of task YAMLs of your own (local data_files only)

    def __post_init__(self) -> None:
        check_finite("eval", self)
        for name in ("batches", "batch_size"):
            check_positive("eval", name, getattr(self, name))
        if self.sample_tokens < 0 or self.max_val_loss < 0:
            raise ConfigError("eval.sample_tokens/max_val_loss", (self.sample_tokens, self.max_val_loss),
                              "use 0 or more")
        if self.harness_limit < 0 or self.harness_num_fewshot < 0:
            raise ConfigError("eval.harness_limit/harness_num_fewshot", (self.harness_limit, self.harness_num_fewshot),
                              "use 0 or more")
        if len(set(self.harness_tasks)) != len(self.harness_tasks) or not all(self.harness_tasks):
            raise ConfigError("eval.harness_tasks", list(self.harness_tasks), "name each task once, none empty")
        if (self.harness_limit or self.harness_num_fewshot or self.harness_include) and not self.harness_tasks:
            raise ConfigError("eval.harness_tasks", [], "eval.harness_limit/num_fewshot/include apply to harness "
                              "tasks: name them, e.g. eval.harness_tasks=[xirang_heldout_mc]")

#: A served adapter's name: what a request's ``model`` field says (also a key's ``runs`` entry).
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass
class ServeConfig:
    """HTTP serving of a checkpoint (xirang_hpc/serve, xirang-serve)."""

    host: str = "127.0.0.1"  # loopback by default; 0.0.0.0 exposes the server to the network
    port: int = 8000  # 0 = any free port (written to <run>/SERVE_FILE)
    max_batch: int = 16  # requests decoded together in one generation loop
    device: str = "auto"  # auto (the accelerator torch finds, else the CPU) | cpu | a device type
    max_prompt_tokens: int = 0  # 0 = model.seq_len
    max_new_tokens: int = 256
    token_env: str = "XIRANG_SERVE_TOKEN"  # bearer token read from this env var; unset or empty = no auth
    # Named API keys for a server several people use (xirang_hpc/serve/keys.py): a JSON file, mode 0600, each
    # key with the runs it may use; its name goes to the access log and the run's audit trail. "" = none.
    keys_file: str = ""
    # /metrics needs a key when keys are configured, unless this is set (a Prometheus scraper without one).
    metrics_public: bool = False
    duration_s: float = 0.0  # 0 = serve until interrupted; > 0 = stop after this long (smoke runs, tests)
    # A request whose headers or body have not fully arrived this many seconds after the connection
    # opened (or after the previous response) is answered 408 / closed: half-sent requests cannot pin
    # connections. Also the idle keep-alive time of a connection.
    read_timeout_s: float = 30.0
    model_name: str = ""  # the model id of the OpenAI-compatible API; "" = the run directory's name
    # LoRA adapters served over the model, name -> PEFT adapter directory (xirang_hpc/serve/adapters.py): a request
    # whose OpenAI "model" field names one is answered with it; the base model keeps its own id.
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_finite("serve", self)
        if not self.read_timeout_s > 0:
            raise ConfigError("serve.read_timeout_s", self.read_timeout_s,
                              "use a number of seconds > 0 (how long a request may take to arrive)")
        if not 0 <= self.port < 65536:
            raise ConfigError("serve.port", self.port, "use a TCP port in [0, 65535] (0 = any free port)")
        for name in ("max_batch", "max_new_tokens"):
            check_positive("serve", name, getattr(self, name))
        for name, path in self.adapters.items():
            if not ADAPTER_NAME.match(str(name)):
                raise ConfigError(f"serve.adapters.{name}", path, "name an adapter with letters, digits, '.', '_' or "
                                  "'-' (it is what a request's model field says)")
            if not is_peft_dir(path):
                raise ConfigError(f"serve.adapters.{name}", path, "point it at a PEFT adapter directory "
                                  "(adapter_config.json + adapter_model.safetensors; xirang-ckpt export RUN "
                                  "--format peft writes one)")
        if self.max_prompt_tokens < 0 or self.duration_s < 0:
            raise ConfigError("serve.max_prompt_tokens/duration_s", (self.max_prompt_tokens, self.duration_s),
                              "use 0 or more")
