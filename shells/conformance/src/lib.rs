//! The store port's conformance suite (docs/scaleout.md): every case
//! drives a backend through `StoreOp`s only and observes it through
//! their completions, so the SQLite store and the PostgreSQL store run
//! exactly the same tests.
//!
//! A backend's test file instantiates the suite with a function that
//! returns a fresh, empty backend:
//!
//! ```ignore
//! rvbox_conformance::suite!(fresh);
//! ```
//!
//! or, inside one test that owns a shared resource, with [`run_suite!`]
//! (or a subset of the cases by name with [`run_cases!`]). The cases over
//! the control reads ([`read_suite!`]) take a backend with its reads; the
//! terminal cases ([`pty_suite!`]) take a function that makes one from
//! the store options they need ([`pty::options`]).
//!
//! Must never: reach into a backend's tables or files; every fact a case
//! asserts is one the port answers.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::missing_panics_doc
)]

pub mod cases;
pub mod fleet;
pub mod pty;
pub mod reads;
pub mod support;

pub use rvbox_store_port::ops::Backend;

/// Every case of the suite, each its own `#[test]` function over
/// `$fresh()`.
#[macro_export]
macro_rules! suite {
    ($fresh:path) => {
        $crate::__every_case!(tests[$fresh]);
    };
}

/// Runs every case of the suite, each on its own `$fresh()` backend,
/// inside the caller's test (for backends that share one costly resource,
/// such as a database server, between the cases); every case runs, and
/// the test fails naming each case that failed.
#[macro_export]
macro_rules! run_suite {
    ($fresh:expr) => {
        $crate::__every_case!(run[$fresh])
    };
}

/// Runs the named cases, each on its own `$fresh()` backend, and fails
/// naming each case that failed.
#[macro_export]
macro_rules! run_cases {
    ($fresh:expr; $($case:ident),* $(,)?) => {{
        let mut failed: Vec<&str> = Vec::new();
        $(
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut backend = $fresh();
                $crate::cases::$case(&mut backend);
            }));
            if ran.is_err() {
                failed.push(stringify!($case));
            }
        )*
        assert!(failed.is_empty(), "conformance cases failed: {failed:?}");
    }};
}

