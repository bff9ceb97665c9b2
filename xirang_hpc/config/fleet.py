"""Published fleet failure data: the one source of the rates the requeue budget's defaults and the goodput
simulator (``planner/goodput_sim.py``) start from.

Llama 3 405B's interruptions ("The Llama 3 Herd of Models", Meta 2024, Sec. 3.3.4 and Table 5): 466 job
interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs (2,048 nodes of 8), 47 planned
(automated maintenance such as firmware upgrades, operator-initiated configuration or dataset updates) and
419 unexpected, which the paper puts at 78% confirmed or suspected hardware. Table 5's rows grouped into
the simulator's classes (the counts add up to 419; the table's percentages do not all match its counts,
the counts are used):

- hardware 314: faulty GPU 148, GPU HBM3 72, GPU SRAM 19, GPU system processor 17, silent data corruption 6,
  GPU thermal interface and sensor 6, host maintenance (unplanned) 32, SSD 3, power supply 3, server
  chassis 2, IO expansion board 2, CPU 2, system memory 2;
- network 42: network switch or cable 35, NIC 7;
- software 63: software bug 54, NCCL watchdog timeouts 7, dependency 2;
- planned 47.
"""

from __future__ import annotations

LLAMA3_COUNTS = {"hardware": 314, "network": 42, "software": 63, "planned": 47}
LLAMA3_GPUS, LLAMA3_GPUS_PER_NODE, LLAMA3_DAYS = 16384, 8, 54.0
LLAMA3_SOURCE = ("Llama 3 405B pre-training (The Llama 3 Herd of Models, Meta 2024, Sec. 3.3.4, Table 5): "
                 "466 interruptions in 54 days on 16,384 H100 GPUs, 47 planned, 419 unexpected")
# Tectonic, the file system Llama 3 checkpointed to (same paper, Sec. 3.3.1): 2 TB/s sustained, 7 TB/s peak.
LLAMA3_STORAGE_GBPS = 2000.0


def unplanned_per_node_day() -> float:
    """Llama 3's unexpected interruptions per node per day (419 / (2,048 nodes x 54 days) = 0.0038)."""
    unplanned = sum(v for k, v in LLAMA3_COUNTS.items() if k != "planned")
    return unplanned / (LLAMA3_GPUS // LLAMA3_GPUS_PER_NODE * LLAMA3_DAYS)
