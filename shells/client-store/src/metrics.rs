//! Client store metrics (plan §11.1): counters for every durable step that
//! fails and every recovery action, with bounded labels only (a step
//! name), never a command id. The client shell registers them.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// A recovery step (`tail_truncated`, `segment_damaged`, `orphan_removed`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StepLabel {
    /// Step name.
    pub step: &'static str,
}

/// Every client store metric. Cheap to clone (shared counters).
#[derive(Clone, Debug, Default)]
pub struct ClientStoreMetrics {
    /// Spool steps that failed (nothing of them durable).
    pub spool_failures: Counter,
    /// Acceptance transactions that failed.
    pub accept_failures: Counter,
    /// Commands finished into tombstones.
    pub tombstones_written: Counter,
    /// Tombstones rotated out of the FIFO.
    pub tombstones_rotated: Counter,
    /// Recovery actions, by step.
    pub recovery: Family<StepLabel, Counter>,
    /// Local incidents recorded.
    pub incidents: Counter,
    /// Wrapper files not written because the working directory resolved
    /// outside every allowed root (or not to a directory).
    pub wrapper_refusals: Counter,
    /// Script chunks refused (`invalid`: a chunk breaks the upload rules)
    /// and whole scripts whose SHA-256 or length did not match their
    /// descriptor (`mismatch`), by step.
    pub script_verification_failures: Family<StepLabel, Counter>,
}

impl ClientStoreMetrics {
    /// Registers every metric under `rvbox_client_store_`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("rvbox_client_store");
        r.register(
            "spool_failures",
            "Spool steps that failed; nothing of them is durable",
            self.spool_failures.clone(),
        );
        r.register(
            "accept_failures",
            "Acceptance transactions that failed (answered as transient refusals)",
            self.accept_failures.clone(),
        );
        r.register(
            "tombstones_written",
            "Acknowledged commands replaced by tombstones",
            self.tombstones_written.clone(),
        );
        r.register(
            "tombstones_rotated",
            "Tombstones rotated out of the FIFO",
            self.tombstones_rotated.clone(),
        );
        r.register(
            "recovery_actions",
            "Recovery actions at open, by step",
            self.recovery.clone(),
        );
        r.register(
            "incidents",
            "Local incidents recorded",
            self.incidents.clone(),
        );
        r.register(
            "script_verification_failures",
            "Script chunks refused (invalid) and whole scripts that did not match their descriptor (mismatch), by step",
            self.script_verification_failures.clone(),
        );
        r.register(
            "wrapper_refusals",
            "Launches refused before the wrapper was written: the working directory resolved outside every allowed root or not to a directory",
            self.wrapper_refusals.clone(),
        );
    }
}
