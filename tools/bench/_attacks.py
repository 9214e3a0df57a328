"""The rows of the attack and fault suite: every attack tried on FreeRide and the tests that reproduce it.

tools/bench/attack_suite.py runs the tests and prints the table docs/security.md keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ATTACKS", "Attack"]


@dataclass(frozen=True, slots=True)
class Attack:
    """One attack or fault, what holds it off, and the tests that reproduce it."""

    id: str
    """Where it was reported: issue number and item."""
    attack: str
    defence: str
    tests: tuple[str, ...] = ()
    """Pytest node ids (``path::function``)."""
    measured: str = ""
    """For an attack measured by a benchmark rather than tested: the command and where its figure is."""
    needs: str = ""
    """What some of its tests need to run (root, a memory cgroup, Ray...), skipped without."""


_SEC_U = "tests/unit/test_security_rules.py::"
_SEC_I = "tests/ipc/test_security.py::"
_EDGE = "tests/unit/test_edge.py::"
_FLOOD = "tests/ipc/test_flood.py::"
_LIVE_I = "tests/ipc/test_liveness.py::"
_LIVE_U = "tests/unit/test_liveness_rules.py::"
_PROGS = "tests/ipc/test_liveness_programs.py::"
_LEDGER = "tests/unit/test_cluster_ledger.py::"
_RAY = "tests/ipc/test_cluster_ray.py::"
_SHARED = "tests/unit/test_shared_checkpoints.py::"

ATTACKS: tuple[Attack, ...] = (
    Attack(
        "13.1a",
        "another user creates the runtime dir (or a link to it) first",
        "an existing runtime dir must be ours, a real dir and 0700; serve refuses otherwise",
        (
            _SEC_U + "test_a_runtime_dir_planted_by_another_user_is_refused",
            _SEC_U + "test_a_symlink_planted_by_another_user_is_refused",
            _SEC_U + "test_a_file_in_place_of_the_dir_is_refused",
            _SEC_U + "test_a_state_dir_may_be_readable_but_not_writable_by_others",
            _SEC_I + "test_a_runtime_dir_planted_by_another_user_is_refused",
        ),
        needs="root (a second uid)",
    ),
    Attack(
        "13.1a",
        "a planted checkpoint (a pickle) runs code in the worker",
        "torch.load(weights_only=True) with declared types; an unsafe file fails its own task",
        (
            "tests/unit/test_security_checkpoints.py::test_a_planted_pickle_is_refused_and_runs_nothing",
            "tests/unit/test_security_checkpoints.py::test_a_file_that_is_no_worker_checkpoint_is_refused",
            _SEC_I + "test_a_planted_checkpoint_fails_its_task_alone_and_runs_nothing",
        ),
    ),
    Attack(
        "13.1b",
        "any local user submits and fakes bubbles over unauthenticated tcp; 0.0.0.0 accepted",
        "tcp only with CURVE keys; ZAP admits authorized client keys; serve --tcp without keys refused",
        (
            _SEC_U + "test_tcp_endpoints_without_keys_are_refused_loopback_or_not",
            _SEC_U + "test_curve_clients_by_public_key_only",
            _SEC_U + "test_keys_in_a_dir_open_to_others_are_refused",
            _SEC_I + "test_tcp_on_all_interfaces_without_keys_is_refused",
            _SEC_I + "test_curve_tcp_answers_its_clients_and_nobody_else",
            _SEC_I + "test_cli_submit_and_status_over_curve_tcp",
        ),
    ),
    Attack(
        "13.1c",
        "the runtime dir comes out 0755 under umask 022",
        "created 0700 whatever the umask; one open to others is refused, naming the chmod",
        (
            _SEC_U + "test_a_new_runtime_dir_is_0700_whatever_the_umask",
            _SEC_U + "test_a_runtime_dir_open_to_others_is_refused_with_what_to_do",
            _SEC_I + "test_a_new_runtime_dir_is_private_even_under_umask_022",
            _SEC_I + "test_a_runtime_dir_open_to_others_is_refused",
        ),
    ),
    Attack(
        "13.1c",
        "another uid connects to an ipc socket through a dir the user opened",
        "a ZAP handler on every socket admits only the manager's uid (SO_PEERCRED)",
        (
            _SEC_U + "test_ipc_peers_of_the_managers_uid_only",
            _SEC_I + "test_the_peer_uid_check_is_consulted_on_ipc",
            _SEC_I + "test_another_uid_gets_no_answer_on_ipc_even_through_an_open_dir",
        ),
        needs="root, and an interpreter uid 65534 may run, for the last",
    ),
    Attack(
        "13.1d",
        "a uvloop.py planted in the manager's working directory runs in the worker",
        "workers run python -P in their task's own work dir",
        (_SEC_I + "test_a_planted_uvloop_in_the_managers_cwd_is_not_imported",),
    ),
    Attack(
        "13.2",
        "well-formed frames with hostile values (2**64-1 ns) crash the manager",
        "every field bounded at decode, sums saturate; the frame is counted as rejected",
        (
            _FLOOD + "test_overflowing_values_are_rejected_and_counted_and_status_still_answers",
            _EDGE + "test_an_event_with_a_value_out_of_bounds_does_not_decode",
            _EDGE + "test_sums_saturate_at_the_largest_value_the_wire_carries",
            _EDGE + "test_a_bubble_expected_to_last_forever_gets_a_deadline_the_wire_carries",
        ),
    ),
    Attack(
        "13.3",
        "a Hello flood exhausts file descriptors (a pidfd per rank)",
        "at most 256 ranks; pidfds closed as ranks are replaced, lost or leave",
        (
            _FLOOD + "test_a_hello_flood_keeps_open_fds_bounded",
            _EDGE + "test_a_hello_flood_holds_at_most_max_ranks_pidfds",
            "tests/unit/test_ranks.py::test_a_restarted_rank_replaces_its_record_and_its_pidfd_is_closed",
        ),
    ),
    Attack(
        "13.3",
        "a new device name per event grows memory without bound",
        "at most 512 devices",
        (
            _FLOOD + "test_a_new_device_name_per_event_keeps_the_tables_bounded",
            _EDGE + "test_a_new_device_name_per_event_keeps_the_table_bounded",
            _EDGE + "test_a_device_table_full_of_live_devices_refuses_a_new_name",
        ),
    ),
    Attack(
        "13.3",
        "frames and strings of any size",
        "ZMQ_MAXMSGSIZE per socket; bounded strings, lists and maps",
        (
            _FLOOD + "test_an_oversized_frame_is_refused_and_the_manager_goes_on",
            _FLOOD + "test_an_oversized_control_request_does_not_cost_the_answer_to_others",
            _EDGE + "test_worker_and_control_frames_are_bounded_too",
        ),
    ),
    Attack(
        "13.4",
        "an event flood starves the control socket",
        "each of the manager's loops takes at most 64 queued messages, then yields",
        (_FLOOD + "test_status_answers_while_a_flood_goes_on",),
        measured="status p99 under 100k events/s: tools/bench/flood.py (docs/benchmarks.md)",
    ),
    Attack(
        "13.5",
        "a task hung in a step keeps its grants; cancelling it blocks control",
        "a hung step is detected, the worker killed and restarted from its checkpoint; cancel answers at once",
        (
            _LIVE_I + "test_a_hung_step_is_detected_and_restarted_while_a_healthy_task_keeps_stepping",
            _LIVE_I + "test_cancelling_a_hung_task_answers_at_once",
            _LIVE_U + "test_a_task_stuck_in_a_step_gets_no_further_grants_and_the_healthy_one_does",
            _LIVE_U + "test_a_step_past_its_grace_that_does_not_compute_is_hung",
        ),
    ),
    Attack(
        "13.6",
        "a checkpoint that fits no bubble never happens; SIGKILL loses everything",
        "a loss bound (steps or step time) forces a checkpoint at a bubble's start",
        (
            _LIVE_I + "test_a_task_whose_checkpoint_fits_no_bubble_loses_at_most_the_bound_to_sigkill",
            _LIVE_U + "test_a_checkpoint_that_fits_no_bubble_is_forced_at_a_bubble_start_by_the_step_bound",
            _LIVE_U + "test_the_time_bound_counts_step_time_since_the_last_checkpoint",
        ),
    ),
    Attack(
        "13.7, 30.7",
        "a task without a declared peak runs uncapped",
        "every task gets a cap: declared, the device's spare memory, or a share of what is free",
        (
            _LIVE_I + "test_a_task_without_a_declared_peak_is_still_capped_and_fails_alone",
            "tests/unit/test_serve_declarations.py::test_a_task_without_a_peak_is_capped_even_before_its_stage_says_what_it_spares",
            "tests/unit/test_serve_declarations.py::test_a_program_without_a_peak_is_capped_like_any_task",
        ),
    ),
    Attack(
        "13.7",
        "a cap applied before import torch stops a task that imports it late",
        "torch is imported before the cap",
        (_LIVE_I + "test_a_task_that_imports_torch_after_the_cap_runs",),
    ),
    Attack(
        "13.7",
        "a program declared at 200 MB reaches 1.2 GB",
        "a cgroup per program, memory.max at the declared peak",
        (_PROGS + "test_a_program_over_its_declared_peak_fails_near_it",),
        needs="a memory cgroup (else RLIMIT_AS, looser)",
    ),
    Attack(
        "13.8",
        "a second serve silently takes a running manager's sockets",
        "flock on serve.lock; the second serve is refused, naming the first",
        (
            _SEC_U + "test_a_second_serve_lock_is_refused_naming_the_holder",
            _SEC_I + "test_a_second_serve_on_the_same_runtime_dir_is_refused",
        ),
    ),
    Attack(
        "13.8",
        "a child that calls setsid escapes SIGSTOP and SIGKILL",
        "a cgroup per program: the whole group is frozen or killed",
        (_PROGS + "test_a_setsid_child_is_stopped_and_killed_with_its_program",),
        needs="a writable cgroup",
    ),
    Attack(
        "13.8",
        "submit imports the target's package on the manager's loop",
        "only the top-level package is looked up",
        ("tests/unit/test_liveness_misc.py::test_submit_checks_a_target_without_importing_it",),
    ),
    Attack(
        "13.8",
        "a full disk breaks checkpoints for good",
        "a failed write keeps the old file, is reported and retried",
        (
            _LIVE_U + "test_a_failed_checkpoint_is_reported_the_task_goes_on_and_it_is_retried",
            "tests/unit/test_atomic_files.py::test_a_failed_write_keeps_the_old_file_and_leaves_nothing",
        ),
    ),
    Attack(
        "13.8",
        "restarts without backoff",
        "restart delay doubles from 1 s to 60 s, shown in status",
        (
            _LIVE_I + "test_restarts_back_off_exponentially_up_to_the_bound",
            _LIVE_U + "test_restart_delay_doubles_and_is_bounded",
        ),
    ),
    Attack(
        "13.8",
        "finished programs leave their watchdogs",
        "watchdogs are killed and reaped with their program",
        (_PROGS + "test_no_watchdog_is_left_once_a_program_has_finished",),
    ),
    Attack(
        "13.8",
        "wrong-version and unknown-worker frames flood the log",
        "such logs are sampled",
        (
            _EDGE + "test_a_wrong_version_flood_is_logged_sampled",
            _EDGE + "test_unknown_worker_messages_are_logged_sampled",
        ),
    ),
    Attack(
        "13.8",
        "freeride demo leaves its runtime dir behind; the task table grows for ever",
        "the demo removes its dir; the 1,000 latest ended tasks are kept",
        (
            "tests/unit/test_liveness_misc.py::test_the_demo_removes_its_runtime_directory",
            _EDGE + "test_ended_tasks_beyond_the_bound_are_dropped",
        ),
    ),
    Attack(
        "13.8",
        "escape sequences in names drive the terminal through status",
        "control characters escaped in status; the live view shows markup, never obeys it",
        (
            _EDGE + "test_status_text_escapes_control_characters_and_json_stays_exact",
            "tests/unit/test_watch.py::test_names_from_other_processes_cannot_drive_the_terminal",
        ),
    ),
    Attack(
        "30.1",
        "clients talk to a socket in a runtime dir another user planted (secrets in a submit's environment)",
        "submit, status and cancel check the dir (owner, mode, link) and the socket's owner before connecting",
        (
            _SEC_I + "test_a_client_tells_a_socket_planted_in_another_users_dir_nothing",
            _SEC_I + "test_a_client_tells_a_socket_another_user_planted_in_its_own_dir_nothing",
        ),
        needs="root (a second uid)",
    ),
    Attack(
        "30.1",
        "a rank's emitter, its bubble publisher or `cluster join` talks to a runtime dir another user made",
        "emitters connect only once the dir exists and is checked; publishers bind only in a private dir of ours;"
        " join checks the manager's socket before Ray",
        (
            _SEC_I + "test_a_ranks_emitter_tells_a_dir_planted_after_it_started_nothing",
            _SEC_I + "test_a_rank_publishes_no_bubbles_in_a_dir_another_user_owns",
            _SEC_I + "test_cluster_join_tells_a_socket_planted_in_another_users_dir_nothing",
        ),
        needs="root (a second uid)",
    ),
    Attack(
        "30.1",
        "others may write the runtime dir's parent: rename and recreate it",
        "a runtime dir whose parent others may write (no sticky bit) is refused",
        (_SEC_I + "test_a_runtime_dir_whose_parent_others_may_write_is_refused",),
    ),
    Attack(
        "30.2",
        "a planted runtime dir stops freeride launch from training",
        "launch takes an unusable runtime dir for no manager and runs the training",
        (
            _SEC_I + "test_launch_beside_a_planted_runtime_dir_trains_without_freeride",
            "tests/ipc/test_launch_manager.py::test_a_manager_that_cannot_start_leaves_the_training_running",
        ),
        needs="root, for the first",
    ),
    Attack(
        "30.3",
        "a link planted in a shared checkpoint dir makes a save write through it",
        "saves go to a fresh O_EXCL temporary file renamed over the old one",
        ("tests/unit/test_atomic_files.py::test_a_link_planted_at_the_old_temporary_name_is_not_written_through",),
    ),
    Attack(
        "30.3",
        "another user swaps or plants a checkpoint in a shared checkpoint dir",
        "a checkpoint_dir must be ours or root's, sticky if others may write it; another user's file is not loaded",
        (
            _SHARED + "test_a_dir_others_may_write_without_the_sticky_bit_is_refused_at_submit",
            _SHARED + "test_cluster_submit_refuses_such_a_dir_before_any_queue_is_reached",
            _SHARED + "test_a_dir_another_user_owns_is_refused_even_if_private",
            _SHARED + "test_a_link_another_user_planted_in_place_of_the_dir_is_refused",
            _SHARED + "test_a_checkpoint_another_user_planted_in_a_sticky_dir_is_not_loaded",
            _SHARED + "test_a_link_another_user_planted_to_a_checkpoint_of_ours_is_not_loaded",
        ),
        needs="root (a second uid), for four",
    ),
    Attack(
        "30.4",
        "any Ray driver queues a program that a node runs",
        "a node leases programs only when started with --allow-programs; Ray's token auth (docs/cluster.md)",
        (
            _LEDGER + "test_a_node_leases_programs_only_when_it_allows_them",
            _RAY + "test_cancel_forged_reports_and_programs_on_a_real_ray_cluster",
        ),
        needs="Ray, for the second",
    ),
    Attack(
        "30.4",
        "any Ray driver queues a job (or changes one in the queue) and a node runs it",
        "nodes holding the cluster's secret run only jobs signed with it (HMAC of the whole spec); the rest fail unrun",
        (
            "tests/unit/test_cluster_signing.py::test_a_signed_spec_verifies_and_any_change_to_it_does_not",
            "tests/unit/test_cluster_signing.py::test_the_queue_carries_each_jobs_signature_to_its_lease",
            "tests/unit/test_cluster_signing.py::test_a_secret_others_may_read_or_that_holds_nothing_is_refused",
            _RAY + "test_cancel_forged_reports_and_programs_on_a_real_ray_cluster",
        ),
        needs="Ray, for the last",
    ),
    Attack(
        "30.4",
        "a Ray driver forges a running job's end, and its node cancels it",
        "a secret token per lease; forged reports are refused",
        (
            _LEDGER + "test_only_the_lease_holder_can_renew_it_or_say_how_it_ended",
            _RAY + "test_cancel_forged_reports_and_programs_on_a_real_ray_cluster",
        ),
        needs="Ray, for the second",
    ),
    Attack(
        "30.4",
        "a driver fills the queue (20,000 jobs in 7 s)",
        "at most 10,000 jobs a submission and 100,000 in the queue",
        (
            _LEDGER + "test_one_submission_queues_at_most_max_submit_jobs",
            _LEDGER + "test_the_queue_holds_at_most_max_jobs_whatever_the_submissions",
        ),
    ),
    Attack(
        "30.5",
        "a stale serve.lock whose pid was reused makes launch wait 60 s",
        "the pid in the lock counts only while its flock is held",
        ("tests/ipc/test_launch_manager.py::test_a_dead_managers_pid_given_to_another_process_is_not_waited_for",),
    ),
    Attack(
        "30.6",
        "a slow step is killed as hung at every restart",
        "a step still computing is slow, not hung: frozen between bubbles, it finishes in bubble time",
        (
            _LIVE_I + "test_a_slow_step_is_not_hung_it_finishes_in_bubbles_and_the_task_goes_on",
            _LIVE_U + "test_a_step_still_computing_past_its_grace_is_slow_it_runs_on_in_bubbles_only_and_alone",
        ),
    ),
    Attack(
        "30.6",
        "a hung task with only its first checkpoint cycles for ever",
        "a task that hangs again from the same checkpoint fails, with a reason",
        (
            _LIVE_I + "test_a_task_that_hangs_again_from_the_same_state_fails_instead_of_cycling",
            _LIVE_U + "test_a_task_that_hangs_again_from_the_same_checkpoint_is_not_restarted",
        ),
    ),
    Attack(
        "30.8",
        "a rank's first message (Hello) is dropped before the connection is up",
        "the rank waits for the connection once (at most 100 ms), then resends Hello until one goes out",
        (
            "tests/ipc/test_transport.py::test_a_ranks_first_message_waits_for_the_connection_and_is_not_dropped",
            "tests/ipc/test_transport.py::test_without_a_manager_socket_nothing_is_waited_for",
        ),
    ),
    Attack(
        "30.8",
        "a Hello the manager did not take (over its cap, busy) leaves it ignorant of the rank for 5 s",
        "the manager answers every rank it knows (a subscription on the rank's publisher); unanswered, a rank"
        " repeats its Hello every 250 ms",
        (
            "tests/ipc/test_hello_ack.py::test_a_hello_nobody_took_is_repeated_at_once_until_acknowledged",
            "tests/ipc/test_hello_ack.py::test_a_manager_answers_every_rank_it_knows_followed_or_not",
        ),
    ),
    Attack(
        "30.8",
        "status says nothing of why a rank in its first step announced no bubble",
        "status says the first step is warm-up",
        ("tests/unit/test_guard_options.py::test_status_says_why_a_rank_in_its_first_step_has_announced_no_bubble",),
    ),
    Attack(
        "30.9",
        "after a pipeline-size-1 job ends, a pending task is placed on its departed device",
        "a device whose ranks left takes no new task; the task says why it waits",
        ("tests/unit/test_manager_core.py::test_a_device_whose_job_ended_takes_no_new_task_and_says_why",),
    ),
    Attack(
        "30.10",
        "freeride profile stops a torchrun job with a traceback",
        "the profiler signals the ranks, which end with status 0",
        ("tests/ipc/test_launchers.py::test_profile_stops_a_torchrun_job_without_a_traceback",),
    ),
    Attack(
        "30.11",
        "a flood of 30k events/s cuts harvesting (goal: within 10 % of quiet)",
        "batches per loop; ipc ranks' bubbles on their own sockets; a device without side work only counts them",
        measured="tools/bench/flood.py --rounds 6: the manager's own share -9 % and -12 % (intervals include 0), the"
        " sender's -17 % and -25 % (docs/benchmarks.md, A flood at the manager's edge)",
    ),
)
"""Every attack and fault tried, in the order they were reported."""