/// The list of cases, handed to one of the forms above.
#[doc(hidden)]
#[macro_export]
macro_rules! __every_case {
    ($how:ident [$($fresh:tt)+]) => {
        $crate::__cases_as!(
            $how [$($fresh)+];
            register_installs_a_live_session_and_a_newer_one_fences_it,
            register_refuses_a_stale_decision_and_changes_nothing,
            a_refused_live_claim_is_recorded_and_cleared_by_that_instance,
            close_session_ends_the_live_session_once,
            run_command_is_idempotent_by_request_id,
            run_command_refuses_a_reused_request_id_with_other_content,
            dispatch_and_acceptance_check_the_revision_they_saw,
            requeue_returns_a_dispatched_command_to_the_queue,
            a_rejection_ends_a_dispatched_command,
            every_connection_write_is_refused_once_its_session_is_not_live,
            every_connection_write_commits_with_its_live_session,
            a_fenced_write_in_a_batch_leaves_the_others_alone,
            reads_answer_what_dispatch_and_reconciliation_need,
            expiry_lists_due_commands_and_the_pending_mark_ends_it,
            a_script_is_read_back_by_range,
            signals_cancel_queued_work_and_are_delivered_to_held_work,
            stdin_writes_are_numbered_settled_by_acks_and_closed_once,
            a_takeover_grant_admits_exactly_the_pending_claim_once,
            maintenance_reclaims_aged_terminal_commands_keeping_their_tombstones,
            maintenance_prunes_idle_clients_above_their_generations,
            incident_requests_name_what_is_wrong,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __cases_as {
    (tests [$fresh:path]; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let mut backend = $fresh();
                $crate::cases::$case(&mut backend);
            }
        )*
    };
    (run [$fresh:expr]; $($case:ident),* $(,)?) => {
        $crate::run_cases!($fresh; $($case),*)
    };
}

/// Every case over the control reads, each its own `#[test]` function over
/// `$fresh()` (a backend with its reads, [`reads::WithReads`]).
#[macro_export]
macro_rules! read_suite {
    ($fresh:path) => {
        $crate::__every_read_case!(tests[$fresh]);
    };
}

/// Runs every case over the control reads, as [`run_suite!`] does.
#[macro_export]
macro_rules! run_read_suite {
    ($fresh:expr) => {
        $crate::__every_read_case!(run[$fresh])
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __every_read_case {
    ($how:ident [$($fresh:tt)+]) => {
        $crate::__read_cases_as!(
            $how [$($fresh)+];
            output_pages_return_every_byte_once_and_end_for_an_ended_command,
            follow_history_continues_after_any_cursor,
            a_command_record_says_what_happened_to_it,
            commands_are_listed_newest_first_page_by_page,
            clients_are_listed_by_id_page_by_page,
            a_client_is_read_with_its_session_claim_and_grant,
            incidents_are_listed_newest_first_page_by_page,
            a_fleet_run_releases_at_its_rate_and_ends_once_every_target_has,
            fleet_actions_pause_resume_signal_and_cancel_once_each,
            a_client_registering_in_a_late_window_becomes_a_target,
            an_open_incident_refuses_the_writes_of_its_scope_until_acknowledged,
            events_lost_by_the_store_after_acknowledgement_are_a_recorded_truncation,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __read_cases_as {
    (tests [$fresh:path]; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let mut backend = $fresh();
                $crate::reads::$case(&mut backend);
            }
        )*
    };
    (run [$fresh:expr]; $($case:ident),* $(,)?) => {{
        let mut failed: Vec<&str> = Vec::new();
        $(
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut backend = $fresh();
                $crate::reads::$case(&mut backend);
            }));
            if ran.is_err() {
                failed.push(stringify!($case));
            }
        )*
        assert!(failed.is_empty(), "conformance cases failed: {failed:?}");
    }};
}

/// Every terminal case, each its own `#[test]` function over
/// `$fresh(rvbox_conformance::pty::options())` (a backend with its reads,
/// made with the store options the cases need).
#[macro_export]
macro_rules! pty_suite {
    ($fresh:path) => {
        $crate::__every_pty_case!(tests[$fresh]);
    };
}

/// Runs every terminal case, as [`run_suite!`] does, each on
/// `$fresh(rvbox_conformance::pty::options())`.
#[macro_export]
macro_rules! run_pty_suite {
    ($fresh:expr) => {
        $crate::__every_pty_case!(run[$fresh])
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __every_pty_case {
    ($how:ident [$($fresh:tt)+]) => {
        $crate::__pty_cases_as!(
            $how [$($fresh)+];
            a_terminal_open_is_idempotent_bounded_and_needs_a_known_client,
            a_terminal_open_carries_its_profiles_as_a_sorted_set,
            terminal_input_is_numbered_once_and_pending_until_acknowledged,
            terminal_output_is_recorded_once_by_offset_and_losses_are_cuts,
            a_fenced_session_applies_no_terminal_report,
            a_terminal_recording_keeps_its_cap_and_says_what_it_dropped,
            a_recording_gets_only_what_the_client_quota_leaves,
            terminals_resize_close_and_the_idle_pass,
            terminals_are_listed_newest_first_page_by_page,
            a_closed_terminal_goes_with_its_recording_after_the_retention,
            a_client_with_a_terminal_is_not_pruned_as_idle,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __pty_cases_as {
    (tests [$fresh:path]; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                let mut backend = $fresh($crate::pty::options());
                $crate::pty::$case(&mut backend);
            }
        )*
    };
    (run [$fresh:expr]; $($case:ident),* $(,)?) => {{
        let mut failed: Vec<&str> = Vec::new();
        $(
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut backend = ($fresh)($crate::pty::options());
                $crate::pty::$case(&mut backend);
            }));
            if ran.is_err() {
                failed.push(stringify!($case));
            }
        )*
        assert!(failed.is_empty(), "conformance cases failed: {failed:?}");
    }};
}
