"""The lm-evaluation-harness child process: ``python -m xirang_hpc.eval.harness_child`` with a JSON request on
stdin (see :func:`xirang_hpc.eval.harness.run_lm_eval`), ``lm_eval.simple_evaluate`` run in an environment made
offline by its parent; results and per-document samples are written to ``request["output"]`` as JSON.

A separate process because the Hugging Face libraries read their offline switches when first imported.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main() -> None:
    """Read the request, evaluate, write the results."""
    req: dict[str, Any] = json.loads(sys.stdin.read())
    if req.get("api_key"):  # local-completions sends $OPENAI_API_KEY as its bearer token
        os.environ["OPENAI_API_KEY"] = req["api_key"]
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    tm = TaskManager(include_path=req.get("include_path") or None, include_defaults=False)
    res = lm_eval.simple_evaluate(model=req["model"], model_args=req["model_args"], tasks=req["tasks"],
                                  num_fewshot=req.get("num_fewshot"), limit=req.get("limit"),
                                  batch_size=req.get("batch_size"), task_manager=tm, log_samples=True,
                                  bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)
    if res is None:
        raise SystemExit("lm_eval returned no results")
    samples = {task: [{"doc_id": s.get("doc_id"), "target": s.get("target"), "resps": s.get("resps"),
                       "filtered_resps": s.get("filtered_resps"),
                       **{k: s[k] for k in ("acc", "acc_norm", "exact_match") if k in s}}
                      for s in rows] for task, rows in res.get("samples", {}).items()}
    out = {"results": res["results"], "n_samples": res.get("n-samples", {}), "samples": samples,
           "lm_eval_version": getattr(lm_eval, "__version__", None)}
    with open(req["output"], "w") as f:
        json.dump(out, f, default=handle_non_serializable)


if __name__ == "__main__":
    main()
