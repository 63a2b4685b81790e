"""Which test modules `make test` runs twice, with the native backends and then with numba as the default backend,
and which once (NOTE: [two passes]); tests/conftest.py marks the latter `once`, tests/test_passes.py keeps the lists
whole."""

# NOTE: [two passes]
# `make test` runs the suite twice: with the native backends, then with NANSCAN_BACKEND=numba, which makes numba the
# default backend (the fallback a machine without a C++ compiler runs on). The second pass runs only the modules in
# BOTH_PASSES: those whose subject takes another path when the default backend is numba. That is the selection and
# the public scan; the Monitor's every-step check, which on the cpu backend is one native call (plan check, scan,
# step summary) and otherwise Python around a numba scan, and all it keeps from it (history, window, spikes); the
# tools that run the Monitor's scans again (replay, ablate, the window's rerun); and the ranks' agreement. Every
# other module is marked `once` (it runs in the native pass only) for one of three reasons: it names the backends it
# checks itself (the native pass already runs its numba cases), or its subject only reads records and bundles, which
# the agreement tests prove equal across backends (`==`), or its subject is a framework's hooks, run once against
# the real framework (the Monitor beneath them is BOTH_PASSES' subject). Every test module is in exactly one of the
# two lists (tests/test_passes.py), so a new one must be placed, with its reason.
BOTH_PASSES = {
    "test_ablate": "reruns the bundle's step with one factor changed, scanning it as replay does",
    "test_amp": "the Monitor under GradScaler: overflow skips read from the check's records",
    "test_async": "the Monitor's async mode: verdicts read a step later from the default backend's records",
    "test_backends": "the selection itself: backend= over NANSCAN_BACKEND over auto",
    "test_bitwise": "replay's reruns compared bit for bit with the record, through the default backend's scans",
    "test_batch_plan": "the Monitor's batch inputs, compared with the default backend's scan of fresh ones",
    "test_compact": "the history ring under a Monitor whose compact records come from either path",
    "test_compile": "the Monitor over torch.compile'd models",
    "test_dated_updates": "the Monitor's post-update stamps and the check that dates a write",
    "test_distributed": "the ranks' agreement on each rank's own scan (DDP, FSDP2)",
    "test_elevated": "the elevated rule, on the spike statistic the check's summary feeds",
    "test_growth": "the growth rule, on the spike statistic the check's summary feeds",
    "test_ignored_targets": "targets named as the cause in the incident and in replay, which scans the rerun step",
    "test_micro_batches": "the Monitor's per-micro-batch checks",
    "test_monitor": "the Monitor's check, verdicts and policies",
    "test_nanogpt_window": "the window kept by the Monitor, rerun and ablated",
    "test_not_reproduced": "replay's verdict on a fault outside the entry, from its rerun's scans",
    "test_observe": "Monitor.observe between the checks of a step",
    "test_overflow_onset": "replay's localization of an overflow by scans of module outputs",
    "test_readme": "the README's quickstart loop under the default backend, as a user runs it",
    "test_real_failures": "real failures caught by a Monitor and replayed",
    "test_replay": "replay scans every rerun step and localizes with scans",
    "test_replay_precision": "replay, ablation and export rerun under the run's precision, scanned",
    "test_replay_window": "the window's rerun, matched against its recorded history",
    "test_replicas": "the ranks' replica agreement on the fingerprints in each rank's own scan records (DDP)",
    "test_rollback": "the Monitor's rollback to the window's states, decided by its check's verdict",
    "test_scan_api": "nanscan.scan through the default backend, as users call it",
    "test_scan_plan": "the Monitor's every-step inputs against a fresh scan",
    "test_spikes": "spike detection on the statistic the check's summary feeds",
    "test_tensor_source": "the Monitor scanning a source's tensors",
    "test_train_py": "the window and the update factors kept by the Monitor on train.py's loop, rerun and ablated",
    "test_window": "the run's window as the Monitor keeps it, step by step",
}
NATIVE_PASS_ONLY = {
    "test_rollback_sharded": "rollback of FSDP2 and HSDP shards: the window's loads back into the DTensors",
    "test_checkpoint": "a bundle's state written as a DCP checkpoint: reads bundles, scans nothing",
    "test_optimizer_containers": "which optimizer a Monitor checks when given a container of them",
    "test_amp_ranks": "GradScaler overflow skips agreed across DDP ranks; the skip decision is test_amp's",
    "test_resume": "on_invalid=Resume: the incident decided as test_rollback's, then a DCP checkpoint and an exit",
    "test_replicas_mesh": "the replica sets of DTensors (HSDP, tensor parallelism); the fingerprints they compare are "
                          "test_replicas' subject in both passes",
    "test_agreement": "names every backend it checks",
    "test_bundle": "the bundle's format, on a Monitor's bundles",
    "test_bundle_history": "the history's on-disk encoding of records",
    "test_carried_records": "the cpu backend's carried records, named explicitly",
    "test_check_moment": "a framework's hooks (the HF Trainer's clipping)",
    "test_classify": "classify.h through nanscan._C",
    "test_cli_help": "the command line's help",
    "test_cuda": "names the CUDA backend (and its host twin)",
    "test_data_api": "data checks read records",
    "test_data_fastpath": "data checks read records",
    "test_data_formats": "data checks read records",
    "test_data_overflow": "data checks read records",
    "test_data_tokens": "token counts, no scan",
    "test_data_training_fields": "data checks read records",
    "test_deepspeed": "a framework's hooks (DeepSpeed ZeRO)",
    "test_deepspeed_trainers": "a framework's hooks (DeepSpeed under the trainers' plugins)",
    "test_demo": "the command line's workflow end to end; its Monitor and replay are BOTH_PASSES' subject",
    "test_diagnosis_ranks": "the in-process diagnosis on two gloo ranks; the scans it runs are test_incident_diagnosis'"
                            " subject in both passes",
    "test_divergence": "reads the history of a bundle (INCIDENT.md, report)",
    "test_export": "export-regression's files",
    "test_export_tb": "TensorBoard and table export of records",
    "test_export_wandb": "W&B export of records",
    "test_fingerprint": "names every backend it checks",
    "test_float8_scan": "names every backend it checks",
    "test_frozen_bundle": "the bundle's references to frozen weights",
    "test_frozen_peft": "a framework's model (PEFT), the cpu backend named",
    "test_frozen_records": "the cpu backend's frozen records, named explicitly",
    "test_headroom": "headroom read from records' histograms",
    "test_incident_diagnosis": "the Monitor's in-process diagnosis, the window's ablation run in the process; the "
                               "window rerun's scans it judges by are test_nanogpt_window's and test_train_py's "
                               "subject in both passes",
    "test_install": "what pip install builds",
    "test_integrations_accelerate": "a framework's hooks (accelerate)",
    "test_integrations_lightning": "a framework's hooks (Lightning)",
    "test_integrations_rebuild": "the integrations' framework-free parts",
    "test_integrations_transformers": "a framework's hooks (the HF Trainer)",
    "test_layout": "the package's structure",
    "test_many_tensors": "names every backend it checks",
    "test_native_build": "nanscan._C and its builds",
    "test_numba_cuda": "names the numba-cuda backend",
    "test_numba_residues": "names the numba backend's counters",
    "test_numba_squares": "names the numba backend",
    "test_passes": "this classification",
    "test_preflight": "the preflight tool's verdicts",
    "test_provenance": "provenance records and atomic writes",
    "test_quarantine": "the quarantine file and its dataset wrappers; the replay naming the records is BOTH_PASSES'",
    "test_report": "reads bundles",
    "test_report_replicas": "reads a replica-mismatch bundle set; the agreement that writes it is test_replicas' "
                            "subject in both passes",
    "test_rollback_data": "what a rollback does to the loop's data and updates; the verdicts that decide it are "
                          "test_rollback's subject in both passes",
    "test_rollback_ranks": "a rollback's agreement and quarantine across DDP ranks; the verdicts that decide it are "
                           "test_rollback's subject in both passes",
    "test_rollback_recovery": "training around a rollback, measured; the verdicts that decide it are test_rollback's "
                              "subject in both passes",
    "test_incident_rerun": "the Monitor's in-process rerun of a step; the scans it localizes with are test_backends' "
                           "subject in both passes (bit for bit against the reference)",
    "test_runs": "reads run records",
    "test_scan_table": "nanscan._C.ScanTable, the cpu backend named",
    "test_step_summary": "the cpu backend's step summary, named explicitly",
    "test_trainers_second_pass": "a framework's hooks (transformers, Lightning, accelerate)",
    "test_triage": "reads bundles",
    "test_trust": "the trust rule on bundles' manifests",
    "test_workflow": "the command line's workflow from a new user's seat",
    "test_write_faults": "bundle writes under I/O faults",
}
