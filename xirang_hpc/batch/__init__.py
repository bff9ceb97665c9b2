"""Inside the allocation, before and after the ranks: the batch step's supervisor (requeue policy,
migration at preemption), the in-job restart loop, and the rank entry of a hand-submitted script.
Torch-free: the rank entry loads the training stack by name on the rank itself."""
