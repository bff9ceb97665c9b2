"""Several Slurm clusters as one: placement on the site that starts a job soonest, and moving a run.

Built on Slurm's own multi-cluster operation (clusters registered in one slurmdbd, ``-M <cluster>``):

- :func:`place` asks every site of ``cluster.sites`` for its expected start with
  ``sbatch --test-only -M <site>`` (one tiny call, :func:`test_only`), and picks one by
  ``cluster.site_policy``: ``earliest`` start; ``quota`` (most free CPUs in the account's GrpTRES
  limit on that site, earliest start among equals); ``stay`` (the current site unless another starts
  the job more than ``cluster.site_stay_s`` sooner). A site that does not answer is left out with a
  warning naming it; no site answering raises :class:`NoSiteAvailable` (nothing is submitted). A site
  name slurmdbd does not know is refused, listing the registered ones.
- :func:`copy_run` moves a run to another site's run root when the sites do not share a filesystem:
  the newest checkpoint that verifies at the source (plus the steps it references) is copied under a
  temporary name, verified against its manifest's checksums at the destination, and only then renamed
  into place; the run's records follow. A copy interrupted at any point leaves only a temporary
  (``step_N.tmp-copy-...``) that nothing loads and the next start removes.
- :func:`should_migrate` is the trigger: a run preempted on its site moves when its requeue there
  would wait longer than ``cluster.site_migrate_wait_s`` and another site starts it sooner.
  :func:`migrate_at_preemption` is the job's own move (called by the batch script's supervisor at a
  preemption; the current site's wait from :func:`held_until`, the preemptor's end);
  :func:`migrate` the same by hand for a run already requeued.

The choice and its evidence (expected start per site) go to ``events.jsonl`` (kind ``placement``);
a copy records its step, bytes and seconds (kind ``migrate_copy``).
"""

from __future__ import annotations

from xirang_hpc.submit.sites.moves import (
    SITE_FILE,
    cancel_on,
    held_until,
    hostnames,
    main,
    migrate,
    migrate_at_preemption,
    read_site_state,
    should_migrate,
    write_site_state,
)
from xirang_hpc.submit.sites.placement import (
    MOVE_GRACE_S,
    TEST_ONLY_TIMEOUT_S,
    Estimate,
    NoSiteAvailable,
    Placement,
    apply_site,
    check_registered,
    choose,
    free_quota_cpus,
    gather,
    grace_warning,
    parse_test_only,
    place,
    place_for_launch,
    record_placement,
    registered_clusters,
    site_cluster,
    site_of,
    test_only,
    test_only_argv,
)
from xirang_hpc.submit.sites.transfer import (
    CKPT_DIR,
    Copier,
    CopyError,
    CopyResult,
    copy_run,
    newest_good_step,
    site_run_dir,
)

__all__ = [
    "MOVE_GRACE_S",
    "grace_warning",
    "CKPT_DIR",
    "Copier",
    "CopyError",
    "CopyResult",
    "Estimate",
    "NoSiteAvailable",
    "Placement",
    "SITE_FILE",
    "TEST_ONLY_TIMEOUT_S",
    "apply_site",
    "cancel_on",
    "check_registered",
    "choose",
    "copy_run",
    "free_quota_cpus",
    "gather",
    "held_until",
    "hostnames",
    "main",
    "migrate",
    "migrate_at_preemption",
    "newest_good_step",
    "parse_test_only",
    "place",
    "place_for_launch",
    "read_site_state",
    "record_placement",
    "registered_clusters",
    "should_migrate",
    "site_cluster",
    "site_of",
    "site_run_dir",
    "test_only",
    "test_only_argv",
    "write_site_state",
]
